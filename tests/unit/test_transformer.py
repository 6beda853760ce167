"""The single-device transformer: shapes, causality, losses, init, MoE placement, heads."""

import math

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import ModelConfig, MoEConfig
from moetrain.models.feedforward import FeedForward
from moetrain.models.moe import MoELayer
from moetrain.models.transformer import IGNORE_INDEX, Attention, Transformer, apply_rope, rope_table

V, B, S = 64, 2, 12


def small(**overrides) -> tuple[ModelConfig, MoEConfig]:
    """3 blocks, MoE in blocks 0 and 2, grouped-query attention: small enough for 2 CPU cores."""
    model = {"vocab_size": V, "dim": 32, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
             "max_seq_len": 16, "moe_every": 2}
    moe = {"num_experts": 4, "top_k": 2, "expert_hidden_dim": 32}
    for key, value in overrides.items():
        if key.startswith("moe_") and key[4:] in MoEConfig.__dataclass_fields__:
            moe[key[4:]] = value  # moe_top_k=1 -> MoEConfig.top_k
        else:
            model[key] = value  # moe_every, moe_layer_offset are ModelConfig fields
    return ModelConfig(**model), MoEConfig(**moe)


def build(seed=0, **overrides) -> Transformer:
    model, moe = small(**overrides)
    return Transformer(model, moe=moe, seed=seed)


def tokens(seed=1, batch=B, seq=S):
    return torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_forward_shapes_and_dtypes():
    m = build()
    x = tokens()
    out = m(x, labels=x)
    assert out.logits.shape == (B, S, V)
    assert out.loss.shape == () and out.loss.dtype == torch.float32
    assert out.aux_loss.shape == () and out.aux_loss.dtype == torch.float32
    assert len(out.moe_aux) == 2
    assert torch.equal(out.total_loss, out.loss + out.aux_loss)
    assert m(x).loss is None


def test_causal_future_tokens_do_not_change_earlier_logits():
    m = build().eval()
    x = tokens()
    t = 7
    y = x.clone()
    y[:, t:] = (y[:, t:] + 1 + torch.arange(S - t)) % V  # change every token from t on
    with torch.no_grad():
        a, b = m(x).logits, m(y).logits
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_loss_is_mean_cross_entropy_over_labelled_tokens():
    m = build()
    x = tokens()
    labels = tokens(seed=2)
    labels[0, :5] = IGNORE_INDEX
    out = m(x, labels=labels)
    logp = torch.log_softmax(out.logits.double(), dim=-1)
    mask = labels != IGNORE_INDEX
    manual = -logp[mask].gather(-1, labels[mask][:, None]).mean()
    torch.testing.assert_close(out.loss.double(), manual, rtol=1e-5, atol=1e-6)


def test_aux_loss_is_the_sum_of_the_moe_layers_aux():
    m = build(num_layers=4, moe_every=1, moe_layer_offset=1)
    seen = []
    for layer in m.modules():
        if isinstance(layer, MoELayer):
            layer.register_forward_hook(lambda mod, args, output: seen.append(output[1].loss))
    out = m(tokens(), labels=tokens(seed=3))
    assert len(seen) == len(out.moe_aux) == 3
    torch.testing.assert_close(out.aux_loss, torch.stack(seen).sum())
    assert out.aux_loss > 0
    assert all(a.num_routed == B * S * 2 for a in out.moe_aux)


def test_dense_model_has_zero_aux_loss_and_no_moe_layers():
    m = build(moe_every=0)
    out = m(tokens(), labels=tokens())
    assert out.moe_aux == [] and out.aux_loss.item() == 0.0
    assert not any(isinstance(mod, MoELayer) for mod in m.modules())


@pytest.mark.parametrize("num_layers, moe_every, offset, expected", [
    (4, 1, 0, [0, 1, 2, 3]),
    (4, 2, 0, [0, 2]),
    (5, 2, 1, [1, 3]),
    (4, 1, 1, [1, 2, 3]),  # DeepSeekMoE: the first block dense
    (4, 3, 0, [0, 3]),
    (3, 0, 0, []),
])
def test_moe_every_places_the_moe_blocks(num_layers, moe_every, offset, expected):
    m = build(num_layers=num_layers, moe_every=moe_every, moe_layer_offset=offset)
    moe_ids = [i for i, block in enumerate(m.layers) if isinstance(block.feed_forward, MoELayer)]
    dense_ids = [i for i, block in enumerate(m.layers) if isinstance(block.feed_forward, FeedForward)]
    assert moe_ids == expected == m.config.moe_layer_ids
    assert sorted(moe_ids + dense_ids) == list(range(num_layers))


