"""``moe.force_skew``: the spec's parsing and rules, the sampling weights worked by hand, and the
assignment: distinct experts per token, deterministic per (step, layer), skewed as asked."""

from __future__ import annotations

import pytest
import torch

from moetrain.config.force_skew import parse_force_skew
from moetrain.config.moe import MoEConfig
from moetrain.models.moe.skew import skew_seed, skew_weights, skewed_assignment
from moetrain.train.metrics import run_tags

E = 8


def test_parse_and_rules():
    assert parse_force_skew("zipf:1.2", num_experts=E) == ("zipf", (1.2,))
    assert parse_force_skew("hot:2:0.5", num_experts=E) == ("hot", (2, 0.5))
    assert parse_force_skew("drift:1.0:10", num_experts=E) == ("drift", (1.0, 10))
    assert parse_force_skew("trace:runs/x", num_experts=E) == ("trace", ("runs/x",))
    for bad in ("zipf", "zipf:0", "zipf:x", "hot:8:0.5", "hot:1:1.5", "drift:1:0", "uniform", "trace:"):
        with pytest.raises(ValueError, match="moe.force_skew"):
            MoEConfig(num_experts=E, top_k=2, expert_hidden_dim=16, force_skew=bad)
    with pytest.raises(ValueError, match="moe.force_skew"):
        MoEConfig(num_experts=E, top_k=2, expert_hidden_dim=16, force_skew="zipf:1", force_balance="round_robin")
    cfg = MoEConfig(num_experts=E, top_k=2, expert_hidden_dim=16, force_skew="zipf:1.2")
    assert run_tags(cfg) == {"force_skew": "zipf:1.2"}


def test_weights_by_hand():
    w = skew_weights("zipf", (1.0,), step=1, num_experts=4)
    harmonic = 1 + 1 / 2 + 1 / 3 + 1 / 4
    torch.testing.assert_close(w, torch.tensor([1, 1 / 2, 1 / 3, 1 / 4], dtype=torch.float64) / harmonic)
    hot = skew_weights("hot", (1, 0.7), step=1, num_experts=4)
    torch.testing.assert_close(hot, torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=torch.float64))
    # drift: the hottest expert moves up one id every PERIOD steps.
    assert [int(skew_weights("drift", (1.0, 3), step=s, num_experts=4).argmax()) for s in (1, 3, 4, 7, 13)] == \
        [0, 0, 1, 2, 0]


def test_assignment_is_deterministic_distinct_and_skewed():
    w = skew_weights("hot", (1, 0.7), step=1, num_experts=E)
    a = skewed_assignment(w, num_tokens=4096, top_k=2, seed=skew_seed(5, 1))
    assert torch.equal(a, skewed_assignment(w, num_tokens=4096, top_k=2, seed=skew_seed(5, 1)))
    assert not torch.equal(a, skewed_assignment(w, num_tokens=4096, top_k=2, seed=skew_seed(5, 0)))
    assert bool((a[:, 0] != a[:, 1]).all())
    counts = torch.bincount(a.reshape(-1), minlength=E).double()
    # Expert 0 (weight 0.7) is in almost every token's pair: ~half the copies, against 1/8 balanced.
    assert counts[0] / counts.sum() > 0.4
    z = torch.bincount(skewed_assignment(skew_weights("zipf", (1.2,), step=1, num_experts=E), num_tokens=4096,
                                         top_k=2, seed=1).reshape(-1), minlength=E)
    assert bool((z[:-1] >= z[1:]).all())  # zipf: loads fall with the expert id


