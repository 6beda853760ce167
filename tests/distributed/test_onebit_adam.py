"""1-bit Adam (dp.grad_compression "onebit") on real gloo processes: the warmup is torch's AdamW
over fp32 all-reduces bit for bit; after it the variance stays frozen, the replicas stay
bit-identical, and a step moves the 1-bit bytes; one compressed step against a hand-computed
reference on known values. (Exact resume through the trainer: tests/integration/test_onebit_resume.py.)
"""

from __future__ import annotations

import pytest
import torch

from moetrain.distributed.data_parallel.compression import fp32_bytes, onebit_bytes
from tests.distributed.test_grad_compression import _reference
from tests.distributed.workers.onebit_adam_worker import momentum_worker, stages_worker
from tests.helpers.dist_launcher import run_ranks

WARMUP, STEPS = 3, 7


def _same(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (bit for bit)."""
    assert sorted(a) == sorted(b)
    return [n for n in a if not torch.equal(a[n], b[n])]


@pytest.mark.slow
@pytest.mark.parametrize("world,ep", [(2, 1), (2, 2), (4, 2)])
def test_onebit_adam_stages(world, ep):
    ranks = run_ranks(stages_worker, world, ep=ep, warmup=WARMUP, steps=STEPS, timeout_s=300)
    first = ranks[0]["onebit"]
    assert first["optimizer"] == "OneBitAdam" and ranks[0]["none"]["optimizer"] == "AdamW"
    replicated = first["replicated"]
    # Expert shards have copies to average with only at edp > 1; the dense weights always do.
    assert all(replicated[n] for n in replicated if "experts" not in n)
    assert all(replicated[n] == (first["edp"] > 1) for n in replicated if "experts" in n)
    dense_numel = [k for n, k in first["numel"].items() if "experts" not in n]
    expert_numel = [k for n, k in first["numel"].items() if "experts" in n]
    fp32 = sum(map(fp32_bytes, dense_numel + (expert_numel if first["edp"] > 1 else [])))
    onebit = (sum(onebit_bytes(k, first["dp"]) for k in dense_numel)
              + (sum(onebit_bytes(k, first["edp"]) for k in expert_numel) if first["edp"] > 1 else 0))

    for r in ranks:
        none, comp = r["none"]["records"], r["onebit"]["records"]
        # 1. Warmup: AdamW over fp32 all-reduced gradients, bit for bit (weights and moments).
        for s in range(WARMUP):
            for key in ("params", "m", "v"):
                assert not _same(comp[s][key], none[s][key]), (s, key, _same(comp[s][key], none[s][key])[:4])
            assert comp[s]["stats"] == {"grad_bytes": fp32, "grad_bytes_ratio_vs_fp32": 1.0}
        assert [rec["local_mode"] for rec in comp] == [s + 1 >= WARMUP for s in range(STEPS)]
        # 2. After the freeze: v of every parameter with replicas stays as it was at the freeze;
        #    expert shards without replicas keep AdamW's variance updates.
        frozen = comp[WARMUP - 1]["v"]
        for s in range(WARMUP, STEPS):
            changed = _same(comp[s]["v"], frozen)
            assert not [n for n in changed if replicated[n]], (s, changed[:4])
            if first["edp"] == 1:
                assert {n for n in replicated if not replicated[n]} <= set(changed), s
            # The weights did move, and away from the uncompressed run's.
            assert _same(comp[s]["params"], comp[s - 1]["params"])
            # 3. Bytes: the 1-bit momentum exchange only.
            stats = comp[s]["stats"]
            assert stats["grad_bytes"] == onebit and stats["grad_bytes_compressed_step"] == onebit
            assert stats["grad_bytes_ratio_vs_fp32_compressed_step"] == onebit / fp32
        assert _same(comp[-1]["params"], none[-1]["params"])

    # 4. Replicas stay bit-identical through compressed steps: dense weights and moments on every
    #    rank, expert shards on every rank of the same ep position (its edp copies).
    for r in ranks[1:]:
        for s in range(STEPS):
            for key in ("params", "m", "v"):
                got, want = r["onebit"]["records"][s][key], first["records"][s][key]
                same_shard = r["onebit"]["ep_rank"] == first["ep_rank"]
                assert not [n for n in _same(got, want) if "experts" not in n or same_shard], (s, key)


def _known_case(world: int) -> dict:
    """Multiples of 1/4 in a 1024-element tensor, b1 = 1/2: the local momenta, their compressed
    sums and the residuals are exact in fp32. A quarter of v is zero (masked coordinates)."""
    g = torch.Generator().manual_seed(100 + world)
    v = torch.randint(1, 5, (1024,), generator=g).float() / 16
    v[torch.randperm(1024, generator=g)[:256]] = 0
    return {"p": torch.randint(-8, 9, (1024,), generator=g).float() / 4,
            "m": torch.randint(-8, 9, (1024,), generator=g).float() / 4, "v": v,
            "grads": [torch.randint(-8, 9, (1024,), generator=g).float() / 4 for _ in range(world)],
            "step": 5, "warmup": 4, "lr": 0.01, "betas": (0.5, 0.95), "eps": 1e-8, "weight_decay": 0.1}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_compressed_step_matches_hand_computed(world):
    case = _known_case(world)
    ranks = run_ranks(momentum_worker, world, case, timeout_s=120)
    b1, b2 = case["betas"]
    # Each rank: m_r = b1 m + (1 - b1) g_r; the two-phase 1-bit all-reduce of the m_r (with no
    # residuals yet) summed, divided by W; masked where the frozen v is zero.
    local_m = [[[case["m"] * b1 + case["grads"][r] * (1 - b1)] for r in range(world)]]
    ref = _reference(local_m, world)[0]
    m = ref["result"][0] / world * (case["v"] > 0)
    t = case["step"] + 1
    p = case["p"] * (1 - case["lr"] * case["weight_decay"])
    denom = case["v"].sqrt() / (1 - b2 ** case["warmup"]) ** 0.5 + case["eps"]
    p = p - case["lr"] / (1 - b1 ** t) * m / denom
    for r, got in enumerate(ranks):
        assert got["local_mode"] and got["step"] == t
        assert torch.equal(got["m"], m)
        assert torch.equal(got["v"], case["v"])  # frozen
        assert torch.equal(got["residuals"]["worker.w"], ref["worker"][r][0])
        torch.testing.assert_close(got["p"], p, rtol=1e-6, atol=1e-7)
        assert torch.equal(got["p"], ranks[0]["p"])
        assert got["stats"]["grad_bytes_compressed_step"] == onebit_bytes(1024, world)
    # The sign x mean semantics survive the mean: at most W magnitudes among unmasked coordinates.
    assert m[case["v"] > 0].abs().unique().numel() <= world


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_compressed_bytes_at_realistic_sizes(world):
    """A step's 1-bit bytes against the fp32 all-reduce of the same tensors, at sizes of a real
    model's matrices (the per-chunk scales make tiny tensors cost more: 1/32 + W/N)."""
    shapes = [(4096, 128), (128, 512), (512, 128), (128, 128)]
    case = _known_case(world)
    numel = sum(a * b for a, b in shapes)
    assert sum(onebit_bytes(a * b, world) for a, b in shapes) * 30 <= sum(fp32_bytes(a * b) for a, b in shapes)
    # And the step really moves that: one flat tensor of this size through the optimizer.
    big = {**case, "p": torch.zeros(numel), "m": torch.zeros(numel), "v": torch.ones(numel),
           "grads": [torch.full((numel,), float(r + 1)) for r in range(world)]}
    got = run_ranks(momentum_worker, world, big, timeout_s=120)[0]
    assert got["stats"]["grad_bytes_compressed_step"] == onebit_bytes(numel, world)
    assert got["stats"]["grad_bytes_compressed_step"] * 30 <= fp32_bytes(numel)
