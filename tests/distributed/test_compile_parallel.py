"""``train.compile`` (inductor, per block) on two gloo ranks under expert parallelism, ZeRO,
pipeline parallelism and activation checkpointing: the losses of every step equal those of the
eager single-process run of the same model and global batch (see compile_parity.py).

Cases, one process launch (compile, not the tiny models, is the cost: each case traces and
compiles its blocks afresh, seconds per graph on CPU):
- ep = 2, ZeRO-1 (DDP over dp, the sharded optimizer), every block checkpointed;
- ep = 2, ZeRO-3 (FSDP2 units), the MoE layers checkpointed;
- pp = 2 (one block per stage), every block checkpointed.
ZeRO-0 wraps the model as ZeRO-1 does (the same DDP hooks around the same compiled blocks) and
ZeRO-2 as ZeRO-3 does (the same FSDP2 units, resharded after backward only), so their compiled
graphs are those covered here.

Tolerance 1e-5 relative, the bound the eager layouts meet against the same reference
(test_zero_parity.py). Inductor fuses elementwise ops and reduces in its own order, so the compiled
losses differ from eager ones by fp32 rounding only: measured at most 1.2e-7 (one ulp of a loss
near 4 is 4.8e-7). A wrong gradient or a skipped update moves the second step's loss by > 1e-3.
"""

import pytest

from tests.distributed.workers.compile_parity import CompileCase, reference
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

LOSS_RTOL = 1e-5

CASES = [
    CompileCase("ep2_zero1_ac_full", zero_stage=1, ep=2, ac="full"),
    CompileCase("zero3_ac_moe", zero_stage=3, ac="moe"),
    CompileCase("pp2_ac_full", kind="pp", ac="full"),
]

EP_GRAPH_BREAKS_FIRST_STEP = 6
"""Graph breaks dynamo meets in the first step of the ep = 2 case (docs/compile.md): the one host
sync of the expert-parallel dispatch splits each of the 6 frames on its call stack (the block's
forward, compiled inside its checkpoint, down to ``to_host``)."""


def test_compiled_layouts_follow_the_eager_run():
    results = run_ranks(_worker, 2, CASES, timeout_s=380)
    for case in CASES:
        ref = reference(case, 2)
        for rank, res in enumerate(results):
            got = res[case.name]
            assert got["graphs"][0] > 0, f"[{case.name}] rank {rank}: nothing compiled"
            for step, (a, b) in enumerate(zip(got["loss"], ref, strict=True)):
                assert abs(a - b) <= LOSS_RTOL * abs(b), f"[{case.name}] rank {rank} step {step}: {a!r} vs {b!r}"
            # The expert loads change from step to step, and every step after the first runs the code
            # compiled in it (the worker also sets dynamo's error_on_recompile after the first step; at
            # ep = 2 the exchange's host-read split sizes and byte counters are traced as symbols).
            assert len({tuple(load) for load in got["loads"]}) == len(got["loads"]), got["loads"]
            assert got["graphs"][-1] == got["graphs"][0], f"[{case.name}] rank {rank} recompiled: {got['graphs']}"
            if case.ep > 1:
                assert got["graph_breaks"][0] == EP_GRAPH_BREAKS_FIRST_STEP, (case.name, got["graph_breaks"])
                assert all("_local_scalar_dense" in reason for reason in got["break_reasons"]), got["break_reasons"]
                # The byte counters, Python ints traced as symbols, count what the eager run counts.
                assert got["comm"] == got["comm_eager"] and len({c["a2a_bytes"] for c in got["comm"]}) > 1, got["comm"]
            else:
                assert got["graph_breaks"][-1] == 0, (case.name, got["graph_breaks"])


def _worker(rank, world_size, cases):
    from tests.distributed.workers.compile_parity import compile_worker

    return compile_worker(rank, world_size, cases)
