"""Multi-token prediction (model.mtp_depth) against a reference written from the DeepSeek-V3 paper
(arXiv 2412.19437, eqs. 21-25): the norms, the projection of [norm(h); norm(emb)], the causal block
(here from scratch for a dense model), the shared head and the cross-entropy of token t + k + 1,
indexed on the raw token sequence rather than on the loader's shifted labels. The state handed from
depth to depth is the normed one (the final norm's output for h^0), as DeepSeek-V3 is served;
tests/unit/test_hf_mtp.py compares with transformers' own MTP modules."""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.config.data import DataConfig
from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig, tensor_parallel_errors
from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.models.transformer import Transformer, count_params

V, D, S = 40, 32, 12


def _rms(x, w, eps=1e-5):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x_BHSA, theta=10000.0):
    """Rotate-half rotary positions 0..S-1."""
    A, S_ = x_BHSA.shape[-1], x_BHSA.shape[-2]
    freq = [theta ** (-2 * i / A) for i in range(A // 2)]
    ang = torch.tensor([[p * f for f in freq] for p in range(S_)], dtype=torch.float64).float()
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x_BHSA[..., :A // 2], x_BHSA[..., A // 2:]
    return x_BHSA * cos + torch.cat([-x2, x1], -1) * sin


def _dense_block(p: dict, prefix: str, x_BSD, num_heads: int):
    """Pre-norm block: causal multi-head attention with rotary positions, SwiGLU FFN."""
    B, L, _ = x_BSD.shape
    A = D // num_heads

    def heads(t):
        return t.view(B, L, num_heads, A).transpose(1, 2)

    a = _rms(x_BSD, p[f"{prefix}.attention_norm.weight"])
    q = _rope(heads(a @ p[f"{prefix}.attention.wq.weight"].T))
    k = _rope(heads(a @ p[f"{prefix}.attention.wk.weight"].T))
    v = heads(a @ p[f"{prefix}.attention.wv.weight"].T)
    scores = q @ k.transpose(-1, -2) / math.sqrt(A)
    scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, D)
    h = x_BSD + o @ p[f"{prefix}.attention.wo.weight"].T
    f = _rms(h, p[f"{prefix}.ffn_norm.weight"])
    ffn = f"{prefix}.feed_forward"
    g = torch.nn.functional.silu(f @ p[f"{ffn}.w1.weight"].T) * (f @ p[f"{ffn}.w3.weight"].T)
    return h + g @ p[f"{prefix}.feed_forward.w2.weight"].T


def _paper_losses(model: Transformer, tokens_BT: torch.Tensor, h0_BSD: torch.Tensor, *, block_fn) -> list[torch.Tensor]:
    """L^k for k = 1..D: position i (of the S = T - 1 inputs) combines h^{k-1}_i with Emb(t_{i+k}) and
    predicts t_{i+k+1}, for the i whose target exists."""
    p = dict(model.named_parameters())
    emb, head = p["tok_embeddings.weight"], p["output.weight"]
    h_prev, out = h0_BSD, []
    T = tokens_BT.shape[1]
    for k in range(1, model.config.mtp_depth + 1):
        n = T - 1 - k  # i = 0 .. n-1: t_{i+k+1} <= t_{T-1}
        m = f"mtp.{k - 1}"
        ahead = emb[tokens_BT[:, k:k + n]]  # Emb(t_{i+k})
        cat = torch.cat([_rms(h_prev[:, :n], p[f"{m}.hnorm.weight"]), _rms(ahead, p[f"{m}.enorm.weight"])], -1)
        h_k = _rms(block_fn(p, f"{m}.block", cat @ p[f"{m}.eh_proj.weight"].T, k), p[f"{m}.norm.weight"])
        logp = torch.log_softmax(h_k @ head.T, -1)
        target = tokens_BT[:, k + 1:k + 1 + n]
        out.append(-logp.gather(-1, target[..., None]).mean())
        h_prev = h_k
    return out


def _model(**kw) -> Transformer:
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=16)
    cfg = ModelConfig(vocab_size=V, dim=D, num_layers=2, num_heads=4, max_seq_len=32, activation="swiglu",
                      dense_hidden_dim=48, **kw)
    model = Transformer(cfg, moe=moe, seed=3)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norm gains away from 1: which side of a norm a state is taken from shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return model


@pytest.mark.parametrize("moe_every", [0, 1])
def test_losses_match_the_paper(moe_every):
    torch.manual_seed(0)
    model = _model(moe_every=moe_every, mtp_depth=2, mtp_loss_weight=0.25)
    tokens_BT = torch.randint(0, V, (3, S + 1))
    out = model(tokens_BT[:, :-1], tokens_BT[:, 1:])
    if moe_every == 0:
        def block_fn(p, prefix, x, k):
            return _dense_block(p, prefix, x, num_heads=4)
    else:  # the MoE block is tested on its own elsewhere; here it is the one thing taken from the model
        def block_fn(p, prefix, x, k):
            L = x.shape[1]
            return model.mtp[k - 1].block(x, model.rope_cos_SA[:L], model.rope_sin_SA[:L])[0]
    ref = _paper_losses(model, tokens_BT, out.hidden_BSD, block_fn=block_fn)
    assert out.mtp_losses is not None and out.mtp_loss is not None
    torch.testing.assert_close(out.mtp_losses, torch.stack(ref), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.mtp_loss, 0.25 * torch.stack(ref).mean(), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.total_loss, out.loss + out.aux_loss + out.mtp_loss)
    # The modules' MoE blocks add their aux terms (2 main blocks + 2 depths).
    assert len(out.moe_aux) == (4 if moe_every else 0)
    if moe_every == 0:  # the trunk's h^0 is the final norm's output
        p = dict(model.named_parameters())
        h = p["tok_embeddings.weight"][tokens_BT[:, :-1]]
        for i in range(2):
            h = _dense_block(p, f"layers.{i}", h, num_heads=4)
        torch.testing.assert_close(out.hidden_BSD, _rms(h, p["norm.weight"]), atol=1e-5, rtol=0)


def test_gradients_reach_the_modules_and_the_shared_weights():
    model = _model(moe_every=1, mtp_depth=1)
    tokens_BT = torch.randint(0, V, (2, S + 1))
    out = model(tokens_BT[:, :-1], tokens_BT[:, 1:])
    assert out.mtp_loss is not None
    out.mtp_loss.backward()  # the multi-token loss alone
    for name, p in model.named_parameters():
        if name.startswith("mtp.") and "router" not in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert model.tok_embeddings.weight.grad.abs().sum() > 0 and model.output.weight.grad.abs().sum() > 0
    assert model.norm.weight.grad.abs().sum() > 0  # h^0 is the final norm's output


def test_off_changes_nothing():
    """mtp_depth 0 builds the same parameters, draws and loss as before it existed."""
    base, off = _model(), _model(mtp_depth=0)
    tokens_BT = torch.randint(0, V, (2, S + 1))
    a, b = base(tokens_BT[:, :-1], tokens_BT[:, 1:]), off(tokens_BT[:, :-1], tokens_BT[:, 1:])
    assert b.mtp_losses is None and b.mtp_loss is None
    assert torch.equal(a.loss, b.loss) and list(dict(off.named_parameters())) == list(dict(base.named_parameters()))
    deep = _model(mtp_depth=2)
    for name, p in base.named_parameters():  # drawn by name: the trunk keeps its weights
        assert torch.equal(p, dict(deep.named_parameters())[name]), name


@pytest.mark.parametrize("moe_every", [0, 1])
def test_counts_include_the_modules(moe_every):
    model = _model(moe_every=moe_every, mtp_depth=2)
    assert model.param_counts() == count_params(model.config, model.moe_config)


def test_config_rules():
    with pytest.raises(ValueError, match="model.mtp_depth"):
        ModelConfig(mtp_depth=-1)
    with pytest.raises(ValueError, match="model.mtp_depth"):
        ModelConfig(head="classifier", num_classes=3, mtp_depth=1)
    with pytest.raises(ValueError, match="model.mtp_depth"):
        ModelConfig(max_seq_len=4, mtp_depth=4)
    with pytest.raises(ValueError, match="model.mtp_loss_weight"):
        ModelConfig(mtp_depth=1, mtp_loss_weight=-0.1)
    with pytest.raises(ValueError, match="model.mtp_loss_weight.*acts only with model.mtp_depth"):
        ModelConfig(mtp_loss_weight=0.1)
    # Tensor parallelism pads the depths (keep_length): a capacity cannot be shared over the tp ranks'
    # unequal token counts, and every tp rank must keep a scored position of the deepest depth.
    assert tensor_parallel_errors(ModelConfig(mtp_depth=1), 2, moe=MoEConfig()) == []
    capacity = MoEConfig(capacity_factor=1.25)
    assert any("moe.capacity_factor" in e for e in tensor_parallel_errors(ModelConfig(mtp_depth=1), 2, moe=capacity))
    assert tensor_parallel_errors(ModelConfig(mtp_depth=1), 1, moe=capacity) == []
    assert tensor_parallel_errors(ModelConfig(mtp_depth=0), 2, moe=capacity) == []
    with pytest.raises(ValueError, match=r"moe.capacity_factor \(1.25\) must be null with model.mtp_depth"):
        JobConfig(model=ModelConfig(mtp_depth=1, num_kv_heads=2), moe=capacity, parallel=ParallelConfig(tp=2))
    with pytest.raises(ValueError, match=r"model.mtp_depth \(2\) must be < data.seq_len / parallel.tp \(2\)"):
        JobConfig(model=ModelConfig(mtp_depth=2), data=DataConfig(seq_len=8), parallel=ParallelConfig(tp=4))
    with pytest.raises(ValueError, match=r"model.mtp_depth \(4\) must be < data.seq_len \(4\)"):
        JobConfig(model=ModelConfig(mtp_depth=4), data=DataConfig(seq_len=4))
    JobConfig(model=ModelConfig(mtp_depth=1), parallel=ParallelConfig(pp=2))  # the last stage holds the modules
    model = _model(mtp_depth=2)
    with pytest.raises(ValueError, match="sequence length"):
        model(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))


