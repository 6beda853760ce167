"""Who attends to whom: packed documents (``document_separator``), right-padded classifier batches
(``padding_mask_BS`` with last/mean pooling, causal or bidirectional), and the mask itself by hand."""

import pytest
import torch

from moetrain.config import ModelConfig, MoEConfig
from moetrain.models.attention import attention_mask
from moetrain.models.transformer import Transformer

V, SEP = 50, 0


def build(seed=0, **overrides) -> Transformer:
    """MoE in blocks 0 and 2, grouped-query heads; dropless routing, so a token's expert output
    depends on that token alone."""
    cfg = {"vocab_size": V, "dim": 32, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2, "max_seq_len": 24,
           "moe_every": 2, **overrides}
    return Transformer(ModelConfig(**cfg), moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=32),
                       seed=seed).eval()


def words(n: int, seed: int) -> torch.Tensor:
    """``n`` token ids that are never the separator."""
    return torch.randint(1, V, (n,), generator=torch.Generator().manual_seed(seed))


def test_attention_mask_by_hand():
    ids = torch.tensor([[5, 0, 7, 8, 0, 9]])  # documents: [5 0] [7 8 0] [9]
    T, F = True, False
    expected = torch.tensor([[T, F, F, F, F, F],
                             [T, T, F, F, F, F],
                             [F, F, T, F, F, F],
                             [F, F, T, T, F, F],
                             [F, F, T, T, T, F],
                             [F, F, F, F, F, T]])
    mask = attention_mask(ids, causal=True, document_separator=0, padding_mask_BS=None)
    assert mask.dtype == torch.bool and mask.shape == (1, 1, 6, 6)
    assert torch.equal(mask[0, 0], expected)
    padding = torch.tensor([[T, T, T, T, F, F]])
    keys = attention_mask(ids, causal=False, document_separator=None, padding_mask_BS=padding)
    assert keys.shape == (1, 1, 1, 6) and torch.equal(keys[0, 0, 0], padding[0])
    # Causal without documents: SDPA's own causal kernel, no mask (right padding never precedes a real token).
    assert attention_mask(ids, causal=True, document_separator=None, padding_mask_BS=padding) is None
    assert attention_mask(ids, causal=False, document_separator=None, padding_mask_BS=None) is None


def packed(doc1: torch.Tensor, doc2: torch.Tensor, doc3: torch.Tensor) -> torch.Tensor:
    sep = torch.tensor([SEP])
    return torch.cat([doc1, sep, doc2, sep, doc3])[None]


MLA = {"attention": "mla", "num_kv_heads": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 6,
       "v_head_dim": 10}


@pytest.mark.parametrize("moe_every, attention", [(0, {}), (2, {}), (0, MLA)], ids=["dense", "moe", "dense-mla"])
def test_documents_do_not_see_each_other(moe_every, attention):
    """Changing document 1 (all of it, or one token) leaves the logits of documents 2 and 3
    unchanged. Positions stay global, so the reference is the same packed sequence with other
    tokens in document 1. Dense: bit for bit. MoE: the first block's attention output is bit for
    bit the same too, but a grouped expert matmul's last bits depend on how many tokens share the
    expert, so from there on the logits agree to rounding."""
    m = build(document_separator=SEP, moe_every=moe_every, **attention)
    doc1, doc2, doc3 = words(6, 1), words(8, 2), words(5, 3)
    start2 = 7  # doc2 = positions 7..15 (its separator included), doc3 = 16..20
    x = packed(doc1, doc2, doc3)
    other1 = words(6, 4)
    other1[2] = doc1[2]  # differ in most tokens, not all
    changed = packed(other1, doc2, doc3)
    one_token = x.clone()
    one_token[0, 3] = (x[0, 3] % (V - 1)) + 1  # another non-separator id
    attn_out = []
    for layer in m.layers:
        layer.attention.register_forward_hook(lambda mod, args, out: attn_out.append(out[:, start2:]))
    with torch.no_grad():
        a, b, c = m(x).logits, m(changed).logits, m(one_token).logits
    assert torch.equal(attn_out[0], attn_out[len(m.layers)])  # block 0, runs x and changed
    if moe_every == 0:
        assert torch.equal(a[:, start2:], b[:, start2:]) and torch.equal(a[:, start2:], c[:, start2:])
    torch.testing.assert_close(b[:, start2:], a[:, start2:], rtol=0, atol=1e-6)
    torch.testing.assert_close(c[:, start2:], a[:, start2:], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, :start2], b[:, :start2], atol=1e-3)
    # The mask acts: without it, doc 2 sees doc 1.
    plain = build(document_separator=None, moe_every=moe_every, **attention)
    with torch.no_grad():
        assert not torch.allclose(plain(x).logits[:, start2:], plain(changed).logits[:, start2:], atol=1e-3)


