"""``moe.force_skew``'s draw per rank: each rank draws the uniforms of the tokens it routes only
(counted, O(T_rank x E) per MoE layer, not the global batch's), and a token's experts are the same
whichever range it is drawn in: the ranks of dp x grad_accum and tp layouts against one draw of the
whole global batch. The plan's dry run draws within its budget."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moetrain.config.moe import MoEConfig
from moetrain.models.moe.layer import MoELayer
from moetrain.models.moe.skew import SKEW_BLOCK, skew_seed, skew_weights, skewed_assignment
from moetrain.train.routing_trace import ForcedSkew, Geometry

E, K, S, LAYERS = 8, 2, 1024, 2
GLOBAL_SEQS = 16
W_E = skew_weights("zipf", (1.2,), step=3, num_experts=E)


@pytest.fixture
def drawn(monkeypatch) -> list[int]:
    """The uniforms drawn (elements of every torch.rand), appended per call."""
    counts: list[int] = []
    rand = torch.rand

    def counting(*args, **kwargs):
        out = rand(*args, **kwargs)
        counts.append(out.numel())
        return out

    monkeypatch.setattr(torch, "rand", counting)
    return counts


def _model() -> nn.Module:
    return nn.Sequential(*(MoELayer(16, MoEConfig(num_experts=E, top_k=K, expert_hidden_dim=16))
                           for _ in range(LAYERS)))


def _rank_ids(model, *, dp_rank: int, dp: int, accum: int, tp: int = 1, tp_rank: int = 0):
    """Each layer's ids of this rank's tokens over the step, and the tokens' global positions."""
    micro = GLOBAL_SEQS // accum
    g = Geometry(num_experts=E, top_k=K, tokens_per_step=GLOBAL_SEQS * S, seq_len=S, micro_batch=micro,
                 local_batch=micro // dp, dp_rank=dp_rank, tp=tp, tp_rank=tp_rank)
    skew = ForcedSkew("zipf", (1.2,), model, geometry=g)
    skew.start_step(3)
    ids, positions = [], []
    for m in range(accum):
        skew.before_micro(m)
        ids.append(torch.stack([layer.router.replay_idx_TK for layer in model]))
        positions.append(g.positions(m))
    skew.finish_step()
    return torch.cat(ids, dim=1), torch.cat(positions)


@pytest.mark.parametrize("dp,accum,tp", [(4, 2, 1), (2, 1, 2), (1, 4, 4), (2, 2, 8)])
def test_each_rank_draws_its_own_tokens_only(drawn, dp, accum, tp):
    model = _model()
    for dp_rank in range(dp):
        for tp_rank in range(tp):
            drawn.clear()
            ids, positions = _rank_ids(model, dp_rank=dp_rank, dp=dp, accum=accum, tp=tp, tp_rank=tp_rank)
            t_rank = positions.numel()
            assert t_rank == GLOBAL_SEQS * S // dp // tp
            # A run of consecutive tokens draws the blocks it touches: at most one block more than it routes
            # (tp shards shorter than a block draw the whole block). The global batch is 16384 tokens.
            runs = accum * (1 if tp == 1 else GLOBAL_SEQS // accum // dp)
            bound = (t_rank + runs * SKEW_BLOCK if tp > 1 else t_rank) * E * LAYERS
            assert 0 < sum(drawn) <= bound < GLOBAL_SEQS * S * E * LAYERS


def test_a_token_gets_the_same_experts_in_any_range_and_layout():
    """Against one draw of the whole global batch per layer: every rank's ids are that draw's rows at
    its tokens' global positions, at every layout."""
    everything = torch.stack([skewed_assignment(W_E, num_tokens=GLOBAL_SEQS * S, top_k=K, seed=skew_seed(3, i))
                              for i in range(LAYERS)])
    model = _model()
    for dp, accum, tp in ((4, 2, 1), (2, 1, 2), (1, 4, 4), (8, 2, 1), (2, 2, 8)):
        seen = torch.zeros(GLOBAL_SEQS * S, dtype=torch.int64)
        for dp_rank in range(dp):
            for tp_rank in range(tp):
                ids, positions = _rank_ids(model, dp_rank=dp_rank, dp=dp, accum=accum, tp=tp, tp_rank=tp_rank)
                assert torch.equal(ids, everything[:, positions])
                seen[positions] += 1
        assert bool((seen == 1).all())  # the ranks route the global batch once
    # An unaligned range (mid-block start and end) is that draw's slice.
    part = skewed_assignment(W_E, num_tokens=700, top_k=K, seed=skew_seed(3, 1), start=SKEW_BLOCK + 33)
    assert torch.equal(part, everything[1, SKEW_BLOCK + 33:SKEW_BLOCK + 733])
    # Distinct experts per token, and the steps and layers draw independently.
    assert bool((everything[..., 0] != everything[..., 1]).all())
    assert not torch.equal(everything[0], everything[1])


def test_the_plans_dry_run_draws_within_its_budget(drawn):
    """One micro-batch of the tiny plan below is 4 ranks x 4 sequences x 64 tokens = 1024 tokens x 8 experts:
    a budget of 3 micro-batches' uniforms checks 3 of the 4 steps x 2 layers x 1 micro-batch."""
    from moetrain.config.loader import load_config
    from moetrain.plan.skew import make_skew_plan
    from moetrain.plan.skew_check import confirm_buffers

    cfg = load_config(None, ["--model.dim=64", "--model.num_layers=2", "--model.num_heads=4",
                             "--model.max_seq_len=64", "--moe.num_experts=8", "--moe.top_k=2",
                             "--moe.expert_hidden_dim=128", "--data.tokenizer=bytes", "--data.seq_len=64",
                             "--train.global_batch_size=16", "--train.micro_batch_size=4", "--parallel.ep=4"])
    plan = make_skew_plan(cfg, nproc=4, skew="hot:1:0.5", capacity_factors=(), spare_slots=(1,))
    micro = 1024 * E
    drawn.clear()
    checks = confirm_buffers(cfg, plan, budget=3 * micro)
    assert sum(drawn) == 3 * micro and all(c.micro_batches == 3 and c.confirmed for c in checks)
    drawn.clear()
    # The first micro-batch is drawn whole whatever the budget.
    assert confirm_buffers(cfg, plan, budget=1)[0].micro_batches == 1 and sum(drawn) == micro
