"""Multi-token prediction (model.mtp_depth = 2) under expert parallelism, ZeRO stages 0-3 and tensor
parallelism on two gloo ranks, against one plain process with the same global batch and weights.
ZeRO (zero_parity.py): the loss and global gradient norm of every step within 1e-5 relative, every
parameter after the steps within 1e-4 (the multi-token modules' and the shared embedding/head
included). Tensor parallelism (tp_parity.py; every depth padded to the S positions, which split
over tp): besides those, each depth's loss, every gradient of the first step, and the routed copies
per expert of every MoE layer exactly (the padded positions are not routed), at tp = 2 with the
sequence-wise balance loss and at tp = 2 x ep = 2, ZeRO-1. Then the trainer at tp = 2 x ep = 2,
ZeRO-1 and at pp = 2 logs mtp_loss_1 and mtp_loss_2. (Pipeline parallelism's parity:
test_mtp_pipeline.py.)"""

import math
import random

import pytest
import torch

from tests.distributed.workers import tp_parity
from tests.distributed.workers.zero_parity import Run, assert_matches, rel_err, run_reference
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MTP = {"mtp_depth": 2, "mtp_loss_weight": 0.5}


def test_mtp_under_ep_zero_and_tp(tmp_path):
    runs = [Run(f"stage{s}_ep{ep}", s, ep=ep, steps=4, model=MTP) for s, ep in ((0, 1), (0, 2), (1, 2), (2, 2), (3, 2))]
    runs.append(Run("stage3_accum", 3, ep=2, steps=4, micro_batches=2, model=MTP))
    data = tmp_path / "text"
    data.mkdir()
    rng = random.Random(0)
    words = ["thou", "art", "the", "king", "night"]
    (data / "a.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(200)))
    # Two steps: AdamW's first update is about lr * sign(gradient) even for entries near its eps (a few
    # shared-expert entries of the modules here are ~1e-8), where rounding moves it; by the third step
    # that shows in other gradients at ~5e-4 relative. The gradients of the first step are the test.
    tp_runs = [tp_parity.TpRun("tp2_sequence_aux", tp=2, steps=2, model=MTP, moe={"aux_loss_type": "sequence"}),
               tp_parity.TpRun("tp2_ep2_zero1", tp=2, ep=2, zero_stage=1, steps=2, model=MTP)]
    results = run_ranks(_worker, 2, runs, tmp_path / "run", data,
                        ["--model.mtp_depth=2", "--parallel.tp=2", "--parallel.ep=2", "--parallel.zero_stage=1"],
                        tp_runs, timeout_s=200)
    refs = {mb: run_reference(Run("ref", 0, steps=4, micro_batches=mb, model=MTP)) for mb in (1, 2)}
    for run in runs:
        assert_matches(run, results, refs[run.micro_batches], rtol=1e-5, param_rtol=1e-4)
    for tp_run in tp_runs:
        _check_tensor_parallel(tp_run, results)
    pipelined = run_ranks(_worker, 2, [], tmp_path / "pp", data, ["--model.mtp_depth=2", "--parallel.pp=2"], [],
                          timeout_s=120)
    for trainer_records in (results[0]["trainer"], pipelined[0]["trainer"]):
        records = [r for r in trainer_records if "loss" in r]
        assert len(records) == 2
        for r in records:
            assert all(math.isfinite(r[f"mtp_loss_{k}"]) and r[f"mtp_loss_{k}"] > 0 for k in (1, 2))
            assert "mtp_loss_3" not in r


def _check_tensor_parallel(run: tp_parity.TpRun, results: list[dict]) -> None:
    ref = tp_parity.run_reference(run)
    assert ref["mtp"] is not None and len(ref["routed"]) == 3  # one MoE block in the trunk, one per depth
    for rank, res in enumerate(results):
        got = res[run.name]
        torch.testing.assert_close(got["mtp"], ref["mtp"], rtol=1e-5, atol=0, msg=lambda m: f"[{run.name}] {m}")
        for layer, (a, b) in enumerate(zip(got["routed"], ref["routed"], strict=True)):
            assert torch.equal(a, b), f"[{run.name}] rank {rank} MoE layer {layer}: routed {a.tolist()} != {b.tolist()}"
        for key in ("loss", "grad_norm"):
            for s, (a, b) in enumerate(zip(got[key], ref[key], strict=True)):
                assert abs(a - b) <= 1e-5 * abs(b), f"[{run.name}] rank {rank} step {s} {key} {a} != {b}"
    got = results[0][run.name]
    for name, exp in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], exp, rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    for name, exp in ref["params"].items():
        assert rel_err(got["params"][name], exp) <= 1e-4, f"[{run.name}] parameter {name}"


def _worker(rank, world_size, runs, run_dir, data, overrides, tp_runs):
    from tests.distributed.workers.mtp_parity import mtp_worker

    return mtp_worker(rank, world_size, runs, run_dir, data, overrides, tp_runs)
