"""LoRA fine-tuning (moetrain.models.lora, GroupedExperts.add_lora, config.finetune): a step
changes only the adapters; the merged state dict is base + scale * product, checked against a
per-expert loop, and the merged plain model computes the LoRA model's logits; the grouped
adapter path equals the per-expert loop oracle; adapters are drawn by name, not by layout.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import ModelConfig, MoEConfig
from moetrain.config.finetune import FinetuneConfig
from moetrain.distributed.data_parallel.grads import clip_global_grad_norm_
from moetrain.models.lora import LoRALinear, apply_lora, is_lora_name, merge_lora, num_lora_params
from moetrain.models.moe import GroupedExperts
from moetrain.models.transformer import Transformer
from moetrain.train.optim import build_optimizer

ALL_TARGETS = ("attention", "experts", "shared_experts", "dense_ffn")
VOCAB = 64


def make_model(*, attention: str = "mha", seed: int = 0) -> Transformer:
    """Block 0 dense (SwiGLU FFN), block 1 MoE with a shared expert: every LoRA target exists."""
    extra = ({"attention": "mla", "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
              "v_head_dim": 8, "q_lora_rank": 16} if attention == "mla" else {})
    model_cfg = ModelConfig(dim=32, num_heads=4, num_layers=2, vocab_size=VOCAB, dense_layers=(0,),
                            activation="swiglu", max_seq_len=16, **extra)
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=16, num_shared_experts=1, activation="swiglu")
    return Transformer(model_cfg, moe=moe, seed=seed)


def batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 12), generator=g), torch.randint(0, VOCAB, (2, 12), generator=g)


def train(model: Transformer, steps: int, *, lr: float = 1e-2, max_norm: float | None = None) -> torch.optim.Optimizer:
    opt = build_optimizer(model, lr=lr, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for s in range(steps):
        ids, labels = batch(seed=10 + s)
        opt.zero_grad(set_to_none=True)
        model(ids, labels).total_loss.backward()
        if max_norm is not None:
            clip_global_grad_norm_(list(model.parameters()), max_norm)
        opt.step()
    return opt


def test_fresh_adapters_change_nothing_and_only_they_train():
    model = make_model()
    ids, _ = batch()
    before = model(ids).logits
    apply_lora(model, FinetuneConfig(lora_rank=4, lora_alpha=8.0, lora_targets=ALL_TARGETS), seed=1)
    # B starts at zero: the adapted model is the base model, bit for bit.
    assert torch.equal(model(ids).logits, before)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_lora_name(n) for n in trainable)
    # Every target got adapters: attention q/k/v/o of both blocks, the dense FFN, the shared and
    # routed experts.
    for expected in ("layers.0.attention.wq.lora_a", "layers.1.attention.wo.lora_b", "layers.0.feed_forward.w3.lora_a",
                     "layers.1.feed_forward.shared_experts.w2.lora_b", "layers.1.feed_forward.experts.lora_a_w3",
                     "layers.1.feed_forward.experts.lora_b_w2"):
        assert expected in trainable, expected
    experts = model.layers[1].feed_forward.experts
    assert tuple(experts.lora_a_w1.shape) == (4, 32, 4) and tuple(experts.lora_b_w1.shape) == (4, 4, 16)
    assert tuple(experts.lora_a_w2.shape) == (4, 16, 4) and tuple(experts.lora_b_w2.shape) == (4, 4, 32)
    assert torch.count_nonzero(experts.lora_b_w1) == 0
    assert torch.count_nonzero(experts.lora_a_w1) == experts.lora_a_w1.numel()
    # 4 attention projections x 2 blocks, 3 dense-FFN, 3 shared-expert projections: r * (in + out)
    # each; 3 expert projections: E * r * (in + out).
    r = 4
    attention = 2 * 4 * r * (32 + 32)
    dense = r * (2 * (32 + 128) + (128 + 32))  # dense hidden: 4 * dim = 128 (ModelConfig default)
    shared = r * (2 * (32 + 16) + (16 + 32))
    routed = 4 * r * 3 * (32 + 16)
    assert num_lora_params(model) == attention + dense + shared + routed


def test_a_classifiers_task_head_trains_whole_beside_the_adapters():
    # PEFT's modules_to_save for sequence classification: the head is new to the base model, and
    # frozen it would stay at its init for the whole run.
    cfg = ModelConfig(dim=32, num_heads=4, num_layers=2, vocab_size=VOCAB, max_seq_len=16, head="classifier",
                      num_classes=3, pooling="attention", causal=False, ngram_buckets=32)
    model = Transformer(cfg, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=16), seed=0)
    apply_lora(model, FinetuneConfig(lora_rank=4, lora_alpha=8.0, lora_targets=("attention",)), seed=1)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    head = {"output.weight", "pool_query", "ngram_embeddings.weight"}
    assert head <= trainable and all(is_lora_name(n) for n in trainable - head)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    before = model.output.weight.detach().clone()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    F.cross_entropy(model(ids).logits, torch.tensor([0, 2])).backward()
    opt.step()
    assert not torch.equal(model.output.weight, before)
    assert not model.layers[0].attention.wq.weight.requires_grad  # the base stays frozen


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_lora_steps_change_only_adapters(attention):
    model = make_model(attention=attention)
    apply_lora(model, FinetuneConfig(lora_rank=4, lora_alpha=8.0, lora_targets=ALL_TARGETS), seed=1)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_lora_name(n)}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if is_lora_name(n)}
    # Clipping over every parameter (frozen ones have no gradient) and AdamW with weight decay:
    # decay would move a frozen weight if the optimizer held it.
    opt = train(model, steps=3, max_norm=0.5)
    params = dict(model.named_parameters())
    for n, before in base.items():
        assert torch.equal(params[n], before), f"frozen {n} changed"
        assert params[n].grad is None, f"frozen {n} has a gradient"
    for n, before in adapters.items():
        assert not torch.equal(params[n], before), f"adapter {n} did not change"
    # Optimizer state only for the adapters: that is the memory LoRA saves.
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(params[n]) for n in adapters}
    assert {id(p) for p in opt.state} == held


def test_merge_equals_base_plus_product_and_merged_logits_match():
    model = make_model()
    ft = FinetuneConfig(lora_rank=4, lora_alpha=8.0, lora_targets=ALL_TARGETS)
    apply_lora(model, ft, seed=1)
    train(model, steps=3)
    sd = {n: t.detach().clone() for n, t in model.state_dict().items()}
    merged = merge_lora(sd, ft)
    assert not any(is_lora_name(n) for n in merged)
    scale = ft.lora_alpha / ft.lora_rank
    # Routed experts, one expert at a time: w[e] + scale * a[e] @ b[e], in [E, I, O].
    pre = "layers.1.feed_forward.experts."
    for w in ("w1", "w3", "w2"):
        a, b, base = sd[f"{pre}lora_a_{w}"], sd[f"{pre}lora_b_{w}"], sd[pre + w]
        expected = torch.stack([base[e] + scale * (a[e] @ b[e]) for e in range(base.shape[0])])
        torch.testing.assert_close(merged[pre + w], expected, rtol=1e-6, atol=1e-7)
        assert not torch.equal(merged[pre + w], base)
    # A linear projection: W [O, I] + scale * B [O, R] @ A [R, I].
    for lin in ("layers.0.attention.wq", "layers.1.feed_forward.shared_experts.w2", "layers.0.feed_forward.w1"):
        expected = sd[f"{lin}.weight"] + scale * sd[f"{lin}.lora_b"] @ sd[f"{lin}.lora_a"]
        torch.testing.assert_close(merged[f"{lin}.weight"], expected, rtol=1e-6, atol=1e-7)
    # Untargeted tensors pass through untouched.
    for n in ("tok_embeddings.weight", "layers.1.feed_forward.router.gate.weight", "norm.weight"):
        assert merged[n] is sd[n]
    # The merged weights in a plain model compute the LoRA model's logits.
    plain = make_model(seed=5)
    plain.load_state_dict(merged, strict=True)
    ids, _ = batch(seed=99)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_merge_reports_every_broken_adapter():
    model = make_model()
    ft = FinetuneConfig(lora_rank=4, lora_targets=("experts", "attention"))
    apply_lora(model, ft)
    sd = dict(model.state_dict())
    del sd["layers.0.attention.wq.lora_b"]
    del sd["layers.1.feed_forward.experts.lora_a_w2"]
    with pytest.raises(ValueError, match=r"layers\.0\.attention\.wq\.lora_b \(needed by .*\) is missing; .*"
                                         r"layers\.1\.feed_forward\.experts\.lora_b_w2 has no lora_a partner"):
        merge_lora(sd, ft)
    with pytest.raises(ValueError, match=r"has rank 4, finetune\.lora_rank is 8"):
        merge_lora(dict(model.state_dict()), FinetuneConfig(lora_rank=8, lora_targets=("experts", "attention")))
    with pytest.raises(ValueError, match=r"finetune\.lora_rank \(0\) but the state dict holds"):
        merge_lora(dict(model.state_dict()), FinetuneConfig())


@pytest.fixture
def grouped_mm_calls(monkeypatch):
    calls = []
    fn = torch._grouped_mm

    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counted)
    return calls


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_grouped_adapters_equal_the_per_expert_loop(activation, grouped_mm_calls):
    E, D, Fh, R = 4, 16, 32, 4
    grouped = GroupedExperts(D, Fh, E, activation=activation, impl="grouped", init_std=D ** -0.5)
    grouped.add_lora(rank=R, scale=2.0, generator_for=lambda name: torch.Generator().manual_seed(len(name)))
    with torch.no_grad():  # B away from zero so the adapters matter
        for n, p in grouped.named_parameters():
            if n.startswith("lora_b_"):
                p.normal_(0.0, 0.3)
        grouped.w1.requires_grad_(False)
        grouped.w2.requires_grad_(False)
        if grouped.w3 is not None:
            grouped.w3.requires_grad_(False)
    loop = GroupedExperts(D, Fh, E, activation=activation, impl="loop")
    loop.add_lora(rank=R, scale=2.0)
    loop.load_state_dict(grouped.state_dict())
    for n, p in grouped.named_parameters():
        dict(loop.named_parameters())[n].requires_grad_(p.requires_grad)
    counts = torch.tensor([5, 0, 9, 2])  # an expert with no rows too
    g = torch.Generator().manual_seed(0)
    x = torch.randn(int(counts.sum()), D, generator=g)
    grad_out = torch.randn(int(counts.sum()), D, generator=g)
    results = []
    for module in (grouped, loop):
        xi = x.clone().requires_grad_()
        calls_before = len(grouped_mm_calls)
        out = module(xi, counts)
        (out * grad_out).sum().backward()
        results.append((out.detach(), xi.grad, {n: p.grad for n, p in module.named_parameters()}))
        if module is grouped:
            # w1, w2 (+ w3), each with two adapter GEMMs: 3 grouped matmuls per projection.
            assert len(grouped_mm_calls) - calls_before == 3 * len(module.projection_names())
        else:
            assert len(grouped_mm_calls) == calls_before, "impl='loop' must not use the grouped matmul"
    (out_g, xg, grads_g), (out_l, xl, grads_l) = results
    torch.testing.assert_close(out_g, out_l, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xg, xl, rtol=1e-5, atol=1e-6)
    for n, grad in grads_g.items():
        if n.startswith("lora_"):
            torch.testing.assert_close(grad, grads_l[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
        else:
            assert grad is None and grads_l[n] is None, n


def test_adapters_are_drawn_by_name_not_by_order():
    ft = FinetuneConfig(lora_rank=4, lora_targets=ALL_TARGETS)
    a, b = make_model(), make_model()
    apply_lora(a, ft, seed=7)
    apply_lora(b, ft, seed=7)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    c = apply_lora(make_model(), ft, seed=8)
    assert not torch.equal(c.state_dict()["layers.1.feed_forward.experts.lora_a_w1"],
                           sa["layers.1.feed_forward.experts.lora_a_w1"])
    # Distinct adapters get distinct draws (no stream shared between two names).
    assert not torch.equal(sa["layers.0.attention.wq.lora_a"], sa["layers.0.attention.wk.lora_a"])
    # A: uniform in +-1/sqrt(in).
    a_w2 = sa["layers.1.feed_forward.experts.lora_a_w2"]
    assert float(a_w2.abs().max()) <= 16 ** -0.5


def test_only_the_named_targets_get_adapters():
    model = apply_lora(make_model(), FinetuneConfig(lora_rank=2, lora_targets=("experts",)))
    adapted = {n for n in model.state_dict() if is_lora_name(n)}
    assert adapted and all(".experts.lora_" in n for n in adapted)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert not any(p.requires_grad for n, p in model.named_parameters() if not is_lora_name(n))


def test_lora_off_leaves_the_model_alone():
    model = make_model()
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    apply_lora(model, FinetuneConfig())
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    assert num_lora_params(model) == 0


def test_a_target_the_model_lacks_is_an_error():
    dense_moe = Transformer(ModelConfig(dim=32, num_heads=4, num_layers=2, vocab_size=VOCAB, max_seq_len=16),
                            moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=16))
    with pytest.raises(ValueError, match=r"finetune\.lora_targets \(\('experts', 'shared_experts'\)\) names "
                                         r"'shared_experts', which this model does not have"):
        apply_lora(dense_moe, FinetuneConfig(lora_rank=2, lora_targets=("experts", "shared_experts")))


def test_bf16_autocast_trains_fp32_adapters():
    model = apply_lora(make_model(), FinetuneConfig(lora_rank=4, lora_targets=ALL_TARGETS))
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels)
    assert out.logits.dtype == torch.bfloat16
    out.total_loss.backward()
    for n, p in model.named_parameters():
        if is_lora_name(n) and ".lora_a" in n and "lora_b" not in n:
            continue  # A's gradient is zero while B is zero
        if is_lora_name(n):
            assert p.grad is not None and p.grad.dtype == torch.float32 and torch.count_nonzero(p.grad) > 0, n


BAD = [
    ({"lora_rank": -1}, r"finetune\.lora_rank \(-1\) must be an int >= 0"),
    ({"lora_rank": 2.0}, r"finetune\.lora_rank \(2\.0\) must be an int >= 0"),
    ({"lora_rank": 4, "lora_alpha": 0}, r"finetune\.lora_alpha \(0\) must be a finite number > 0"),
    ({"lora_rank": 4, "lora_alpha": True}, r"finetune\.lora_alpha \(True\) must be a finite number > 0"),
    ({"lora_rank": 4, "lora_targets": ("experts", "mlp")},
     r"finetune\.lora_targets \(\('experts', 'mlp'\)\) names 'mlp': each must be one of 'attention'"),
    ({"lora_rank": 4, "lora_targets": ("experts", "experts")}, r"must not name a target twice"),
    ({"lora_rank": 4, "lora_targets": ()}, r"finetune\.lora_targets \(\(\)\) must name at least one target"),
    ({"lora_rank": 4, "lora_targets": "experts"}, r"finetune\.lora_targets \('experts'\) must be a list of"),
    ({"lora_alpha": 32.0}, r"finetune\.lora_alpha \(32\.0\) acts only with finetune\.lora_rank > 0"),
    ({"lora_targets": ("attention",)}, r"finetune\.lora_targets \(\('attention',\)\) acts only with"),
]


@pytest.mark.parametrize("kwargs, message", BAD, ids=[str(k) for k, _ in BAD])
def test_bad_finetune_values_name_field_value_and_rule(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FinetuneConfig(**kwargs)


def test_finetune_section_is_part_of_the_job():
    from moetrain.config import JobConfig, config_to_dict

    job = JobConfig()
    assert job.finetune == FinetuneConfig() and not job.finetune.enabled
    assert config_to_dict(job)["finetune"] == {"lora_rank": 0, "lora_alpha": 16.0, "lora_targets": ["experts"]}
    assert FinetuneConfig(lora_rank=8, lora_alpha=16.0).scale == 2.0


def test_compute_dtype_linear_keeps_the_plain_ffn_numbers():
    """FeedForward's projections are modules (so LoRA can replace them); they compute exactly
    what F.linear with the weight cast to the input dtype computes."""
    model = make_model()
    ffn = model.layers[0].feed_forward
    x = torch.randn(5, 32)
    w1, w2, w3 = ffn.w1.weight, ffn.w2.weight, ffn.w3.weight
    expected = F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
    assert torch.equal(ffn(x), expected)


def test_merged_export_is_a_plain_model(tmp_path):
    """``merge_lora_export``: a fine-tuning run's config and tensors become a plain model's, whose
    config (finetune section back at its defaults) builds a model that loads them strictly."""
    import dataclasses

    from moetrain.config import load_config
    from moetrain.interop.export import build_model
    from moetrain.interop.surgery import merge_lora_export

    job = load_config(None, ["--finetune.lora_rank=4", "--finetune.lora_targets=[attention,experts]"])
    assert job.finetune == FinetuneConfig(lora_rank=4, lora_targets=("attention", "experts"))
    model = make_model()
    apply_lora(model, job.finetune, seed=2)
    train(model, steps=2)
    config = {"model": dataclasses.asdict(model.config), "moe": dataclasses.asdict(model.moe_config),
              "finetune": {"lora_rank": 4, "lora_alpha": 16.0, "lora_targets": ["attention", "experts"]}}
    merged_config, merged = merge_lora_export(config, dict(model.state_dict()))
    assert merged_config["finetune"]["lora_rank"] == 0 and config["finetune"]["lora_rank"] == 4
    plain = build_model(merged_config, merged)
    ids, _ = batch(seed=5)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
