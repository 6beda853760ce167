"""Forced skewed routing for benchmarks (``moe.force_skew``): expert ids for any range of a step's
global tokens, the same for a token whatever the parallel layout and whichever range it is drawn in.

Shape legend: T tokens of the global batch, E experts, K experts per token.
"""

from __future__ import annotations

import hashlib

import torch


def skew_weights(kind: str, params: tuple, *, step: int, num_experts: int) -> torch.Tensor:
    """``[E]`` fp64 sampling weights (summing to 1) of ``moe.force_skew`` at ``step``:
    "zipf" (S,): ``(e + 1)^-S``; "hot" (K, FRACTION): FRACTION / K for experts 0..K-1, the rest
    spread evenly; "drift" (S, PERIOD): zipf:S rolled up by ``(step - 1) // PERIOD`` ids."""
    e_E = torch.arange(num_experts, dtype=torch.float64)
    if kind in ("zipf", "drift"):
        w_E = (e_E + 1) ** -params[0]
        if kind == "drift":
            w_E = torch.roll(w_E, ((step - 1) // params[1]) % num_experts)
    elif kind == "hot":
        hot, fraction = params
        w_E = torch.where(e_E < hot, fraction / hot, (1 - fraction) / (num_experts - hot)).double()
    else:
        raise ValueError(f"moe.force_skew kind {kind!r} has no weights (zipf, hot or drift)")
    return w_E / w_E.sum()


SKEW_BLOCK = 256
"""Tokens per generator: token t's uniforms come from block ``t // SKEW_BLOCK``'s generator, seeded by
(seed, block) alone, so a rank draws the blocks its tokens lie in and no others."""


def skewed_assignment(weights_E: torch.Tensor, *, num_tokens: int, top_k: int, seed: int,
                      start: int = 0) -> torch.Tensor:
    """``idx_TK`` int64 of global tokens ``start .. start + num_tokens - 1``: each token's K distinct
    experts, drawn without replacement with probabilities proportional to ``weights_E`` (the Gumbel
    top-k trick) from CPU generators seeded by ``seed`` and the token's block (``SKEW_BLOCK``): the
    same ids for a token on every rank and at every layout, whatever range it is drawn in. Draws
    fp32 uniforms for the blocks the range touches (at most ``num_tokens + 2 * SKEW_BLOCK`` rows of E)
    and works in place on them: the only buffer of E per token."""
    E = weights_E.numel()
    if num_tokens <= 0:
        return torch.empty(0, top_k, dtype=torch.int64)
    first, last = start // SKEW_BLOCK, (start + num_tokens - 1) // SKEW_BLOCK
    u_TE = torch.empty((last - first + 1) * SKEW_BLOCK, E, dtype=torch.float32)
    for i, block in enumerate(range(first, last + 1)):
        gen = torch.Generator().manual_seed(_block_seed(seed, block))
        torch.rand(SKEW_BLOCK, E, generator=gen, dtype=torch.float32, out=u_TE[i * SKEW_BLOCK:(i + 1) * SKEW_BLOCK])
    offset = start - first * SKEW_BLOCK
    u_TE = u_TE[offset:offset + num_tokens]
    # Gumbel keys log w - log(-log u); u = 0 clamped so that no key is -inf twice over.
    keys_TE = u_TE.clamp_(min=1e-38).log_().neg_().log_().neg_().add_(weights_E.log().float())
    return keys_TE.topk(top_k, dim=-1).indices


def _block_seed(seed: int, block: int) -> int:
    """A generator seed per (seed, block), hashed so that no two (step, layer, block) share one."""
    digest = hashlib.blake2b(f"{seed}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def skew_seed(step: int, layer: int) -> int:
    """A generator seed per (step, MoE layer): distinct layers draw independent assignments."""
    return (step * 1_000_003 + layer * 7_919) % (2**63 - 1)
