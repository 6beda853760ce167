"""Gradient compression on real gloo processes: the two-phase 1-bit all-reduce against a
hand-computed reference and, bit for bit, its packed exchange against a per-tensor reference; bf16
against the fp32 mean, the "onebit" wrapper's two modes (fp32 all-reduce in 1-bit Adam's warmup,
local gradients after it), byte counts, and exact resume. 1-bit Adam itself: test_onebit_adam.py."""

from __future__ import annotations

import pytest
import torch

from moetrain.distributed.data_parallel.compression import chunk_len, fp32_bytes, onebit_bytes
from tests.distributed.workers.grad_compression_worker import (
    grads_worker,
    packed_worker,
    reducer_worker,
    resume_worker,
)
from tests.helpers.dist_launcher import run_ranks


def _reference(grads: list[list[list[torch.Tensor]]], world: int) -> list[list[torch.Tensor]]:
    """The 1-bit Adam compressed all-reduce written out chunk by chunk: per step, the sum that
    every rank ends with, and the worker residuals of every rank after it."""
    num_tensors = len(grads[0][0])
    worker = [[torch.zeros(g.numel()) for g in grads[0][r]] for r in range(world)]
    server = [[None] * num_tensors for _ in range(world)]
    steps = []
    for step in grads:
        results = []
        for t in range(num_tensors):
            n = step[0][t].numel()
            length = chunk_len(n, world)
            decompressed = []  # [rank][chunk]
            for r in range(world):
                x = step[r][t].reshape(-1) + worker[r][t]
                chunks = [x[j * length:(j + 1) * length] for j in range(world)]
                dec = [torch.where(c >= 0, c.abs().mean(), -c.abs().mean()) if c.numel() else c for c in chunks]
                worker[r][t] = x - torch.cat(dec)
                decompressed.append(dec)
            out = []
            for j in range(world):
                y = sum(decompressed[r][j] for r in range(world))
                if server[j][t] is not None:
                    y = y + server[j][t]
                dec = torch.where(y >= 0, y.abs().mean(), -y.abs().mean()) if y.numel() else y
                server[j][t] = y - dec
                out.append(dec)
            results.append(torch.cat(out).view_as(step[0][t]))
        steps.append({"result": results, "worker": [list(w) for w in worker]})
    return steps


def _known_grads(world: int, *, steps: int = 2) -> list[list[list[torch.Tensor]]]:
    """Multiples of 1/4 in a 1024-element tensor (chunks of a power-of-two length: every scale,
    sum and residual is exact in fp32), plus odd-sized tensors whose chunks are padded."""
    g = torch.Generator().manual_seed(world)

    def one():
        return [torch.randint(-8, 9, (1024,), generator=g).float() / 4, torch.randn(37, generator=g),
                torch.randn(3, generator=g), torch.randn(4, 5, generator=g)]
    return [[one() for _ in range(world)] for _ in range(steps)]


