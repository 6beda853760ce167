"""Text sampling from a trained model: top-k sampling with temperature, seeded.

Every rank runs the same computation with the same generator: the experts of an
expert-parallel model need all ranks in every forward.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def sample_text(model: nn.Module, tokenizer, prompt: str, *, context: int, device: torch.device,
                fallback_id: int = 0, max_new_tokens: int = 100, temperature: float = 0.8, top_k: int = 50,
                seed: int = 0) -> str:
    """``prompt`` continued by ``max_new_tokens`` sampled tokens, decoded. The model sees at most
    the last ``context`` tokens; an empty prompt starts from ``fallback_id``."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = tokenizer.encode(prompt) or [fallback_id]
    for _ in range(max_new_tokens):
        x = torch.tensor([ids[-context:]], device=device)
        logits = model(x).logits[0, -1].float().cpu() / max(temperature, 1e-5)
        v, i = torch.topk(logits, min(top_k, logits.numel()))
        ids.append(i[torch.multinomial(torch.softmax(v, -1), 1, generator=gen)].item())
    return tokenizer.decode(ids)
