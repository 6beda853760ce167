"""``moetrain verify`` can fail: each classic layout bug, injected alone into the training
processes through a test-only ``sitecustomize`` (tests/helpers/verify_mutations/; nothing in
moetrain reads it), makes verification FAIL and name the quantity the bug corrupts first; the same
job without a bug passes.

One world-1 reference per job is shared by its cases (verify reuses it from the work folder); each
case runs the ep=2 layout (2 gloo processes) for 1 step, and the world-1 reshard step after it only
where the bug is in the reshard.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from moetrain.config.loader import load_config
from moetrain.verify.driver import CHECKS, plan_verification, run_verification
from moetrain.verify.layouts import parse_layouts
from moetrain.verify.report import last_line

ROOT = Path(__file__).resolve().parents[2]
HOOKS = ROOT / "tests" / "helpers" / "verify_mutations"

MIXTRAL_LIKE = ("--moe.activation=swiglu",)
"""tiny with SwiGLU experts: Mixtral can express it, so the export check runs."""

WITH_BIAS = ("--moe.router_bias_update_rate=0.01", "--moe.aux_loss_coef=0.0")
"""tiny with the auxiliary-loss-free bias update (exact in fp32, so one flipped sign fails)."""

STEPS = ("steps",)
CASES = [
    ("expert_grad_scale", MIXTRAL_LIKE, STEPS, "[dp=2,ep=2] grad_norm"),
    ("aux_loss_group", MIXTRAL_LIKE, STEPS, "[dp=2,ep=2] aux_loss"),
    ("grad_norm_replicated", MIXTRAL_LIKE, STEPS, "[dp=2,ep=2] grad_norm"),
    ("bias_local_counts", WITH_BIAS, STEPS, "[dp=2,ep=2] router bias"),
    ("optimizer_old_layout", MIXTRAL_LIKE, ("steps", "reshard"), "[dp=2,ep=2] resharded optimizer exp_avg"),
    ("export_skips_expert", MIXTRAL_LIKE, ("steps", "export"), "[dp=2,ep=2] HF export (mixtral)"),
]
"""(bug, job, checks run, the quantity it must fail first). The cases skip the checks after the
failing one (each costs another training run); the passing jobs run them all."""


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("verify")


def _verify(work: Path, overrides: tuple[str, ...], monkeypatch, mutation: str | None,
            checks: tuple[str, ...] = CHECKS):
    monkeypatch.setenv("PYTHONPATH", f"{HOOKS}{os.pathsep}{ROOT}")
    monkeypatch.delenv("MOETRAIN_TEST_MUTATION", raising=False)
    if mutation == "export_skips_expert":  # the export runs in this process: patched here
        from moetrain.interop.hf import convert

        spec = importlib.util.spec_from_file_location("verify_mutations", HOOKS / "sitecustomize.py")
        assert spec is not None and spec.loader is not None
        hooks = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(hooks)
        monkeypatch.setattr(convert, "_export_jobs", convert._export_jobs)  # restored after the test
        hooks._export_skips_expert(convert)
    elif mutation is not None:  # the training processes import the hook at start-up
        monkeypatch.setenv("MOETRAIN_TEST_MUTATION", mutation)
    cfg = load_config("tiny", list(overrides))
    plan = plan_verification(cfg, layouts=parse_layouts("ep=2"), steps=1, shrink=True, cpu=True)
    folder = work / ("bias" if overrides == WITH_BIAS else "mixtral")
    return run_verification(plan, work=folder, say=lambda _: None, checks=checks)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("overrides", [MIXTRAL_LIKE, WITH_BIAS], ids=["mixtral-like", "bias-update"])
def test_the_jobs_pass_without_a_bug(work, monkeypatch, shakespeare_cached, overrides):
    result = _verify(work, overrides, monkeypatch, None, CHECKS if overrides == MIXTRAL_LIKE else STEPS)
    assert result.first_failure is None, last_line(result)
    names = [r.quantity for r in result.results if not r.note]
    assert "[dp=2,ep=2] tokens per expert" in names and "[dp=2,ep=2] optimizer exp_avg" in names
    if overrides == WITH_BIAS:
        assert "[dp=2,ep=2] router bias" in names
    else:
        assert {"[dp=2,ep=2] resharded optimizer exp_avg", "[dp=2,ep=2] HF export (mixtral)"} <= set(names), names


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mutation, overrides, checks, quantity", CASES, ids=[c[0] for c in CASES])
def test_each_injected_bug_fails_and_is_named(work, monkeypatch, shakespeare_cached, mutation, overrides, checks,
                                              quantity):
    result = _verify(work, overrides, monkeypatch, mutation, checks)
    bad = result.first_failure
    assert bad is not None, f"{mutation} passed verification"
    assert bad.quantity == quantity, last_line(result)
    assert last_line(result).startswith(f"verify: FAIL: {quantity}")
