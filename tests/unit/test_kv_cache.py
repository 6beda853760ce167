"""Decoding with a key/value cache (``Transformer.new_cache``) against the independent reference, a
plain full forward over the whole sequence: for every attention variant, dense and MoE, the logits
of a prefill, a chunk and single-token steps equal the full forward's at the same positions, and
greedy decoding picks the same tokens.

Tolerance (fp32): not bit-exact, because the cached path sums in another order. SDPA reduces over
the cached keys only instead of the full masked row, and latent attention runs in the absorbed
form (``(W_uk^T q) . c`` instead of ``q . (W_uk c)``). Both are rounding of the last bits:
atol 2e-5 on logits of magnitude ~10 (weights drawn large so that attention is sharp and a wrong
position or a missing key changes the logits by far more, see ``test_a_wrong_rotary_offset_shows``).
"""

import pytest
import torch

from moetrain.config import ModelConfig, MoEConfig
from moetrain.models.kv_cache import KVCache, LatentCache
from moetrain.models.transformer import Transformer
from moetrain.train.generation import generate

V, SEP = 64, 0
TOL = {"rtol": 1e-5, "atol": 2e-5}

MLA = {"attention": "mla", "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 6, "v_head_dim": 10}
VARIANTS = {
    "mha": {},
    "gqa": {"num_kv_heads": 2},
    "qkv_bias": {"num_kv_heads": 2, "qkv_bias": True},
    "qk_norm_head": {"num_kv_heads": 2, "qk_norm": "head", "head_dim": 12},
    "qk_norm_full": {"qk_norm": "full"},
    "clip_qkv": {"clip_qkv": 0.5},
    "rope_interleave": {"num_kv_heads": 1, "rope_interleave": True},
    "mla": MLA,
    "mla_q_lora": {**MLA, "q_lora_rank": 12},
    "mla_q_lora_interleave": {**MLA, "q_lora_rank": 12, "rope_interleave": True},
}
FFNS = {
    "dense": ({"moe_every": 0}, MoEConfig()),
    "moe": ({"moe_every": 1}, MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=32)),
    "moe_sigmoid_shared": ({"moe_every": 2}, MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=32,
                                                       router="sigmoid", expert_bias=True, num_shared_experts=1)),
}


def build(attention: dict, ffn: str = "moe", **overrides) -> Transformer:
    """3 blocks, dim 32, 4 heads, every weight drawn large (std 0.3, norm scales 1 +- 0.3, the
    router bias too): sharp attention, so positions and keys matter to the logits."""
    model_fields, moe = FFNS[ffn]
    cfg = ModelConfig(vocab_size=V, dim=32, num_layers=3, num_heads=4, max_seq_len=32,
                      **{**model_fields, **attention, **overrides})
    model = Transformer(cfg, moe=moe, seed=3).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.3
            p.copy_(1 + noise if "norm" in name else noise)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model