@pytest.mark.parametrize("aux_loss_type", ["batch", "sequence"])
def test_kept_length_changes_neither_losses_nor_routing(aux_loss_type):
    """keep_length (what tensor parallelism sets): each depth runs at all S positions, the last k
    padded; the per-depth losses, the gradients, and the modules' MoE routing counts, aux losses
    and step statistics equal those of the S - k positions alone, the counts exactly."""
    from moetrain.models.moe.layer import STAT_ENTROPY, STAT_ROUTED, STAT_TOKENS, MoELayer

    tokens_BT = torch.randint(0, V, (3, S + 1), generator=torch.Generator().manual_seed(2))
    runs = []
    for keep_length in (False, True):
        moe = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=16, num_shared_experts=1, aux_loss_coef=0.1,
                        z_loss_coef=0.01, aux_loss_type=aux_loss_type)
        cfg = ModelConfig(vocab_size=V, dim=D, num_layers=2, num_heads=4, max_seq_len=32, mtp_depth=2)
        model = Transformer(cfg, moe=moe, seed=3)
        mtp_layers = [m.block.feed_forward for m in model.mtp_modules()]
        for module, layer in zip(model.mtp_modules(), mtp_layers, strict=True):
            module.keep_length = keep_length
            assert isinstance(layer, MoELayer)
            layer.track_routing_stats = True
        out = model(tokens_BT[:, :-1], tokens_BT[:, 1:])
        out.total_loss.backward()
        runs.append((model, out, mtp_layers))
    (short, a, short_layers), (kept, b, kept_layers) = runs
    assert torch.equal(a.loss, b.loss)  # the trunk is untouched
    assert a.mtp_losses is not None and b.mtp_losses is not None
    torch.testing.assert_close(b.mtp_losses, a.mtp_losses, rtol=1e-6, atol=0)
    assert len(a.moe_aux) == len(b.moe_aux) == 4  # 2 trunk blocks + 2 depths
    for x, y in zip(a.moe_aux[2:], b.moe_aux[2:], strict=True):
        assert torch.equal(x.num_routed_per_expert, y.num_routed_per_expert) and x.num_routed == y.num_routed
        for term in ("loss", "load_balancing", "z_loss"):
            torch.testing.assert_close(getattr(y, term), getattr(x, term), rtol=1e-6, atol=0)
    for k, (x, y) in enumerate(zip(short_layers, kept_layers, strict=True), start=1):
        assert torch.equal(x.tokens_per_expert, y.tokens_per_expert)
        assert torch.equal(x.step_routed_E, y.step_routed_E)
        assert x.step_local_stats[STAT_TOKENS] == y.step_local_stats[STAT_TOKENS] == 3 * (S - k)
        assert x.step_local_stats[STAT_ROUTED] == y.step_local_stats[STAT_ROUTED]
        torch.testing.assert_close(y.step_local_stats[STAT_ENTROPY], x.step_local_stats[STAT_ENTROPY])
    grads = {n: p.grad for n, p in kept.named_parameters()}
    for name, p in short.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
