"""``moetrain verify`` can fail: each classic layout bug, injected alone into the training
processes through a test-only ``sitecustomize`` (tests/helpers/verify_mutations/; nothing in
moetrain reads it), makes verification FAIL and name the quantity the bug corrupts first; the same
job without a bug passes.

Every run is forked from one launcher armed with the hook (each bug acts only in the runs whose
environment names it), so the training stack is imported once for the whole module. Each job's
clean verification (world 1 and ep=2, 1 step compared) is shared: the bugs of a training step
re-run the ep=2 layout beside a copy of its world-1 reference; the reshard bug re-runs only the
world-1 resume of the clean layout's checkpoint, and the export bug only re-exports it (in this
process, where the export runs).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from moetrain.config.loader import load_config
from moetrain.train.checkpoint.files import step_dir_name
from moetrain.utils.safetensors_io import SafetensorsFolder
from moetrain.verify.checks import Comparison
from moetrain.verify.driver import CHECKS, Plan, plan_verification, run_verification
from moetrain.verify.launcher import Launcher
from moetrain.verify.layouts import parse_layouts
from moetrain.verify.report import last_line
from moetrain.verify.runs import read_checkpoint

ROOT = Path(__file__).resolve().parents[2]
HOOKS = ROOT / "tests" / "helpers" / "verify_mutations"
VARIABLE = "MOETRAIN_TEST_MUTATION"

JOBS = {
    # tiny with SwiGLU experts: Mixtral can express it, so the export check runs.
    "mixtral-like": ("--moe.activation=swiglu",),
    # tiny with the auxiliary-loss-free bias update (exact in fp32, so one flipped sign fails), started
    # from an export of the full-size tiny model (checkpoint.init_from, cut to the shrunk shapes).
    "bias-update": ("--moe.router_bias_update_rate=0.01", "--moe.aux_loss_coef=0.0"),
    # LoRA on the routed experts alone: no replicated parameter trains.
    "lora-experts": ("--finetune.lora_rank=4",),
}
CLEAN_CHECKS = {"mixtral-like": CHECKS, "bias-update": ("steps",), "lora-experts": ("steps",)}

CASES = [
    ("expert_grad_scale", "mixtral-like", ("steps",), "[dp=2,ep=2] grad_norm"),
    ("aux_loss_group", "mixtral-like", ("steps",), "[dp=2,ep=2] aux_loss"),
    ("grad_norm_replicated", "mixtral-like", ("steps",), "[dp=2,ep=2] grad_norm"),
    ("bias_local_counts", "bias-update", ("steps",), "[dp=2,ep=2] router bias"),
    ("optimizer_old_layout", "mixtral-like", ("reshard",), "[dp=2,ep=2] resharded optimizer exp_avg"),
    ("export_skips_expert", "mixtral-like", ("export",), "[dp=2,ep=2] HF export (mixtral)"),
]
"""(bug, job, checks run, the quantity it must fail first). Without "steps" verify re-checks the
clean verification's layout run instead of training it again."""