def tokens(B: int, S: int, *, seed: int = 0, low: int = 1) -> torch.Tensor:
    return torch.randint(low, V, (B, S), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def cached_logits(model: Transformer, ids_BS: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """The logits of ``ids_BS`` fed through one cache in pieces of ``chunks`` tokens, concatenated."""
    cache = model.new_cache(ids_BS.shape[0])
    out, start = [], 0
    for n in chunks:
        out.append(model(ids_BS[:, start:start + n], cache=cache).logits)
        start += n
    assert start == ids_BS.shape[1] and cache.num_cached == start
    return torch.cat(out, dim=1)


PIECES = [5, 3, 1, 1, 1, 1, 1, 1]  # prefill, a chunk after cached tokens, single-token steps


@pytest.mark.parametrize("ffn", list(FFNS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_chunk_and_steps_equal_the_full_forward(variant, ffn):
    model = build(VARIANTS[variant], ffn)
    ids = tokens(2, sum(PIECES))
    with torch.no_grad():
        full = model(ids).logits
    assert full.abs().max() > 3  # sharp enough to show a wrong position
    torch.testing.assert_close(cached_logits(model, ids, PIECES), full, **TOL)


@pytest.mark.parametrize("variant", ["gqa", "mla"])
def test_a_wrong_rotary_offset_shows(variant):
    """The test above can fail: the same steps with every new token at rotary position 0 (the
    cache filled as usual) are far from the full forward."""
    model = build(VARIANTS[variant])
    ids = tokens(1, 10)
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(1)
        model(ids[:, :5], cache=cache)
        rope = model.rope_cos_SA.clone(), model.rope_sin_SA.clone()
        model.rope_cos_SA[5:] = rope[0][0]  # every later position gets position 0's angles
        model.rope_sin_SA[5:] = rope[1][0]
        wrong = model(ids[:, 5:6], cache=cache).logits
    assert (wrong[0, 0] - full[0, 5]).abs().max() > 1e-2


@pytest.mark.parametrize("variant", ["gqa", "mla"])
def test_packed_documents_are_decoded_as_the_block_diagonal_forward(variant):
    """With ``document_separator`` the cache keeps each position's document: separators in the
    prefill, in a chunk and as a single step give the full forward's logits."""
    model = build(VARIANTS[variant], document_separator=SEP)
    ids = tokens(2, sum(PIECES))
    ids[0, 2] = ids[0, 6] = ids[0, 9] = SEP  # in the prefill, the chunk, a single step
    ids[1, 8] = SEP
    with torch.no_grad():
        full = model(ids).logits
        plain = build(VARIANTS[variant])(ids).logits  # the same weights without the mask
    assert (full - plain).abs().max() > 1e-2  # the mask acts on these ids
    torch.testing.assert_close(cached_logits(model, ids, PIECES), full, **TOL)


@pytest.mark.parametrize("variant, ffn", [("gqa", "moe"), ("mla_q_lora", "moe_sigmoid_shared"), ("mha", "dense")])
def test_greedy_decoding_with_and_without_the_cache_gives_the_same_tokens(variant, ffn):
    model = build(VARIANTS[variant], ffn)
    prompt = tokens(2, 4, seed=5)
    cached = generate(model, prompt, max_new_tokens=20, temperature=0, use_cache=True)
    uncached = generate(model, prompt, max_new_tokens=20, temperature=0, use_cache=False)
    assert cached.num_new == uncached.num_new == 20
    assert torch.equal(cached.ids_BS, uncached.ids_BS)
    assert torch.equal(cached.ids_BS[:, :4], prompt)
    assert len(set(cached.new_ids_BN.flatten().tolist())) > 3  # not one token repeated


def test_sampling_with_and_without_the_cache_draws_the_same_tokens():
    """The same seed, the same distributions (to rounding): the same draws."""
    model = build(VARIANTS["gqa"])
    prompt = tokens(1, 3, seed=6)
    kwargs = {"max_new_tokens": 16, "temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 11}
    a = generate(model, prompt, use_cache=True, **kwargs)
    assert torch.equal(a.ids_BS, generate(model, prompt, use_cache=False, **kwargs).ids_BS)
    assert not torch.equal(a.ids_BS, generate(model, prompt, use_cache=True, **{**kwargs, "seed": 12}).ids_BS)


def test_generation_stops_at_the_stop_id_per_row():
    """A row repeats the stop id after reaching it; generation ends once every row has."""
    model = build(VARIANTS["gqa"])
    prompt = tokens(2, 3, seed=7)
    free = generate(model, prompt, max_new_tokens=12, temperature=0).new_ids_BN.tolist()
    for stop in (free[0][2], free[1][4]):
        out = generate(model, prompt, max_new_tokens=12, temperature=0, stop_id=stop)
        firsts = [row.index(stop) if stop in row else None for row in free]
        assert firsts[0] is not None or firsts[1] is not None
        expected_len = 12 if None in firsts else max(firsts) + 1
        assert out.num_new == expected_len
        for row, first, got in zip(free, firsts, out.new_ids_BN.tolist(), strict=True):
            end = expected_len if first is None else first + 1
            assert got[:end] == row[:end] and set(got[end:]) <= {stop}


def test_cache_layout_dtype_and_size():
    gqa = build(VARIANTS["gqa"])
    cache = gqa.new_cache(3, max_len=20)
    assert all(isinstance(c, KVCache) for c in cache.layers) and len(cache.layers) == 3
    assert cache.layers[0].k_BGKA.shape == (3, 2, 20, 8) and cache.layers[0].k_BGKA.dtype == torch.float32
    mla = build(VARIANTS["mla"])
    latent = mla.new_cache(3).layers[0]
    assert isinstance(latent, LatentCache)
    assert latent.c_BKR.shape == (3, 32, 16) and latent.k_rope_BKP.shape == (3, 32, 6)  # R + P per position
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gqa.new_cache(1).layers[0].v_BGKA.dtype == torch.bfloat16
    assert gqa.new_cache(1, dtype=torch.bfloat16).layers[0].k_BGKA.dtype == torch.bfloat16


@pytest.mark.parametrize("variant", ["qk_norm_head", "mla"])
def test_bf16_decoding_under_autocast_stays_close_to_the_full_forward(variant):
    """bf16 rounds the two paths differently (loose tolerance); the cache holds bf16."""
    model = build(VARIANTS[variant])
    ids = tokens(1, 12)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full = model(ids).logits.float()
        got = cached_logits(model, ids, [6, 1, 1, 1, 1, 1, 1]).float()
    torch.testing.assert_close(got, full, rtol=0.05, atol=0.25)


def test_refusals_name_the_field_and_the_reason():
    with pytest.raises(ValueError, match=r"model.head \('classifier'\) must be \"lm\" to generate"):
        build({}, "dense", head="classifier", num_classes=3, causal=False).new_cache(1)
    dropping = Transformer(ModelConfig(vocab_size=V, dim=32, num_layers=1, num_heads=4),
                           moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=32, capacity_factor=1.25))
    with pytest.raises(ValueError, match=r"moe.capacity_factor \(1.25\) must be None \(dropless\)"):
        dropping.new_cache(1)
    expert_choice = Transformer(ModelConfig(vocab_size=V, dim=32, num_layers=1, num_heads=4),
                                moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=32, router="expert_choice",
                                              capacity_factor=1.0))
    with pytest.raises(ValueError, match=r"moe.router \('expert_choice'\) must be a token-choice router"):
        expert_choice.new_cache(1)
    model = build(VARIANTS["gqa"])
    with pytest.raises(ValueError, match=r"max_len \(33\) must be in \[1, model.max_seq_len \(32\)\]"):
        model.new_cache(1, max_len=33)
    cache = model.new_cache(2, max_len=6)
    with pytest.raises(ValueError, match=r"input batch size \(1\) must be the cache's batch size \(2\)"):
        model(tokens(1, 2), cache=cache)
    with pytest.raises(ValueError, match=r"padding_mask_BS .* must be None with a cache"):
        model(tokens(2, 2), cache=cache, padding_mask_BS=torch.ones(2, 2, dtype=torch.bool))
    model(tokens(2, 4), cache=cache)
    with pytest.raises(ValueError, match=r"cached positions \('4 \+ 3'\) must fit the cache's max_len \(6\)"):
        model(tokens(2, 3), cache=cache)
    with pytest.raises(ValueError, match=r"prompt tokens \+ max_new_tokens \('30 \+ 3'\) must be <= model.max_seq_len"):
        generate(model, tokens(1, 30), max_new_tokens=3)
