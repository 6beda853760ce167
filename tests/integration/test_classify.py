"""Text classification end to end through the Trainer on real gloo processes, on a small synthetic
labelled set (a train/test pair of .tsv files, no network):

- a classifier under expert parallelism (2 processes, ep=2) against one plain process with the same
  global batch: every step's loss and gradient norm, and the weights after the last step;
- an interrupted-and-resumed classification run equals one that never stopped, bit for bit;
- ``evaluate_run`` (what `moetrain eval` runs) reads the 2-process checkpoint at 1 and 2 processes and
  reproduces the run's final test metrics;
- the CLI: `moetrain eval RUN` prints them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from moetrain.config.loader import load_config
from tests.distributed.workers.zero_parity import rel_err
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
KEYS = "甲乙丙"
"""Class c's texts hold the character KEYS[c] among filler characters."""


def write_data(folder: Path) -> Path:
    """64 train and 24 test examples of 3 classes, 4 to 12 characters each."""
    gen = torch.Generator().manual_seed(0)
    filler = "天地人山水火木金土日月风云雨雪"
    folder.mkdir(parents=True, exist_ok=True)
    for name, num in (("train.tsv", 64), ("test.tsv", 24)):
        lines = []
        for i in range(num):
            label = i % 3
            chars = [filler[int(j)] for j in torch.randint(0, len(filler), (int(torch.randint(3, 11, ())),),
                                                           generator=gen)]
            chars.insert(int(torch.randint(0, len(chars) + 1, ())), KEYS[label])
            lines.append(f"c{label}\t{''.join(chars)}\n")
        (folder / name).write_text("".join(lines), encoding="utf-8")
    return folder


def overrides(run_dir: Path, data: Path, *, steps: int = 6, ep: int = 1, micro: int = 8, extra=()) -> list[str]:
    """A 2-block MoE classifier (4 experts top-2), bidirectional, attention pooling, batch 8 of 16 tokens."""
    return ["--model.dim=32", "--model.num_layers=2", "--model.num_heads=4", "--model.max_seq_len=16",
            "--model.head=classifier", "--model.num_classes=3", "--model.pooling=attention", "--model.causal=false",
            "--moe.num_experts=4", "--moe.top_k=2", "--moe.expert_hidden_dim=32", "--moe.collapse_threshold=0.75",
            "--data.corpus=path", f"--data.path={data}", "--data.seq_len=16", "--data.val_fraction=0.125",
            f"--data.cache_dir={data / 'cache'}",
            "--classify.tokenizer=char", "--classify.min_char_count=1", "--classify.label_smoothing=0.1",
            f"--train.steps={steps}", "--train.global_batch_size=8", f"--train.micro_batch_size={micro}",
            "--train.eval_every=3", "--train.device=cpu", "--optim.lr=3e-3", "--optim.warmup_steps=1",
            "--optim.schedule=constant", f"--parallel.ep={ep}", "--checkpoint.every=3",
            f"--log.run_dir={run_dir}", "--log.every=1", "--log.progress_bar=false", "--log.tensorboard=false",
            *extra]


def records(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _train(rank: int, world_size: int, args: list[str], stop_after: int | None = None) -> dict | None:
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, args))
    if stop_after is not None:  # the run is killed after this step (its checkpoint is on disk)
        trainer.cfg.train.steps = stop_after
    try:
        trainer.fit()
        params = full_params(trainer.model)
        loader = trainer.train_loader.state_dict()
    finally:
        trainer.close()
    return {"params": params, "loader": loader, "resumed": trainer.resumed_from is not None} if rank == 0 else None


def _start_cli(*args: str) -> subprocess.Popen:
    """``moetrain ARGS`` in a fresh interpreter, started and not waited for."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "moetrain.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _finish(*started: subprocess.Popen) -> list[subprocess.CompletedProcess]:
    """Wait for each; kill them all if one does not end in time (a no-op for those that ended)."""
    try:
        outputs = [proc.communicate(timeout=200) for proc in started]
    finally:
        for proc in started:
            proc.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, *output)
            for p, output in zip(started, outputs, strict=True)]


def _evaluate(rank: int, world_size: int, run_dir: Path) -> dict | None:
    from moetrain.train.evaluate import evaluate_run

    return evaluate_run(run_dir, split="test")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The one-process reference and the 2-process ep=2 run of the same job (trained once)."""
    root = tmp_path_factory.mktemp("classify")
    data = write_data(root / "data")
    ref = run_ranks(_train, 1, overrides(root / "ref", data), timeout_s=200)[0]
    ep2 = run_ranks(_train, 2, overrides(root / "ep2", data, ep=2, micro=4), timeout_s=200)[0]
    # The experts' hidden dim over the 2 data-parallel ranks, whose real-token counts differ.
    etp2 = run_ranks(_train, 2, overrides(root / "etp2", data, micro=4, extra=["--parallel.etp=2"]), timeout_s=200)[0]
    return {"root": root, "data": data, "ref": ref, "ep2": ep2, "etp2": etp2}