def test_init_is_deterministic_for_a_seed_and_ignores_the_global_rng():
    torch.manual_seed(123)
    a = build(seed=5).state_dict()
    torch.manual_seed(456)
    torch.randn(1000)
    b = build(seed=5).state_dict()
    c = build(seed=6).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.feed_forward.experts.w1"], c["layers.0.feed_forward.experts.w1"])


def test_init_on_meta_then_init_weights_gives_the_same_weights():
    model, moe = small()
    with torch.device("meta"):
        m = Transformer(model, moe=moe, seed=0)
    m = m.to_empty(device="cpu")
    m.init_weights(seed=0)
    ref = build(seed=0)
    for (name, p), (_, q) in zip(m.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    torch.testing.assert_close(m.rope_cos_SA, ref.rope_cos_SA)
    x = tokens()
    torch.testing.assert_close(m(x).logits, ref(x).logits)


def test_init_scales():
    m = build(num_layers=4, moe_every=1, dim=64, moe_expert_hidden_dim=256, moe_num_experts=8)
    std, out_std = 0.02, 0.02 / math.sqrt(2 * 4)
    experts = m.layers[0].feed_forward.experts
    assert experts.w1.std().item() == pytest.approx(std, rel=0.03)
    assert experts.w2.std().item() == pytest.approx(out_std, rel=0.03)
    assert m.layers[0].attention.wo.weight.std().item() == pytest.approx(out_std, rel=0.1)
    assert m.layers[0].feed_forward.router.gate.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(m.layers[0].attention_norm.weight, torch.ones(64))
    # Experts are not copies of each other: each expert index gets its own draw.
    assert not torch.equal(experts.w1[0], experts.w1[1])


def test_tied_embeddings_share_one_tensor():
    m = build(tie_embeddings=True)
    assert m.output.weight is m.tok_embeddings.weight
    assert m.param_counts().total == sum(p.numel() for p in m.parameters())
    untied = build(tie_embeddings=False)
    assert untied.param_counts().total - m.param_counts().total == V * 32


def test_backward_reaches_every_parameter():
    m = build(moe_num_shared_experts=1)
    m(tokens(), labels=tokens(seed=4)).total_loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert missing == []


def test_classifier_head_pools_the_last_token():
    lm = build(seed=3)
    clf = build(seed=3, head="classifier", num_classes=5)
    # The backbone parameters have the same names, hence the same init; only the head differs.
    assert torch.equal(lm.layers[1].attention.wq.weight, clf.layers[1].attention.wq.weight)
    hidden = {}
    lm.norm.register_forward_hook(lambda mod, args, out: hidden.setdefault("h", out))
    x = tokens()
    lm(x)
    labels = torch.tensor([0, 4])
    out = clf(x, labels=labels)
    assert out.logits.shape == (B, 5)
    expected = hidden["h"][:, -1] @ clf.output.weight.T
    torch.testing.assert_close(out.logits, expected)
    torch.testing.assert_close(out.loss, F.cross_entropy(expected, labels))


def test_grouped_query_attention_matches_a_naive_reference():
    torch.manual_seed(0)
    attn = Attention(32, num_heads=4, num_kv_heads=2)
    x_BSD = torch.randn(2, 6, 32)
    cos_SA, sin_SA = rope_table(8, 6, theta=10000.0)
    q = apply_rope(attn.wq(x_BSD).view(2, 6, 4, 8).transpose(1, 2), cos_SA, sin_SA)
    k = apply_rope(attn.wk(x_BSD).view(2, 6, 2, 8).transpose(1, 2), cos_SA, sin_SA)
    k = k.repeat_interleave(2, dim=1)  # each key/value head serves 2 query heads
    v = attn.wv(x_BSD).view(2, 6, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(torch.triu(torch.ones(6, 6, dtype=torch.bool), 1), float("-inf"))
    ref = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, 32))
    torch.testing.assert_close(attn(x_BSD, cos_SA, sin_SA), ref, rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    cos_SA, sin_SA = rope_table(8, 16, theta=10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def score(m, n):
        qm = apply_rope(q.expand(1, 1, 16, 8), cos_SA, sin_SA)[0, 0, m]
        kn = apply_rope(k.expand(1, 1, 16, 8), cos_SA, sin_SA)[0, 0, n]
        return (qm @ kn).item()

    assert score(5, 2) == pytest.approx(score(12, 9), abs=1e-5)
    assert score(0, 0) == pytest.approx((q @ k).item(), abs=1e-5)


def test_user_errors():
    model, moe = small(vocab_size=None)
    with pytest.raises(ValueError, match=r"model\.vocab_size \(None\) must be set"):
        Transformer(model, moe=moe)
    with pytest.raises(ValueError, match=r"sequence length \(17\) must be <= model\.max_seq_len \(16\)"):
        build()(tokens(seq=17))


def test_expert_parallel_style_dtensor_init_matches_the_plain_init(tmp_path):
    """init_weights on experts already sharded as DTensors (after expert parallelism) writes each
    rank's shard of the same global draw. One-rank gloo group: the code path, not the layout."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    # Tests must not leak process groups; one left behind by an earlier test is a bug there.
    assert not dist.is_initialized(), "an earlier test left a process group initialised"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
        m = build(seed=9)
        experts = m.layers[0].feed_forward.experts
        experts.w1 = torch.nn.Parameter(distribute_tensor(torch.zeros_like(experts.w1), mesh, [Shard(0)]))
        m.init_weights(seed=9)
        torch.testing.assert_close(experts.w1.full_tensor(), build(seed=9).layers[0].feed_forward.experts.w1,
                                   rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


ATTENTION_VARIANTS = {
    "qkv_bias": {"qkv_bias": True},
    "qk_norm_head": {"qk_norm": "head", "head_dim": 12},
    "qk_norm_full_clip": {"qk_norm": "full", "clip_qkv": 1.0},
    "rope_interleave": {"rope_interleave": True},
    "mla": {"attention": "mla", "num_kv_heads": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 6, "v_head_dim": 10},
    "mla_q_latent": {"attention": "mla", "num_kv_heads": None, "q_lora_rank": 12, "kv_lora_rank": 16,
                     "qk_nope_head_dim": 8, "qk_rope_head_dim": 6, "v_head_dim": 10, "rope_interleave": True},
}


@pytest.mark.parametrize("variant", list(ATTENTION_VARIANTS))
def test_attention_variants_train_and_init_from_meta(variant):
    """Every parameter gets a finite gradient, causality holds, and the meta-device path draws
    the same weights as the direct one."""
    overrides = ATTENTION_VARIANTS[variant]
    m = build(**overrides)
    m(tokens(), labels=tokens(seed=4)).total_loss.backward()
    assert [n for n, p in m.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()] == []
    model, moe = small(**overrides)
    with torch.device("meta"):
        meta = Transformer(model, moe=moe)
    meta = meta.to_empty(device="cpu")
    meta.init_weights(seed=0)
    assert all(torch.equal(p, q) for p, q in zip(meta.state_dict().values(), m.state_dict().values(), strict=True))
    assert torch.equal(meta.rope_cos_SA, m.rope_cos_SA) and m.rope_cos_SA.shape == (16, model.rope_dim)
    x, y = tokens(), tokens()
    y[:, 8:] = (y[:, 8:] + 1) % V
    with torch.no_grad():
        torch.testing.assert_close(m(x).logits[:, :8], m(torch.cat([x[:, :8], y[:, 8:]], 1)).logits[:, :8])


def test_init_of_biases_norms_and_latent_matrices():
    out_std = 0.02 / math.sqrt(2 * 3)
    m = build(qkv_bias=True, qk_norm="head", dim=64)
    attn = m.layers[0].attention
    assert all(torch.equal(b, torch.zeros_like(b)) for b in (attn.wq.bias, attn.wk.bias, attn.wv.bias))
    assert torch.equal(attn.q_norm.weight, torch.ones(16)) and torch.equal(attn.k_norm.weight, torch.ones(16))
    mla = build(dim=64, **ATTENTION_VARIANTS["mla_q_latent"], moe_num_experts=4).layers[0].attention
    assert torch.equal(mla.q_norm.weight, torch.ones(12)) and torch.equal(mla.kv_norm.weight, torch.ones(16))
    for w in (mla.wq_a.weight, mla.wq_b.weight, mla.wkv_a.weight, mla.wkv_b.weight):
        assert w.std().item() == pytest.approx(0.02, rel=0.15)
    assert mla.wo.weight.std().item() == pytest.approx(out_std, rel=0.15)


def test_mla_parameter_names_in_the_model():
    m = build(**ATTENTION_VARIANTS["mla_q_latent"])
    names = {n.removeprefix("layers.1.attention.") for n in m.state_dict() if n.startswith("layers.1.attention.")}
    assert names == {"wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv_a.weight", "kv_norm.weight",
                     "wkv_b.weight", "wo.weight"}


@pytest.mark.parametrize("dense_layers, expected", [((), [0, 1, 2, 3]), ((0, 3), [1, 2]), ([2], [0, 1, 3])])
def test_dense_layers_override_the_moe_placement(dense_layers, expected):
    m = build(num_layers=4, moe_every=1, dense_layers=dense_layers)
    assert [i for i, block in enumerate(m.layers) if isinstance(block.feed_forward, MoELayer)] == expected
    assert m.config.moe_layer_ids == expected and m.config.dense_layers == tuple(dense_layers)