@pytest.mark.parametrize("world", [2, 4])
def test_onebit_all_reduce_matches_hand_computed(world):
    grads = _known_grads(world)
    ranks = run_ranks(reducer_worker, world, grads, timeout_s=120)
    ref = _reference(grads, world)
    for step, expected in enumerate(ref):
        for r, res in enumerate(ranks):
            got = res[step]
            # Every rank ends with the same bits.
            for a, b in zip(got["result"], ranks[0][step]["result"], strict=True):
                assert torch.equal(a, b)
            # The exactly representable tensor matches exactly, residual included
            # (residual = g + previous residual - decompressed), after 2 steps too.
            assert torch.equal(got["result"][0], expected["result"][0])
            assert torch.equal(got["worker"]["t0"], expected["worker"][r][0])
            for i in range(1, 4):
                torch.testing.assert_close(got["result"][i], expected["result"][i], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(got["worker"][f"t{i}"], expected["worker"][r][i], rtol=1e-5, atol=1e-6)
            assert got["bytes"] == sum(onebit_bytes(g.numel(), world) for g in grads[0][0])
    # The sign x mean semantics: the 1024 result takes at most W distinct magnitudes (one per chunk).
    assert ranks[0][0]["result"][0].abs().unique().numel() <= world


def _one_tensor_onebit(xs: list[torch.Tensor], worker: list[torch.Tensor], server: list[torch.Tensor]) -> torch.Tensor:
    """One tensor's 1-bit all-reduce over W = len(xs) ranks, chunk by chunk and on its own, as
    compression.py's docstring describes it: ``xs[r]`` the tensor on rank r, ``worker[r]`` its
    worker residual [N] and ``server[r]`` its server residual (rank r's chunk [L]), both updated in
    place. A chunk's scale is the sum of |x| over its L elements (zero padded) over its real ones.
    Returns the sum every rank ends with."""
    world, n = len(xs), xs[0].numel()
    length = chunk_len(n, world)
    num_real = [min(max(n - j * length, 0), length) for j in range(world)]

    def compress(c: torch.Tensor, real: int) -> torch.Tensor:
        scale = c.abs().sum() / max(real, 1)
        return torch.where(c >= 0, scale, -scale) * (torch.arange(length) < real)

    sent: list[list[torch.Tensor]] = [[] for _ in range(world)]  # [chunk][rank]
    for r in range(world):
        x = torch.zeros(world * length)
        x[:n] = xs[r].reshape(-1) + worker[r]
        approx = [compress(x[j * length:(j + 1) * length], num_real[j]) for j in range(world)]
        worker[r].copy_((x - torch.cat(approx))[:n])
        for j in range(world):
            sent[j].append(approx[j])
    out = []
    for j in range(world):
        y = torch.stack(sent[j]).sum(dim=0) + server[j]
        out.append(compress(y, num_real[j]))
        server[j].copy_(y - out[j])
    return torch.cat(out)[:n].view_as(xs[0])


_PACKED_SHAPES = [(1,), (3,), (37,), (40,), (33,), (4, 5), (1024,), (1000,), (65,), (129,), (8, 16)]
"""Sizes that are no multiple of 8 W (padded chunks, chunks of padding only), one element, and
several tensors of the same chunk length (one segment of the packed buffers) at W = 2 and 4."""


def test_packed_exchange_is_the_per_tensor_one_bit_for_bit():
    g = torch.Generator().manual_seed(5)
    num = len(_PACKED_SHAPES)
    # All tensors, all in another order, some (a layout of their own), one, all; the reload is
    # before the third step.
    calls = [list(range(num)), list(reversed(range(num))), [5, 0, 9, 2, 7], [6], list(range(num))]
    inputs = [[[torch.randn(s, generator=g) for s in _PACKED_SHAPES] for _ in range(4)] for _ in calls]
    # Padded sizes at W = 4, in chunk-length order: 32 32 32 | 64 64 64 | 96 | 128 | 160 | 1024 1024;
    # at most 64 a bucket: [t0 t1] [t5] [t2] [t3] [t4] [t8] [t10] [t9] [t6] [t7].
    ranks = run_ranks(packed_worker, 4, inputs, calls, 64, timeout_s=120)
    assert [r[0]["bucketed"]["all_to_alls"] for r in ranks] == [10] * 4
    assert [r[0]["world"]["all_to_alls"] for r in ranks] == [1] * 4
    for kind, groups in (("world", [[0, 1, 2, 3]]), ("bucketed", [[0, 1, 2, 3]]), ("pair", [[0, 1], [2, 3]])):
        for group in groups:
            worker = [[torch.zeros(inputs[0][0][i].numel()) for _ in group] for i in range(num)]
            server = [[torch.zeros(chunk_len(inputs[0][0][i].numel(), len(group))) for _ in group] for i in range(num)]
            for s, call in enumerate(calls):
                want = {f"t{i}": _one_tensor_onebit([inputs[s][r][i] for r in group], worker[i], server[i])
                        for i in call}
                for j, r in enumerate(group):
                    got = ranks[r][s][kind]
                    assert got["result"].keys() == want.keys()
                    assert not [n for n in want if not torch.equal(got["result"][n], want[n])], (kind, s, r)
                    # The checkpoint format: per name, the worker residual [N], the server one [L].
                    state = {**{f"worker.t{i}": worker[i][j] for i in range(num)},
                             **{f"server.t{i}": server[i][j] for i in range(num)}}
                    assert got["state"].keys() == state.keys()
                    assert not [k for k in state if not torch.equal(got["state"][k], state[k])], (kind, s, r)
                    assert got["bytes"] == sum(onebit_bytes(inputs[0][0][i].numel(), len(group)) for i in call)


def test_bytes_formula_and_ratio():
    # Send buffer W * (L/8 + 4) plus all-gather output of the same size.
    assert onebit_bytes(1024, 2) == 2 * 2 * (512 // 8 + 4)
    assert onebit_bytes(4096, 4) == 2 * 4 * (1024 // 8 + 4)
    for world in (2, 4, 8, 16):
        for numel in (480 * world, 10_000, 1 << 20):
            assert onebit_bytes(numel, world) <= fp32_bytes(numel) / 30, (numel, world)
    # The per-chunk scales are what limits small tensors: 1/32 + W/N.
    assert onebit_bytes(1024, 2) <= fp32_bytes(1024) / 30
    assert onebit_bytes(1024, 4) > fp32_bytes(1024) / 30


@pytest.mark.parametrize("mode,ep", [("bf16", 1), ("onebit", 1), ("onebit", 2)])
def test_wrapper_modes(mode, ep):
    ranks = run_ranks(grads_worker, 2, mode, ep, timeout_s=150)
    none, comp = ranks[0]["none"], ranks[0][mode]
    dp, edp = none["dp"], none["edp"]
    expert = {n for n in none["grads"] if "experts" in n}
    # Replicas end with identical gradients in every mode (expert shards differ across ep ranks).
    for r in ranks[1:]:
        for n, g in r[mode]["grads"].items():
            if ep == 1 or n not in expert:
                assert torch.equal(g, comp["grads"][n]), n
    dense_numel = [v for n, v in none["numel"].items() if n not in expert]
    expert_numel = [v for n, v in none["numel"].items() if n in expert] if edp > 1 else []
    fp32 = sum(map(fp32_bytes, dense_numel + expert_numel))
    assert none["stats"] == {"grad_bytes": fp32, "grad_bytes_ratio_vs_fp32": 1.0}
    if mode == "bf16":
        assert comp["stats"]["grad_bytes"] == fp32 / 2
        for n, g in none["grads"].items():
            # Within bf16 rounding of the inputs and of the sum: a few 2^-8 of the largest term.
            scale = max(r["bf16"]["local"][n].abs().max() for r in ranks) / dp
            assert (comp["grads"][n] - g).abs().max() <= 2 ** -7 * len(ranks) * scale + 1e-12, n
    else:
        # 1-bit Adam's warmup: the fp32 all-reduce of "none", bit for bit, and its bytes.
        assert comp["stats"] == none["stats"]
        for n, g in comp["grads"].items():
            assert torch.equal(g, none["grads"][n]), n
        # Its compression stage: nothing reduced, no bytes; each rank keeps its estimate of the
        # global gradient: the local gradient, times edp / W for an expert shard (1/W rule).
        assert comp["local_mode_stats"] == {"grad_bytes": 0.0, "grad_bytes_ratio_vs_fp32": 0.0}
        for r in ranks:
            for n, g in r[mode]["local_mode"].items():
                want = r[mode]["local"][n] * (edp / dp) if n in expert and ep > 1 else r[mode]["local"][n]
                assert torch.equal(g, want), n


def test_onebit_exact_resume_and_layout_change(tmp_path):
    ranks = run_ranks(resume_worker, 2, str(tmp_path), timeout_s=240)
    for r in ranks:
        assert r["resumed"] == r["straight"]  # bit for bit
        assert r["nonzero_saved"] and r["restored_equal"]
        assert not any("residuals reset" in m for m in r["warnings_same_layout"])
        assert any("residuals reset" in m and "layout" in m for m in r["warnings_other_layout"])
        assert r["reset"]
