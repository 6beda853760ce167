"""Growing a trained MoE's experts (moetrain.interop.surgery, ``moetrain experts grow``): the copy
order and the per-expert state, the identity with top_k scaled alike (softmax and sigmoid routers,
selection bias, shared experts, group-limited routing by max and top2_sum, routed scaling, raw gates,
top_k 1), what changes when top_k is kept, the noise, the CLI over an export, and the README recipe:
the grown config trains the grown export in a fresh run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetrain.cli import main
from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.export import build_model, read_export, write_export
from moetrain.interop.surgery import grow_experts
from moetrain.models.moe import MoELayer

VOCAB = 48


def source(*, mtp_depth: int = 0, **moe_overrides) -> tuple[dict, dict[str, torch.Tensor]]:
    """The config and state dict of a 2-block MoE model (plus ``mtp_depth`` multi-token modules) with
    distinct, O(1) router scores and a non-trivial selection bias / per-expert LR scale where the
    config has them."""
    model_cfg = ModelConfig(dim=32, num_heads=4, num_layers=2, vocab_size=VOCAB, max_seq_len=16, mtp_depth=mtp_depth)
    moe = MoEConfig(**{"num_experts": 4, "top_k": 2, "expert_hidden_dim": 16, **moe_overrides})
    config = {"model": dataclasses.asdict(model_cfg), "moe": dataclasses.asdict(moe)}
    model = build_model(config)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("router.gate.weight"):
                t.normal_(0.0, 0.5, generator=g)  # decisive routing: no near-ties between experts
            elif name.endswith("router.expert_bias"):
                t.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
            elif name.endswith("expert_lr_scale"):
                t.copy_(torch.tensor([1.0, 1.5, 0.5, 2.0]))
    return config, {n: t.detach().clone() for n, t in model.state_dict().items()}


def logits(config: dict, state_dict: dict, ids: torch.Tensor) -> torch.Tensor:
    model = build_model(config, state_dict).eval()
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(0))

IDENTITY_CASES = {
    "softmax": {},
    "softmax_bias": {"expert_bias": True},
    "sigmoid_bias": {"router": "sigmoid", "expert_bias": True},
    "shared_swiglu": {"num_shared_experts": 1, "activation": "swiglu"},
    "groups_max": {"num_expert_groups": 2, "top_groups": 1, "group_score": "max"},
    # top2_sum (the default, DeepSeek-V3's): the groups multiply with the experts.
    "softmax_bias_groups_top2_sum": {"expert_bias": True, "num_expert_groups": 2, "top_groups": 1},
    "sigmoid_bias_groups_top2_sum": {"router": "sigmoid", "expert_bias": True, "num_expert_groups": 2,
                                     "top_groups": 1, "routed_scaling_factor": 2.5},
    "scaled": {"routed_scaling_factor": 2.5},
    "softmax_raw": {"renormalize": False},
    # Raw sigmoid gates: each copy keeps the score, so the routed scaling is divided by f.
    "sigmoid_raw": {"router": "sigmoid", "renormalize": False, "routed_scaling_factor": 2.5},
}


@pytest.mark.parametrize("factor", [2, 3])
@pytest.mark.parametrize("case", list(IDENTITY_CASES))
def test_grown_model_with_scaled_top_k_is_the_original(case, factor):
    config, sd = source(**IDENTITY_CASES[case])
    grown_config, grown = grow_experts(config, sd, num_experts=4 * factor, top_k=2 * factor)
    assert grown_config["moe"]["num_experts"] == 4 * factor and grown_config["moe"]["top_k"] == 2 * factor
    assert config["moe"]["num_experts"] == 4, "the source config must not change"
    torch.testing.assert_close(logits(grown_config, grown, IDS), logits(config, sd, IDS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("factor", [2, 3])
@pytest.mark.parametrize("case", ["softmax", "sigmoid", "sigmoid_bias"])
def test_top_k_1_grows_with_raw_gates(case, factor):
    # At top_k 1 the gate is the raw score (renormalize is ignored, though true): the grown model must
    # not renormalise its copies to 1, and a sigmoid router's copies, each at the full score, are scaled
    # down by f.
    config, sd = source(top_k=1, **{**IDENTITY_CASES, "sigmoid": {"router": "sigmoid"}}[case])
    grown_config, grown = grow_experts(config, sd, num_experts=4 * factor, top_k=factor)
    moe = grown_config["moe"]
    assert moe["renormalize"] is False and config["moe"]["renormalize"] is True
    assert moe["routed_scaling_factor"] == (1.0 / factor if "sigmoid" in case else 1.0)
    torch.testing.assert_close(logits(grown_config, grown, IDS), logits(config, sd, IDS), rtol=1e-5, atol=1e-5)


def test_top2_sum_groups_multiply_and_hold_one_copy_of_an_original_group():
    config, sd = source(num_experts=8, num_expert_groups=4, top_groups=2)
    grown_config, grown = grow_experts(config, sd, num_experts=24, top_k=6)
    moe = grown_config["moe"]
    assert (moe["num_expert_groups"], moe["top_groups"]) == (12, 6)
    w = sd["layers.1.feed_forward.router.gate.weight"]
    # Grown group 3g + c (3 copies, groups of 2) holds copy c of original group g's experts 2g, 2g + 1.
    expected = [2 * (r // 6) + r % 2 for r in range(24)]
    assert torch.equal(grown["layers.1.feed_forward.router.gate.weight"], w[expected])
    torch.testing.assert_close(logits(grown_config, grown, IDS), logits(config, sd, IDS), rtol=1e-5, atol=1e-5)
    # The max score and a no-op limit keep the groups and the side-by-side copies.
    for kwargs in ({"group_score": "max"}, {"top_groups": 4}):
        config, sd = source(num_experts=8, num_expert_groups=4, **{"top_groups": 2, **kwargs})
        grown_config, grown = grow_experts(config, sd, num_experts=16, top_k=4)
        assert grown_config["moe"]["num_expert_groups"] == 4
        w = sd["layers.1.feed_forward.router.gate.weight"]
        assert torch.equal(grown["layers.1.feed_forward.router.gate.weight"], w.repeat_interleave(2, dim=0))


@pytest.mark.parametrize("case", ["softmax_bias", "sigmoid_bias"])
def test_multi_token_modules_experts_grow_alike(case):
    # Each multi-token module's block is an MoE block: its experts and router rows grow as the trunk's,
    # and the grown model computes the same next-token logits and the same multi-token losses.
    config, sd = source(mtp_depth=1, **IDENTITY_CASES[case])
    pre = "mtp.0.block.feed_forward."
    assert pre + "experts.w1" in sd
    grown_config, grown = grow_experts(config, sd, num_experts=8, top_k=4)
    for local in ("experts.w1", "experts.w2", "router.gate.weight"):
        assert torch.equal(grown[pre + local], sd[pre + local].repeat_interleave(2, dim=0)), local
    bias, factor = sd[pre + "router.expert_bias"], 2 if case == "softmax_bias" else 1
    assert torch.equal(grown[pre + "router.expert_bias"], (bias / factor).repeat_interleave(2))
    labels = IDS.roll(-1, dims=1)
    with torch.no_grad():
        before = build_model(config, sd).eval()(IDS, labels)
        after = build_model(grown_config, grown).eval()(IDS, labels)
    assert before.mtp_losses is not None and after.mtp_losses is not None
    torch.testing.assert_close(after.logits, before.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after.mtp_losses, before.mtp_losses, rtol=1e-5, atol=1e-5)


def test_copy_order_and_per_expert_state():
    config, sd = source(router="sigmoid", expert_bias=True, expert_lr_scale_max=2.0, activation="swiglu")
    _, grown = grow_experts(config, sd, num_experts=8)
    pre = "layers.1.feed_forward."
    for local in ("experts.w1", "experts.w2", "experts.w3", "router.gate.weight", "router.expert_bias",
                  "expert_lr_scale"):
        old, new = sd[pre + local], grown[pre + local]
        assert new.shape == (8, *old.shape[1:]) and new.dtype == old.dtype, local
        for j in range(8):  # grown expert 2e + c is source expert e
            assert torch.equal(new[j], old[j // 2]), (local, j)
    # Under a softmax router the copies split the probability: the bias is split alike.
    config, sd = source(expert_bias=True)
    _, grown = grow_experts(config, sd, num_experts=8)
    bias = sd[pre + "router.expert_bias"]
    assert torch.equal(grown[pre + "router.expert_bias"], (bias / 2).repeat_interleave(2))
    # Everything else passes through untouched.
    for name in ("tok_embeddings.weight", "layers.0.attention.wq.weight", "norm.weight"):
        assert grown[name] is sd[name]
    assert set(grown) == set(sd)


def test_keeping_top_k_picks_copies_of_fewer_experts():
    config, sd = source()
    grown_config, grown = grow_experts(config, sd, num_experts=8)  # top_k stays 2
    model = build_model(grown_config, grown).eval()
    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    x_TD = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    idx_TK = layer.router(x_TD).idx_TK
    # Each token's two picks are the two copies of its single best original expert.
    originals_TK = idx_TK // 2
    assert torch.equal(originals_TK[:, 0], originals_TK[:, 1])
    # The function changes: the original mixes two experts per token.
    assert not torch.allclose(logits(grown_config, grown, IDS), logits(config, sd, IDS), rtol=1e-3, atol=1e-3)


def test_noise_spares_copy_zero_and_scales_with_the_std():
    config, sd = source()
    _, a = grow_experts(config, sd, num_experts=8, noise=0.01, seed=3)
    _, b = grow_experts(config, sd, num_experts=8, noise=0.01, seed=3)
    _, c = grow_experts(config, sd, num_experts=8, noise=0.01, seed=4)
    pre = "layers.1.feed_forward."
    for local in ("experts.w1", "experts.w2", "router.gate.weight"):
        old, new = sd[pre + local], a[pre + local]
        assert torch.equal(new[0::2], old), f"{local}: copy 0 must stay exact"
        diff = new[1::2] - old
        ratio = float(diff.std() / old.std())
        assert 0.007 < ratio < 0.013, (local, ratio)
        assert torch.equal(new, b[pre + local]) and not torch.equal(new, c[pre + local])


@pytest.mark.parametrize("kwargs, message", [
    ({"num_experts": 6}, r"--num-experts \(6\) must be a multiple \(> 1x\) of the source's moe\.num_experts \(4\)"),
    ({"num_experts": 4}, r"--num-experts \(4\) must be a multiple"),
    ({"num_experts": 8, "noise": -0.1}, r"--noise \(-0\.1\) must be a finite number >= 0"),
    ({"num_experts": 8, "noise": float("inf")}, r"--noise \(inf\) must be a finite number >= 0"),
    ({"num_experts": 8, "noise": float("nan")}, r"--noise \(nan\) must be a finite number >= 0"),
    ({"num_experts": 8, "top_k": 9}, r"moe\.top_k \(9\) must be <= moe\.num_experts \(8\)"),
])
def test_bad_requests_name_the_value_and_rule(kwargs, message):
    config, sd = source()
    with pytest.raises(ValueError, match=message):
        grow_experts(config, sd, **kwargs)


def test_cli_grows_an_export(tmp_path, capsys):
    config, sd = source(mtp_depth=1, expert_bias=True)
    write_export(tmp_path / "src", config=config, state_dict=sd, info={"source": "test", "step": 7})
    code = main(["experts", "grow", str(tmp_path / "src"), "--num-experts", "8", "--top-k", "4",
                 "--to", str(tmp_path / "grown")])
    assert code == 0
    out = capsys.readouterr().out
    assert "--moe.num_experts=8 --moe.top_k=4" in out
    # No parallel section in this export: one process; the tiny run's (ep = 2) asks for two.
    assert f"train it: moetrain train --config {tmp_path / 'grown' / 'config.yaml'} (a fresh run" in out
    from moetrain.cli.experts import _nproc

    layouts = [("{ep: 2}", " --nproc 2"), ("{ep: 4, tp: 2}", " --nproc 4"), ("{dp: 3, pp: 2}", " --nproc 6")]
    for parallel, want in layouts:
        (tmp_path / "config.yaml").write_text(f"parallel: {parallel}\n")
        assert _nproc(tmp_path) == want, parallel
    grown_config, grown, info = read_export(tmp_path / "grown")
    assert grown_config["moe"]["num_experts"] == 8 and info["grown_from_num_experts"] == "4"
    torch.testing.assert_close(logits(grown_config, grown, IDS), logits(config, sd, IDS), rtol=1e-5, atol=1e-5)
    assert main(["experts", "grow", str(tmp_path / "src"), "--num-experts", "6", "--to", str(tmp_path / "x")]) == 2
    assert "must be a multiple" in capsys.readouterr().err


def _train(config: str | None, args: list[str]) -> dict[str, torch.Tensor]:
    """Runs ``moetrain train`` in this process; the model's weights before its first step."""
    from moetrain.config.loader import load_config
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(config, args))
    try:
        start = {n: p.detach().clone() for n, p in trainer.model.state_dict().items()}
        trainer.fit()
        return start
    finally:
        trainer.close()


