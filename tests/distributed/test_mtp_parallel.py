"""Multi-token prediction (model.mtp_depth = 2) under expert parallelism and ZeRO stages 0-3 on two
gloo ranks, against one plain process with the same global batch and weights (zero_parity.py):
the loss and global gradient norm of every step within 1e-5 relative, every parameter after the
steps within 1e-4 (the multi-token modules' and the shared embedding/head included). Then the
trainer at ep = 2, ZeRO-1 and at pp = 2 logs mtp_loss_1 and mtp_loss_2. (Pipeline parallelism's
parity: test_mtp_pipeline.py; tensor parallelism refuses model.mtp_depth by name: tests/unit/test_mtp.py.)"""

import math
import random

import pytest

from tests.distributed.workers.zero_parity import Run, assert_matches, run_reference
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MTP = {"mtp_depth": 2, "mtp_loss_weight": 0.5}


def test_mtp_under_ep_and_zero(tmp_path):
    runs = [Run(f"stage{s}_ep{ep}", s, ep=ep, steps=4, model=MTP) for s, ep in ((0, 1), (0, 2), (1, 2), (2, 2), (3, 2))]
    runs.append(Run("stage3_accum", 3, ep=2, steps=4, micro_batches=2, model=MTP))
    data = tmp_path / "text"
    data.mkdir()
    rng = random.Random(0)
    words = ["thou", "art", "the", "king", "night"]
    (data / "a.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(200)))
    results = run_ranks(_worker, 2, runs, tmp_path / "run", data,
                        ["--model.mtp_depth=2", "--parallel.ep=2", "--parallel.zero_stage=1"], timeout_s=200)
    refs = {mb: run_reference(Run("ref", 0, steps=4, micro_batches=mb, model=MTP)) for mb in (1, 2)}
    for run in runs:
        assert_matches(run, results, refs[run.micro_batches], rtol=1e-5, param_rtol=1e-4)
    pipelined = run_ranks(_worker, 2, [], tmp_path / "pp", data, ["--model.mtp_depth=2", "--parallel.pp=2"],
                          timeout_s=120)
    for trainer_records in (results[0]["trainer"], pipelined[0]["trainer"]):
        records = [r for r in trainer_records if "loss" in r]
        assert len(records) == 2
        for r in records:
            assert all(math.isfinite(r[f"mtp_loss_{k}"]) and r[f"mtp_loss_{k}"] > 0 for k in (1, 2))
            assert "mtp_loss_3" not in r


def _worker(rank, world_size, runs, run_dir, data, overrides):
    from tests.distributed.workers.mtp_parity import mtp_worker

    return mtp_worker(rank, world_size, runs, run_dir, data, overrides)