@pytest.fixture(scope="module")
def launcher():
    """One launcher for the module, its processes armed with every bug (none chosen yet)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", f"{HOOKS}{os.pathsep}{ROOT}")
        mp.setenv(VARIABLE, "")
        server = Launcher()
    yield server
    server.close()


@pytest.fixture(scope="module")
def init_export(tmp_path_factory) -> Path:
    """An export of the full-size tiny model with the bias update (dim 128, 4 blocks, the BPE's 4096 rows)."""
    import torch

    from moetrain.interop.export import write_export
    from moetrain.models.transformer import Transformer

    cfg = load_config("tiny", list(JOBS["bias-update"]))
    torch.manual_seed(1)
    model = Transformer(cfg.model.with_vocab_size(cfg.data.vocab_size), moe=cfg.moe)
    with torch.no_grad():  # a selection bias already learnt: the cut must carry it to every layout
        for m in model.modules():
            if hasattr(m, "expert_bias"):
                m.expert_bias.copy_(torch.linspace(-0.05, 0.05, m.expert_bias.numel()))
    return write_export(tmp_path_factory.mktemp("init") / "export", config={}, state_dict=model.state_dict())


def _plan(job: str, init_from: Path | None = None):
    extra = [f"--checkpoint.init_from={init_from}"] if job == "bias-update" and init_from else []
    return plan_verification(load_config("tiny", [*JOBS[job], *extra]), layouts=parse_layouts("ep=2"), steps=1,
                             shrink=True, cpu=True)


@pytest.fixture(scope="module")
def clean(tmp_path_factory, launcher, init_export, shakespeare_cached):
    """Each job's verification without a bug, run once: job -> (work folder, result, plan)."""
    done: dict[str, tuple[Path, Comparison, Plan]] = {}

    def get(job: str) -> tuple[Path, Comparison, Plan]:
        if job not in done:
            work, plan = tmp_path_factory.mktemp(job), _plan(job, init_export)
            done[job] = work, run_verification(plan, work=work, say=lambda _: None, checks=CLEAN_CHECKS[job],
                                               launcher=launcher), plan
        return done[job]

    return get


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("job", list(JOBS))
def test_the_jobs_pass_without_a_bug(clean, job):
    work, result, _ = clean(job)
    assert result.first_failure is None, last_line(result)
    assert not list(work.glob("*/report/*.png"))  # log.report: false, set by the shrink, draws none
    names = [r.quantity for r in result.results if not r.note]
    assert "[dp=2,ep=2] tokens per expert" in names and "[dp=2,ep=2] optimizer exp_avg" in names
    if job == "bias-update":
        assert "[dp=2,ep=2] router bias" in names
        # The runs started from the cut export's bias (spread over +-0.05), not from zeros: one step
        # of updates at rate 0.01 (one per micro-batch, centred) moves it by much less than that.
        bias = next(k for k in read_checkpoint(work / "reference" / "checkpoints" / step_dir_name(1))
                    if k.endswith("expert_bias"))
        start = SafetensorsFolder(work / "init_from").get(bias.removeprefix("model."))
        got = read_checkpoint(work / "reference" / "checkpoints" / step_dir_name(1))[bias]
        assert start.abs().max() > 0.04 and (got - start).abs().max() <= 0.025
    elif job == "lora-experts":
        assert any("lora" in k for k in read_checkpoint(work / "layout0" / "checkpoints" / step_dir_name(1)))
    else:
        assert {"[dp=2,ep=2] resharded optimizer exp_avg", "[dp=2,ep=2] HF export (mixtral)"} <= set(names), names


def _beside_reference(work: Path) -> Path:
    """A folder holding a copy of ``work``'s world-1 reference (reused by verify, not run again):
    a bug's layout run there leaves the clean layout run intact."""
    mutated = work.with_name(work.name + "-mutated")
    if not mutated.exists():
        mutated.mkdir()
        for name in ("reference.json", "job.yaml"):
            shutil.copy(work / name, mutated / name)
        shutil.copytree(work / "reference", mutated / "reference")
    return mutated


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mutation, job, checks, quantity", CASES, ids=[c[0] for c in CASES])
def test_each_injected_bug_fails_and_is_named(clean, launcher, monkeypatch, mutation, job, checks, quantity):
    work, _, plan = clean(job)
    if plan.init_from is not None:  # the clean run's cut export: the job, hence its reference, unchanged
        cut = str(work / "init_from")
        plan = replace(plan, cfg=replace(plan.cfg, checkpoint=replace(plan.cfg.checkpoint, init_from=cut)),
                       init_from=None)
    if "steps" in checks:
        work = _beside_reference(work)
    if mutation == "export_skips_expert":  # the export runs in this process: the hook applied here
        from moetrain.interop.hf import convert

        spec = importlib.util.spec_from_file_location("verify_mutations", HOOKS / "sitecustomize.py")
        assert spec is not None and spec.loader is not None
        hooks = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(hooks)  # before the variable is set: it arms no import hook here
        monkeypatch.setattr(convert, "_export_jobs", convert._export_jobs)  # restored after the test
        hooks._export_skips_expert(convert)
    monkeypatch.setenv(VARIABLE, mutation)  # the runs' ranks take this process's environment
    result = run_verification(plan, work=work, say=lambda _: None, checks=checks, launcher=launcher)
    bad = result.first_failure
    assert bad is not None, f"{mutation} passed verification"
    assert bad.quantity == quantity, last_line(result)
    assert last_line(result).startswith(f"verify: FAIL: {quantity}")