def test_forced_skew_hands_each_rank_its_slice_of_one_global_routing():
    """dp = 2 ranks of one micro-batch each route, together, exactly what one process with two
    micro-batches routes: the ids depend on the step, the layer and the global token only."""
    from torch import nn

    from moetrain.models.moe.layer import MoELayer
    from moetrain.train.routing_trace import ForcedSkew, Geometry

    model = nn.Sequential(*(MoELayer(16, MoEConfig(num_experts=E, top_k=2, expert_hidden_dim=16)) for _ in range(2)))

    def routed(dp_rank: int, dp_size: int, num_micro: int) -> list[torch.Tensor]:
        g = Geometry(num_experts=E, top_k=2, tokens_per_step=4 * 8, seq_len=8, micro_batch=4 // num_micro,
                     local_batch=4 // num_micro // dp_size, dp_rank=dp_rank)
        skew = ForcedSkew("zipf", (1.2,), model, geometry=g)
        skew.start_step(3)
        out = []
        for micro in range(num_micro):
            skew.before_micro(micro)
            out.append(torch.stack([layer.router.replay_idx_TK for layer in model]))
        skew.finish_step()
        assert all(layer.router.replay_idx_TK is None for layer in model)
        return out

    one = torch.cat(routed(0, 1, 2), dim=1)
    # dp_rank r's micro-batch m holds global sequences m * 2 + r (micro_batch 2, local_batch 1).
    ranks = [routed(r, 2, 2) for r in range(2)]
    two = torch.cat([ranks[r][m] for m in range(2) for r in range(2)], dim=1)
    assert torch.equal(one, two)


def test_trace_errors_name_the_setting_that_gave_the_trace(tmp_path):
    """A trace that does not fit is reported under moe.force_skew when "trace:PATH" gave it, and under
    moe.routing_replay when that did: the index's checks and each step file's."""
    import json

    from torch import nn

    from moetrain.config.loader import load_config
    from moetrain.models.moe.layer import MoELayer
    from moetrain.train.routing_trace import INDEX, TRACE_DIR, build_routing_hooks

    model = nn.Sequential(*(MoELayer(16, MoEConfig(num_experts=E, top_k=2, expert_hidden_dim=16)) for _ in range(2)))
    folder = tmp_path / TRACE_DIR
    folder.mkdir()

    def error(mode: str, setting: str) -> str:
        (folder / INDEX).write_text(json.dumps({
            "format": 1, "mode": mode, "layers": ["0", "1"], "num_experts": E, "top_k": 2,
            "tokens_per_step": 8 * 64, "world_size": 1, "ep": 1, "steps": [1, 2]}))
        cfg = load_config("tiny", ["--model.num_layers=2", f"--moe.num_experts={E}", "--moe.top_k=2",
                                   "--train.global_batch_size=8", "--data.seq_len=64", "--train.steps=2",
                                   "--parallel.ep=1", setting])
        with pytest.raises(ValueError) as e:
            build_routing_hooks(cfg, model, run_dir=tmp_path / "run", rank=0, world_size=1, dp_rank=0, dp_size=1,
                                ep=1, grad_accum=1, is_main=True, start_step=0)
        return str(e.value)

    for setting, field in ((f"--moe.force_skew=trace:{tmp_path}", "moe.force_skew"),
                           (f"--moe.routing_replay={tmp_path}", "moe.routing_replay")):
        assert error("counts", setting).startswith(f"{field}: trace ") and "does not fit" in error("counts", setting)
        # The index fits; the step files are missing.
        assert error("full", setting).startswith(f"{field}: trace file ")


def test_a_missing_trace_is_named_by_the_setting_it_came_from(tmp_path):
    from moetrain.config.loader import load_config
    from moetrain.plan.skew import make_skew_plan
    from moetrain.train.routing_trace import RoutingReplay

    missing = tmp_path / "no_such_run"
    cfg = load_config("tiny", ["--parallel.ep=2"])
    with pytest.raises(ValueError, match=r"^--skew \('trace:"):
        make_skew_plan(cfg, nproc=2, skew=f"trace:{missing}")
    with pytest.raises(ValueError, match=r"^moe\.force_skew: routing trace"):
        RoutingReplay(missing, None, geometry=None, first_step=1, last_step=2, field="moe.force_skew")
