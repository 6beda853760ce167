"""1-bit Adam resumes bit for bit through the real trainer, from a checkpoint saved inside its
warmup and from one saved after the variance froze (momenta, frozen variance, step and both
error-feedback residuals of every rank come back). Reference: the same run never stopped; it
saves those two checkpoints itself (saving changes nothing in a run), and each resumes in a run
directory of its own."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch.distributed.tensor import DTensor

from moetrain.config.loader import load_config
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides

STEPS, WARMUP = 10, 4


def _ov(run_dir, *, ep: int, every: int = 0) -> list[str]:
    return job_overrides(run_dir, steps=STEPS, ep=ep, extra=(
        "--dp.grad_compression=onebit", f"--dp.onebit_warmup_steps={WARMUP}", "--train.deterministic=true",
        "--checkpoint.save_final=false", f"--checkpoint.every={every}", "--checkpoint.keep_last=0"))


def _records(run_dir) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _state(trainer) -> dict[str, torch.Tensor]:
    """This rank's weights, Adam state and 1-bit residuals."""
    from moetrain.distributed.data_parallel.ddp import grad_compression_state

    out = {f"param/{n}": _local(p) for n, p in trainer.model.named_parameters()}
    for n, p in trainer.model.named_parameters():
        for key, value in sorted(trainer.optimizer.state.get(p, {}).items()):
            out[f"adam/{n}/{key}"] = _local(value)
    out.update({f"residual/{k}": v.clone() for k, v in grad_compression_state(trainer.parallel_model).items()})
    return out


def _fit(rank: int, world_size: int, overrides: list[str]) -> dict:
    """One trainer (they own the process group, so one per ``run_ranks``): this rank's state right
    after construction (a resume loads there), at each checkpoint it saves, and after training;
    rank 0's metrics records."""
    from moetrain.train.trainer import Trainer

    torch.use_deterministic_algorithms(True)  # this child process only
    trainer = Trainer(load_config(None, overrides))
    out = {"step": trainer.step, "loaded": _state(trainer), "saved": {}}
    save = trainer.checkpointer.save

    def record_and_save(snapshot):  # the state the checkpoint being written holds
        out["saved"][trainer.step] = _state(trainer)
        return save(snapshot)

    trainer.checkpointer.save = record_and_save
    trainer.fit()
    out["final"] = _state(trainer)
    trainer.close()
    out["records"] = _records(trainer.run_dir) if rank == 0 else None
    return out


def _differ(a: dict, b: dict) -> list[str]:
    assert sorted(a) == sorted(b)
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_onebit_resume_is_exact(tmp_path, shakespeare_cached, ep):
    stops = (WARMUP - 1, WARMUP + 2)  # saved inside the warmup, and after the freeze
    ref = run_ranks(_fit, 2, _ov(tmp_path / "ref", ep=ep, every=stops[1] - stops[0]), timeout_s=240)
    assert [sorted(ref[r]["saved"]) for r in range(2)] == [[3, 6, 9]] * 2
    want = ref[0]["records"]
    assert [r["step"] for r in want] == list(range(1, STEPS + 1))
    # The run compresses after the warmup: full fp32 bytes before, the 1-bit exchange after.
    assert all(r["grad_bytes_ratio_vs_fp32"] == 1.0 for r in want[:WARMUP])
    assert all(r["grad_bytes_ratio_vs_fp32"] < 0.1 for r in want[WARMUP:])
    for stop in stops:
        run_dir, name = tmp_path / f"stop{stop}", f"step_{stop:09d}"
        shutil.copytree(tmp_path / "ref" / "checkpoints" / name, run_dir / "checkpoints" / name)
        resumed = run_ranks(_fit, 2, _ov(run_dir, ep=ep), timeout_s=240)
        for r in range(2):
            saved, got = ref[r]["saved"][stop], resumed[r]
            assert got["step"] == stop
            # The resumed trainer starts from what was saved: weights, Adam state, residuals.
            assert _differ(got["loaded"], saved) == []
            residuals = [k for k in saved if k.startswith("residual/") and k != "residual/layout"]
            assert any(saved[k].any() for k in residuals) == (stop > WARMUP)
            # And ends where the run that never stopped ended, bit for bit.
            assert _differ(got["final"], ref[r]["final"]) == [], stop
        got = resumed[0]["records"]
        assert [r["step"] for r in got] == list(range(stop + 1, STEPS + 1))
        for key in ("loss", "grad_norm", "grad_bytes"):
            assert [r[key] for r in got] == [r[key] for r in want[stop:]], (stop, key)
