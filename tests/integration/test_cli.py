"""The command line end to end: `moetrain train` under torchrun on 2 gloo ranks leaves a
complete run directory, and the saved config.yaml reproduces the run exactly."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import job_overrides, read_losses

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def _torchrun(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "moetrain.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_train_under_torchrun_and_reproduce_from_saved_config(tmp_path, shakespeare_cached):
    run = tmp_path / "run"
    overrides = job_overrides(run, steps=6, ep=2, extra=("--log.tensorboard=true", "--train.eval_every=3",
                                                         "--train.eval_steps=2"))
    r = _torchrun(["train", *overrides])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "final val loss" in r.stdout
    for name in ("config.yaml", "metrics.jsonl", "report/loss.png", "report/throughput.png",
                 "report/expert_load.png", "report/dropped.png"):
        assert (run / name).is_file(), name
    assert any((run / "tensorboard").glob("events.out.tfevents.*"))
    losses = read_losses(run)
    assert len(losses) == 6

    # The saved config is the whole run: re-running it (into another folder) gives the same losses.
    again = tmp_path / "again"
    r2 = _torchrun(["train", "--config", str(run / "config.yaml"), f"--log.run_dir={again}"])
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    assert read_losses(again) == losses


def test_bad_config_fails_fast_with_the_field_named(tmp_path):
    cmd = [sys.executable, "-m", "moetrain.cli", "train", "--nproc", "2", "--moe.num_experts=8",
           "--parallel.ep=3", f"--log.run_dir={tmp_path / 'x'}"]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert "parallel.ep (3) must divide moe.num_experts (8)" in r.stderr
    assert not (tmp_path / "x").exists()  # nothing was started or written


def _process(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moetrain.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120, check=False)


def _cli(args: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """A command that starts no process, run in this one (an interpreter start per check was
    most of this module's time): its exit status, stdout and stderr as the command's would be."""
    from moetrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as e:  # argparse's refusals
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["moetrain", *args], code, out.getvalue(), err.getvalue())


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    """The single ``moetrain: error: ...`` line of a refused command (no traceback)."""
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("moetrain: error: ")]
    assert len(lines) == 1, r.stderr
    return lines[0].removeprefix("moetrain: error: ")


@pytest.mark.parametrize("config", ["moetrain/configs/tiny.yaml", "tiny"])
def test_config_show_prints_the_resolved_config(config):
    r = _cli(["config", "show", "--config", config, "--moe.top_k=1"])
    assert r.returncode == 0, r.stderr
    assert re.search(r"^\* moe\.top_k\s+= 1$", r.stdout, re.MULTILINE), r.stdout
    assert re.search(r"^  moe\.num_experts\s+= 8$", r.stdout, re.MULTILINE), r.stdout
    assert re.search(r"^\* parallel\.ep\s+= 2$", r.stdout, re.MULTILINE), r.stdout


def test_a_config_that_is_neither_file_nor_name_lists_the_shipped_ones(tmp_path):
    message = _one_error_line(_cli(["config", "show", "--config", "tiny.yml"], cwd=tmp_path))
    assert message == ("--config ('tiny.yml') is neither a file nor a shipped config; shipped configs: "
                       + ", ".join(sorted(p.stem for p in (ROOT / "moetrain" / "configs").glob("*.yaml"))))


def test_config_show_checks_the_layout_when_it_knows_the_world():
    # tiny: ep=2 over 8 experts; 3 processes cannot hold ep groups of 2.
    message = _one_error_line(_cli(["config", "show", "--config", "tiny", "--nproc", "3"]))
    assert message.startswith("parallel.ep (2) must divide the world size (3)"), message
    message = _one_error_line(_cli(["config", "show", "--config", "tiny", "--nproc", "4", "--parallel.ep=4",
                                    "--moe.num_experts=6"]))
    assert "parallel.ep (4) must divide moe.num_experts (6)" in message
    assert _cli(["config", "show", "--config", "tiny", "--nproc", "4", "--train.micro_batch_size=4"]).returncode == 0


def test_layout_rules_that_hold_at_any_world_are_checked_without_nproc():
    message = _one_error_line(_cli(["config", "show", "--config", "tiny", "--parallel.ep=3"]))
    assert message == "parallel.ep (3) must divide moe.num_experts (8)", message


def test_batch_that_does_not_split_over_the_ranks_fails_once_before_launch():
    # tiny: 16 sequences per step, micro-batch 8; 3 ranks cannot split them.
    r = _process(["train", "--config", "tiny", "--nproc", "3", "--parallel.ep=1"])
    assert r.returncode != 0
    assert _one_error_line(r) == ("train.global_batch_size (16) must be divisible by train.micro_batch_size * "
                                  "data-parallel size (8 * 3 = 24)")
    assert "ChildFailedError" not in r.stderr and r.stderr.count("global_batch_size") == 1, r.stderr
    message = _one_error_line(_cli(["config", "show", "--config", "tiny", "--nproc", "8", "--parallel.ep=4"]))
    assert message.startswith("train.global_batch_size (16) must be divisible"), message


@pytest.mark.filterwarnings("ignore:DeepSpeed config. ignoring keys")  # the fixture's keys moetrain has no use for
def test_deepspeed_ep_size_larger_than_the_world_asks_for_nproc():
    ds = str(ROOT / "tests" / "fixtures" / "ds_zero3_moe.json")  # ep_size 8
    message = _one_error_line(_cli(["config", "show", "--deepspeed", ds]))
    assert message == (f"moe.ep_size (8) of {ds} needs a world of at least 8 processes: pass --nproc N, "
                       "the number of processes of the job")
    r = _cli(["config", "show", "--deepspeed", ds, "--nproc", "16"])
    assert r.returncode == 0, r.stderr
    assert re.search(r"^\* parallel\.ep\s+= 8$", r.stdout, re.MULTILINE), r.stdout


def test_plan_on_eight_ranks_says_which_micro_batch_it_assumed():
    r = _cli(["plan", "--nproc", "8"])
    assert r.returncode == 0, r.stderr
    assert "note: planned with micro-batch 2 and 1 accumulation step(s)" in r.stdout
    assert "train.micro_batch_size (8)" in r.stdout and "zero=" in r.stdout


def test_an_unknown_corpus_fails_before_any_process_starts(tmp_path):
    message = _one_error_line(_cli(["train", "--nproc", "2", "--data.corpus=shakspeare",
                                    f"--log.run_dir={tmp_path / 'x'}"]))
    assert message == ("data.corpus ('shakspeare') must be one of '20newsgroups', 'r52', 'r8', 'shakespeare', "
                       "'sotu', 'thucnews', or 'path' with data.path=DIR")
    assert not (tmp_path / "x").exists()


def test_the_checkpoints_a_job_names_are_checked_once_before_launch(tmp_path, monkeypatch, shakespeare_cached):
    """A missing resume or init_from path, or a checkpoint of another model, is one line and exit 2
    before any rank starts (under torchrun: the error once per rank, then its ChildFailedError)."""
    from tests.helpers.dist_launcher import run_ranks
    from tests.integration.conftest import train_job

    nope = tmp_path / "nope"
    r = _process(["train", "--nproc", "2", *job_overrides(tmp_path / "a", ep=2), f"--checkpoint.resume={nope}"])
    assert _one_error_line(r) == f"checkpoint {str(nope)!r} does not exist"
    assert "ChildFailedError" not in r.stderr and not (tmp_path / "a").exists()

    import moetrain.cli.train as cli_train

    monkeypatch.setattr(cli_train, "launch", lambda *args: pytest.fail(f"launched {args}"))
    message = _one_error_line(_cli(["train", "--nproc", "2", *job_overrides(tmp_path / "a", ep=2),
                                    f"--checkpoint.init_from={nope}"]))
    assert message.startswith(f"checkpoint.init_from ({str(nope)!r}) must be a moetrain export folder"), message
    run = tmp_path / "run"
    run_ranks(train_job, 1, job_overrides(run, steps=1), timeout_s=120)
    message = _one_error_line(_cli(["train", "--nproc", "2", *job_overrides(run, steps=2, ep=2),
                                    "--moe.top_k=1"]))
    assert message.startswith(f"checkpoint {str(run / 'checkpoints' / 'step_000000001')!r} does not match this "
                              "job's model: moe.top_k (saved 2, now 1). A resume continues the same model"), message
