"""Text sampling (``moetrain.train.generation``) against a step-by-step argmax reference."""

import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.models.transformer import Transformer
from moetrain.train.generation import sample_text


class CharTokenizer:
    """One character per id (code point 0x100 + id): decoding is one-to-one, unlike bytes."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 0x100 if ord(c) >= 0x100 else ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(0x100 + int(i)) for i in ids)


def _model() -> Transformer:
    cfg = ModelConfig(vocab_size=256, dim=32, num_layers=2, num_heads=4, max_seq_len=16)
    return Transformer(cfg, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=32), seed=1).eval()


def test_top_k_one_is_greedy_decoding_over_the_context_window():
    model, tok = _model(), CharTokenizer()
    out = sample_text(model, tok, "ab", context=5, device=torch.device("cpu"), max_new_tokens=9, top_k=1)
    ids = tok.encode("ab")
    with torch.no_grad():
        for _ in range(9):
            ids.append(int(model(torch.tensor([ids[-5:]])).logits[0, -1].argmax()))
    assert out == tok.decode(ids)


def test_sampling_is_seeded_and_continues_the_prompt():
    model, tok = _model(), CharTokenizer()
    kwargs = {"context": 8, "device": torch.device("cpu"), "max_new_tokens": 12, "temperature": 1.5, "top_k": 50}
    a = sample_text(model, tok, "xyz", seed=7, **kwargs)
    assert a == sample_text(model, tok, "xyz", seed=7, **kwargs)
    assert a.startswith(tok.decode(tok.encode("xyz"))) and len(a) == 3 + 12
    others = {sample_text(model, tok, "xyz", seed=s, **kwargs) for s in range(8, 12)}
    assert others != {a}  # the seed acts


def test_empty_prompt_starts_from_the_fallback_token():
    model, tok = _model(), CharTokenizer()
    out = sample_text(model, tok, "", context=4, device=torch.device("cpu"), fallback_id=7,
                      max_new_tokens=3, top_k=1)
    assert out[0] == tok.decode([7]) and len(out) == 4