def test_one_document_mask_equals_the_fused_causal_kernel():
    """No separator in the sequence: the explicit mask is plain causality, computed by another kernel."""
    m, plain = build(document_separator=SEP), build()
    x = torch.randint(1, V, (2, 20), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(m(x).logits, plain(x).logits, rtol=1e-5, atol=1e-5)


def test_first_document_equals_the_document_alone_and_later_ones_the_plain_model_on_their_own_tokens():
    m = build(document_separator=SEP)
    plain = build(document_separator=None)  # same seed: the same weights
    doc1, doc2, doc3 = words(6, 1), words(8, 2), words(5, 3)
    x = packed(doc1, doc2, doc3)
    with torch.no_grad():
        a = m(x).logits
        alone1 = plain(x[:, :7]).logits  # doc1 and its separator, positions 0..6 in both
    torch.testing.assert_close(a[:, :7], alone1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pooling", ["last", "mean", "attention"])
@pytest.mark.parametrize("causal", [True, False])
def test_padded_classifier_batch_equals_each_sequence_alone(pooling, causal):
    m = build(head="classifier", num_classes=5, pooling=pooling, causal=causal)
    if pooling == "attention":  # a trained query (the initial zero one weighs every real token alike)
        with torch.no_grad():
            m.pool_query.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(4))
    lengths = [12, 7, 3]
    S = max(lengths)
    x = torch.randint(1, V, (len(lengths), S), generator=torch.Generator().manual_seed(5))  # padding: any ids
    padding = torch.arange(S)[None] < torch.tensor(lengths)[:, None]
    with torch.no_grad():
        batched = m(x, padding_mask_BS=padding).logits
        alone = torch.cat([m(x[i:i + 1, :n]).logits for i, n in enumerate(lengths)])
        unmasked = m(x).logits
    assert batched.shape == (3, 5)
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    # Ignoring the mask reads the padding: the first (unpadded) row agrees, the padded ones do not.
    torch.testing.assert_close(unmasked[0], alone[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked[1:], alone[1:], atol=1e-3)


def test_all_real_padding_mask_changes_nothing():
    m = build(head="classifier", num_classes=3)
    x = torch.randint(1, V, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(m(x).logits, m(x, padding_mask_BS=torch.ones(2, 10, dtype=torch.bool)).logits)


def test_lm_head_ignores_the_padding_mask():
    m = build()
    x = torch.randint(1, V, (2, 10), generator=torch.Generator().manual_seed(7))
    padding = torch.arange(10)[None] < torch.tensor([[10], [4]])
    with torch.no_grad():
        assert torch.equal(m(x).logits, m(x, padding_mask_BS=padding).logits)


def test_bidirectional_classifier_sees_later_tokens():
    m = build(head="classifier", num_classes=3, causal=False, pooling="mean")
    x = torch.randint(1, V, (1, 10), generator=torch.Generator().manual_seed(8))
    y = x.clone()
    y[0, -1] = (x[0, -1] % (V - 1)) + 1
    hidden = []
    m.norm.register_forward_hook(lambda mod, args, out: hidden.append(out))
    with torch.no_grad():
        m(x), m(y)
    # Position 0 sees the last token only without the causal mask.
    assert not torch.allclose(hidden[0][0, 0], hidden[1][0, 0])


def test_padding_mask_errors():
    m = build(head="classifier", num_classes=3)
    x = torch.randint(1, V, (2, 6))
    with pytest.raises(ValueError, match=r"padding_mask_BS \('torch.int64 \[2, 6\]'\) must be a bool tensor"):
        m(x, padding_mask_BS=torch.ones(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"padding_mask_BS \('torch.bool \[2, 5\]'\) must be a bool tensor "
                                         r"of the input's shape \[2, 6\]"):
        m(x, padding_mask_BS=torch.ones(2, 5, dtype=torch.bool))


def test_attention_pooling_starts_as_the_mean_and_learns_its_query():
    mean = build(head="classifier", num_classes=4, pooling="mean", causal=False)
    attention = build(head="classifier", num_classes=4, pooling="attention", causal=False)  # same seed
    assert torch.equal(attention.pool_query, torch.zeros(attention.config.dim))
    x = torch.randint(1, V, (3, 9), generator=torch.Generator().manual_seed(9))
    padding = torch.arange(9)[None] < torch.tensor([[9], [5], [2]])
    torch.testing.assert_close(attention(x, padding_mask_BS=padding).logits,
                               mean(x, padding_mask_BS=padding).logits, rtol=1e-6, atol=1e-6)
    attention(x, torch.tensor([0, 1, 3]), padding_mask_BS=padding).loss.backward()
    assert attention.pool_query.grad is not None and attention.pool_query.grad.abs().sum() > 0
    # A query along one token's final state puts most of the weight on that token.
    hidden = []
    attention.norm.register_forward_hook(lambda mod, args, out: hidden.append(out.detach()))
    with torch.no_grad():
        attention(x[:1])
        attention.pool_query.copy_(hidden[0][0, 4] * 3)
        logits = attention(x[:1]).logits
    torch.testing.assert_close(logits, attention.output(hidden[-1][0, 4])[None], rtol=1e-3, atol=1e-3)
