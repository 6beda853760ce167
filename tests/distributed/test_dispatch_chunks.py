"""moe.dispatch_chunks and the shared experts overlapped with the dispatch, on real gloo ranks.

What must hold, and why exactly:

* The dispatcher's own work is exact: a chunk is the unchunked dispatch restricted to its tokens,
  every row crosses with the same bytes, and every per-token sum (the combine, the backward of the
  gathers) adds the same terms in the same order. With experts that compute each row alone
  (``RowwiseExperts``), chunked and unchunked runs give EQUAL outputs and gradients (torch.equal),
  per copy and once per rank, dropless and with drops, in every wire format, with empty chunks.
* The expert GEMMs are not row-count invariant, so with the real experts only a tolerance can
  hold. Two causes, both fp32 rounding: (1) the expert weight gradient ``x.T @ dy`` sums over the
  rows of an expert, and chunking splits that sum into C partial GEMMs added afterwards, another
  summation order; (2) the CPU GEMM computes a row with another kernel when a call has 1-3 rows
  than when it has more (``x[:m] @ w`` differs from ``(x @ w)[:m]`` in the last bits for m < 4
  on this machine; cuBLAS likewise picks kernels by shape), and chunks hand the experts fewer
  rows. The bound asserted, 1e-6 norm-wise (8 fp32 ulps), is far below any routing or ordering
  error (those are O(1)) and is met by the largest measured difference with room.
* Chunking changes only the count metadata on the wire: all C chunks' counts travel in the one
  count exchange (C times as many), plus with a capacity factor one exchange of per-chunk kept
  counts; token bytes and the minimum are unchanged (asserted to the byte).
* The shared experts run after the dispatch rows are launched and before they are waited for,
  and chunk c+1's dispatch leaves before chunk c's experts, chunk c's combine before chunk c+1's
  experts (the recorded op order).
"""

import pytest
import torch

from moetrain.distributed.expert_parallel.wire import TOKEN_BOUND, int_wire_dtype
from tests.distributed.workers.chunks_worker import layer_worker, order_worker, reference
from tests.distributed.workers.ep_parity import assert_rel_close
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

P, L, K = 2, 4, 2  # ep ranks, local experts (E = 8), experts per token
GEMM_RTOL = 1e-6
MODES = {"dropless": {}, "capacity_position": {"capacity_factor": 1.0},
         "capacity_score": {"capacity_factor": 0.75, "drop_policy": "score"}}
EQUAL_TOKENS, UNEQUAL_TOKENS = [12, 12], [16, 3]
# 16 > 12: four empty chunks on every rank; 5 > 3: rank 1's chunks hold 1, 1, 1, 0, 0 tokens.
CHUNKS = {tuple(EQUAL_TOKENS): (1, 2, 3, 16), tuple(UNEQUAL_TOKENS): (1, 2, 3, 5)}


def _jobs():
    jobs = {}
    for tokens in (EQUAL_TOKENS, UNEQUAL_TOKENS):
        # Capacity mode needs the same token count on every rank.
        modes = MODES if tokens == EQUAL_TOKENS else {"dropless": {}}
        for experts, wires in (("rowwise", ("none", "bf16", "fp8_e4m3")), ("grouped", ("none",))):
            for mode, moe in modes.items():
                for dedup in (False, True):
                    for wire in wires:
                        for chunks in CHUNKS[tuple(tokens)]:
                            key = (experts, tuple(tokens), mode, dedup, wire)
                            jobs[key + (chunks,)] = (experts, tokens, {**moe, "dispatch_dedup": dedup,
                                                                       "dispatch_dtype": wire,
                                                                       "dispatch_chunks": chunks})
    return jobs


def _layer(rank, world_size, jobs):
    return layer_worker(rank, world_size, jobs)


def _extra_count_bytes(tokens: int, *, chunks: int, capacity: bool, dedup: bool, wire: str) -> int:
    """Count bytes a rank of 2 sends beyond the unchunked run (and receives): C-1 more [L] blocks of
    copy counts, or with a capacity factor C of them in an exchange of their own; once per rank C-1
    more unique-row counts. Counts travel as int64, or compressed as int32 whatever the rank's token
    count (``wire.TOKEN_BOUND``: every rank decodes with the width the others encoded with)."""
    width = 8 if wire == "none" else torch.tensor([], dtype=int_wire_dtype(TOKEN_BOUND)).element_size()
    assert wire == "none" or width == 4
    extra = (P - 1) * L * width * (chunks if capacity else chunks - 1)
    if dedup:
        extra += (P - 1) * width * (chunks - 1)
    return extra