def test_readme_recipe_trains_the_grown_export_in_a_fresh_run(tmp_path, capsys, monkeypatch):
    # README: `experts grow runs/RUN ... --to grown` then `train --config grown/config.yaml
    # --checkpoint.init_from=grown`. The source run's folder holds a checkpoint of the 4-expert model
    # that checkpoint.resume "auto" would find: the grown config must start its own run instead.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    run = tmp_path / "runs" / "base"
    _train(None, ["--model.dim=32", "--model.num_layers=2", "--model.num_heads=4", "--model.max_seq_len=16",
                  "--moe.num_experts=4", "--moe.top_k=1", "--moe.expert_hidden_dim=16", "--data.corpus=path",
                  f"--data.path={tmp_path / 'docs.txt'}", "--data.tokenizer=bytes", "--data.seq_len=16",
                  "--train.steps=2", "--train.global_batch_size=2", "--train.micro_batch_size=2",
                  "--train.eval_every=0", "--train.device=cpu", "--log.every=1", "--log.progress_bar=false",
                  "--log.tensorboard=false", "--log.report=false", "--log.run_dir=runs/base"])
    assert main(["experts", "grow", "runs/base", "--num-experts", "8", "--top-k", "2", "--to", "grown"]) == 0
    out = capsys.readouterr().out
    assert "moe.renormalize true -> false" in out and "--moe.renormalize=false" in out
    grown_config, grown, _ = read_export(tmp_path / "grown")
    values = [v for section in grown_config.values() if isinstance(section, dict) for v in section.values()]
    assert not [v for v in values if isinstance(v, str) and ("runs/base" in v or str(run) in v)]
    assert grown_config["checkpoint"]["init_from"] == str(tmp_path / "grown")
    start = _train("grown/config.yaml", ["--checkpoint.init_from=grown", "--train.steps=1"])
    for name in ("layers.0.feed_forward.experts.w1", "layers.1.feed_forward.router.gate.weight"):
        assert torch.equal(start[name], grown[name]), name
    assert (tmp_path / "grown-run" / "checkpoints").is_dir()