@pytest.mark.parametrize("layout", ["ep2", "etp2"])
def test_expert_parallel_classifier_matches_one_process(runs, layout):
    root = runs["root"]
    want, got = records(root / "ref"), records(root / layout)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 7))
    for key in ("loss", "aux_loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5), key
    for key in ("val_loss", "val_accuracy", "test_loss", "test_accuracy", "test_macro_f1"):
        assert [r["step"] for r in got if key in r] == [r["step"] for r in want if key in r], key
        assert [r[key] for r in got if key in r] == pytest.approx([r[key] for r in want if key in r], rel=1e-5), key
    assert got[-1]["val_examples"] == 8 and got[-1]["test_examples"] == 24  # every example, once
    # The etp group's gathers are counted apart from the all-to-alls (which etp = 2 at ep = 1 has none of).
    etp_bytes = [r["etp_bytes"] for r in got]
    assert all(b > 0 for b in etp_bytes) if layout == "etp2" else not any(etp_bytes), etp_bytes
    ref, got_params = runs["ref"]["params"], runs[layout]["params"]
    assert sorted(ref) == sorted(got_params)
    # Norm-wise (zero_parity's rule): AdamW divides by sqrt(v), which turns the rounding of a
    # gradient entry near zero (the cross-rank sums) into an update of order lr.
    errors = {name: rel_err(got_params[name], ref[name]) for name in ref}
    assert max(errors.values()) <= 1e-5, max(errors.items(), key=lambda kv: kv[1])
    assert records(root / "ref")[0]["loss"] > records(root / "ref")[-1]["loss"]  # it learns


def test_resumed_classification_run_is_exact(runs):
    root, data = runs["root"], runs["data"]
    args = overrides(root / "resumed", data)
    first = run_ranks(_train, 1, args, 3, timeout_s=200)[0]
    assert not first["resumed"] and first["loader"]["step"] == 3
    second = run_ranks(_train, 1, args, timeout_s=200)[0]
    assert second["resumed"]
    assert [r["loss"] for r in records(root / "resumed")] == [r["loss"] for r in records(root / "ref")]
    for name, want in runs["ref"]["params"].items():
        assert torch.equal(second["params"][name], want), name


def test_a_run_with_dropout_repeats_exactly(runs):
    """Dropout masks come from the global RNG, which the trainer seeds from train.seed and the rank: the
    same job run twice gives the same losses. Fresh interpreters (the CLI), because torch seeds a new
    process's RNG at random while forked test ranks would inherit one state."""
    root, data = runs["root"], runs["data"]
    extra = ["--model.dropout=0.3", "--classify.token_dropout=0.2", "--train.eval_every=0", "--checkpoint.every=0"]
    # The two one-thread runs side by side: one core each.
    started = [_start_cli("train", *overrides(root / name, data, extra=extra)) for name in ("dropout_a", "dropout_b")]
    for proc in _finish(*started):
        assert proc.returncode == 0, proc.stderr
    losses = [r["loss"] for r in records(root / "dropout_a") if "loss" in r]
    assert len(losses) == 6 and losses == [r["loss"] for r in records(root / "dropout_b") if "loss" in r]
    assert losses != [r["loss"] for r in records(root / "ref") if "loss" in r]  # the masks act


@pytest.mark.parametrize("layout", ["ep2", "etp2"])
def test_eval_at_other_world_sizes_reproduces_the_final_test_metrics(runs, layout):
    run_dir = runs["root"] / layout
    final = records(run_dir)[-1]
    for world in (1, 2):
        result = run_ranks(_evaluate, world, run_dir, timeout_s=200)[0]
        assert result["world_size"] == world and result["step"] == 6 and result["test_examples"] == 24
        assert result["test_confusion"] == final["test_confusion"]
        assert result["test_accuracy"] == final["test_accuracy"]
        assert result["test_loss"] == pytest.approx(final["test_loss"], rel=1e-5)
    written = json.loads((run_dir / "eval-test-step6.json").read_text())
    assert written["test_accuracy"] == final["test_accuracy"]


def test_cli_eval_prints_the_test_accuracy(runs, capsys):
    from moetrain.cli import main

    run_dir = runs["root"] / "ref"
    final = records(run_dir)[-1]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # in this process, one thread as the command's own (OMP_NUM_THREADS=1)
    try:
        assert main(["eval", str(run_dir)]) == 0
    finally:
        torch.set_num_threads(threads)
    stdout = capsys.readouterr().out
    assert f"test accuracy {final['test_accuracy']:.4f}" in stdout
    assert "c0" in stdout and "eval-test-step6.json" in stdout


def test_report_draws_the_confusion_matrix(runs):
    from moetrain.train.report import write_report

    run_dir = runs["root"] / "ref"
    names = [p.name for p in write_report(run_dir)]
    assert "confusion.png" in names and "accuracy.png" in names
    assert json.loads((run_dir / "classes.json").read_text())["classes"] == ["c0", "c1", "c2"]