def _assert_equal_runs(got, base, what):
    assert torch.equal(got["out"], base["out"]), f"{what}: output"
    assert torch.equal(got["x_grad"], base["x_grad"]), f"{what}: input gradient"
    assert got["grads"].keys() == base["grads"].keys()
    for name, g in got["grads"].items():
        assert torch.equal(g, base["grads"][name]), f"{what}: gradient of {name}"
    assert got["dropped"] == base["dropped"], what


def _assert_close_runs(got, base, what, rtol):
    assert_rel_close(got["out"], base["out"], f"{what}: output", rtol)
    assert_rel_close(got["x_grad"], base["x_grad"], f"{what}: input gradient", rtol)
    for name, g in got["grads"].items():
        assert_rel_close(g, base["grads"][name], f"{what}: gradient of {name}", rtol)
    assert got["dropped"] == base["dropped"], what


def _assert_matches_reference(ranks, ref, what):
    """The ranks against one process: outputs and input gradients by rank order, replicated
    parameters' gradients summed over the ranks (each rank's tokens contribute theirs), expert
    shards concatenated in expert order."""
    assert_rel_close(torch.cat([r["out"] for r in ranks]), ref["out"], f"{what}: output")
    assert_rel_close(torch.cat([r["x_grad"] for r in ranks]), ref["x_grad"], f"{what}: input gradient")
    for name, expected in ref["grads"].items():
        pieces = [r["grads"][name] for r in ranks]
        got = torch.cat(pieces) if name.startswith("experts.") else torch.stack(pieces).sum(dim=0)
        assert_rel_close(got, expected, f"{what}: gradient of {name}")
    assert sum(r["dropped"] for r in ranks) == ref["dropped"], what


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_chunked_dispatch_equals_unchunked_and_the_single_process():
    jobs = _jobs()
    results = run_ranks(_layer, 2, jobs, timeout_s=200)
    worst_gemm = 0.0
    for key, (experts, tokens, moe) in jobs.items():
        *case, chunks = key
        _, _, mode, dedup, wire = case
        ranks = [r[key] for r in results]
        if mode != "dropless":
            assert sum(r["dropped"] for r in ranks) > 0, f"{key}: no copy was dropped"
        if wire == "none":
            _assert_matches_reference(ranks, reference(experts, tokens, moe), str(key))
        if chunks == 1:
            continue
        for rank, (got, base) in enumerate(zip(ranks, (r[tuple(case) + (1,)] for r in results), strict=True)):
            what = f"{key} rank {rank} vs unchunked"
            if experts == "rowwise":
                _assert_equal_runs(got, base, what)
            else:
                _assert_close_runs(got, base, what, GEMM_RTOL)
                worst_gemm = max(worst_gemm, _rel(got["grads"]["experts.w1"], base["grads"]["experts.w1"]))
            _check_bytes(got["stats"], base["stats"], what, tokens=tokens[rank], chunks=chunks,
                         capacity=mode != "dropless", dedup=dedup, wire=wire)
    # The GEMM path really differs somewhere (else the rowwise test alone would do).
    assert worst_gemm > 0


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _check_bytes(got, base, what, **shape):
    for field in ("dispatch_bytes", "dispatch_min_bytes_fp32", "min_bytes", "min_bytes_fp32"):
        assert getattr(got, field) == getattr(base, field), f"{what}: {field}"
    extra = _extra_count_bytes(shape.pop("tokens"), **shape)
    assert got.bytes_sent == base.bytes_sent + extra, f"{what}: bytes sent"
    assert got.bytes_received == base.bytes_received + extra, f"{what}: bytes received"


# ----- the order of events -----------------------------------------------------------------------------


def _expected_order(chunks: int) -> list[str]:
    """Dispatch of chunk 0, the shared experts while it travels, then per chunk c: chunk c+1's
    dispatch leaves, chunk c arrives, its experts run, its combine leaves; then the combines land."""
    events = ["launch", "shared_start", "shared_end"]
    for c in range(chunks):
        if c + 1 < chunks:
            events.append("launch")
        events += ["wait", "experts", "launch"]
    return events + ["wait"] * chunks


ORDER_SETTINGS = {f"{wire}_{'dedup' if dedup else 'copy'}_c{chunks}": {"dispatch_dtype": wire,
                                                                      "dispatch_dedup": dedup,
                                                                      "dispatch_chunks": chunks}
                  for wire in ("none", "fp8_e4m3") for dedup in (False, True) for chunks in (1, 2, 3)}


def _order(rank, world_size):
    return order_worker(rank, world_size, ORDER_SETTINGS)


def test_shared_experts_run_while_the_dispatch_is_in_flight():
    results = run_ranks(_order, 2, timeout_s=120)
    for name, setting in ORDER_SETTINGS.items():
        for rank, res in enumerate(results):
            assert res[name] == _expected_order(setting["dispatch_chunks"]), (name, rank, res[name])
