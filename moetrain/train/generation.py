"""Text generation from a trained model: temperature, top-k and top-p (nucleus) sampling, seeded,
with or without a key/value cache (``Transformer.new_cache``).

``generate`` runs one process's model (the ``moetrain generate`` command, a single-device model).
``sample_text`` is the trainer's end-of-run sample: every rank runs the same computation with the
same generator, since the experts of an expert-parallel model need all ranks in every forward; it
re-reads a sliding window of ``context`` tokens per step, without a cache.

Shape legend: B batch, S sequence, V vocabulary, N new tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch
from torch import nn

from moetrain.config.base import require
from moetrain.models.attention import rope_rows
from moetrain.models.kv_cache import DecodeCache
from moetrain.models.transformer import Transformer, TransformerBlock


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


def check_sampling(*, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError naming the first setting out of range."""
    require(temperature >= 0, "temperature", temperature, "must be >= 0 (0 = greedy)")
    require(top_k is None or (isinstance(top_k, int) and top_k >= 1), "top_k", top_k, "must be None or an int >= 1")
    require(top_p is None or 0 < top_p <= 1, "top_p", top_p, "must be None or in (0, 1]")


def filter_logits(logits_BV: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """fp32 logits divided by ``temperature`` with -inf outside the tokens sampling may draw, in
    the order transformers applies them: temperature, then the ``top_k`` most likely tokens, then
    of those the smallest most-likely-first set whose probability reaches ``top_p`` (a token is
    kept when the mass of the tokens before it is below ``top_p``; the most likely one always).
    Ties keep the lower token id. ``softmax`` of the result is the sampling distribution.
    ``temperature`` must be > 0 here (0 is greedy: ``sample_next`` takes the argmax)."""
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    require(temperature > 0, "temperature", temperature, "must be > 0 to filter (0 = greedy, no distribution)")
    logits_BV = logits_BV.float() / temperature
    V = logits_BV.shape[-1]
    if top_k is not None and top_k < V:
        # Stable sort, not topk: ties at the cut must keep the lower ids on every device.
        order_BV = torch.sort(logits_BV, dim=-1, descending=True, stable=True).indices
        drop_BV = torch.zeros_like(logits_BV, dtype=torch.bool).scatter_(-1, order_BV[..., top_k:], True)
        logits_BV = logits_BV.masked_fill(drop_BV, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_BV, order_BV = torch.sort(torch.softmax(logits_BV, dim=-1), dim=-1, descending=True, stable=True)
        drop_sorted_BV = sorted_BV.cumsum(dim=-1) - sorted_BV >= top_p  # mass strictly before each token
        drop_sorted_BV[..., 0] = False
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter_(-1, order_BV, drop_sorted_BV)
        logits_BV = logits_BV.masked_fill(drop_BV, float("-inf"))
    return logits_BV


def sample_next(logits_BV: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row (int64 ``[B]``, on the logits' device): the argmax when ``temperature``
    is 0, else a draw from ``softmax(filter_logits(...))`` with ``generator`` (on that device)."""
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    probs_BV = torch.softmax(filter_logits(logits_BV, temperature=temperature, top_k=top_k, top_p=top_p), dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)


@dataclass
class Generation:
    """The output of ``generate`` and how long it took."""

    ids_BS: torch.Tensor
    """Prompt and new tokens, ``[B, num_prompt + num_new]`` (int64, on the model's device); after a
    row's ``stop_id`` its later tokens are ``stop_id`` too."""
    num_prompt: int
    num_new: int
    """New tokens per row: ``max_new_tokens``, or fewer when every row stopped."""
    prefill_s: float
    """Seconds from the start to the first new token: the prompt's forward and one draw."""
    decode_s: float
    """Seconds of the other ``num_new - 1`` steps."""

    @property
    def new_ids_BN(self) -> torch.Tensor:
        return self.ids_BS[:, self.num_prompt:]

    @property
    def tokens_per_s(self) -> float:
        """New tokens (all rows) per second of the whole generation, prefill included."""
        return self.ids_BS.shape[0] * self.num_new / max(self.prefill_s + self.decode_s, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens (all rows) per second of the steps after the first: the decoding rate."""
        return self.ids_BS.shape[0] * (self.num_new - 1) / max(self.decode_s, 1e-9)


@torch.no_grad()
def generate(model: Transformer, prompt_ids_BS: torch.Tensor, *, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0, use_cache: bool = True,
             stop_id: int | None = None) -> Generation:
    """Continue each row of ``prompt_ids_BS`` (on the model's device) by up to ``max_new_tokens``.

    ``use_cache``: one forward over the prompt (prefill) fills a ``DecodeCache``, then one forward
    per token over that token alone; else each step is a full forward over everything so far (the
    reference the cache must reproduce: the same logits up to rounding, so the same greedy tokens;
    not with ``rope_type: dynamic`` past ``original_max_seq_len``, where cached keys keep the
    stretch of their own step, as in transformers).
    Sampling draws from a generator on the model's device seeded with ``seed``. ``stop_id``: a row
    ends at that token; generation stops when every row has (a host sync per step). The model is
    put in eval mode (no router jitter or forced balance).
    """
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    B, num_prompt = prompt_ids_BS.shape
    limit = model.config.max_seq_len
    require(max_new_tokens >= 1, "max_new_tokens", max_new_tokens, "must be >= 1")
    require(num_prompt >= 1 and num_prompt + max_new_tokens <= limit, "prompt tokens + max_new_tokens",
            f"{num_prompt} + {max_new_tokens}", f"must be <= model.max_seq_len ({limit}), with a prompt of >= 1 token")
    model.eval()
    device = prompt_ids_BS.device
    gen = torch.Generator(device=device).manual_seed(seed)
    sample = partial(sample_next, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
    done_B = torch.zeros(B, dtype=torch.bool, device=device)
    start = time.perf_counter()
    cache = model.new_cache(B, max_len=num_prompt + max_new_tokens) if use_cache else None
    next_B = sample(model(prompt_ids_BS, cache=cache).logits[:, -1])
    ids = [prompt_ids_BS, next_B[:, None]]
    _synchronize(device)
    prefill_s, decode_start = time.perf_counter() - start, time.perf_counter()
    for _ in range(max_new_tokens - 1):
        if stop_id is not None:
            done_B |= next_B == stop_id
            if bool(done_B.all()):  # a host sync
                break
        step_ids_BS = next_B[:, None] if use_cache else torch.cat(ids, dim=1)
        next_B = sample(model(step_ids_BS, cache=cache).logits[:, -1])
        if stop_id is not None:
            next_B = next_B.masked_fill(done_B, stop_id)
        ids.append(next_B[:, None])
    _synchronize(device)
    return Generation(ids_BS=torch.cat(ids, dim=1), num_prompt=num_prompt, num_new=len(ids) - 1,
                      prefill_s=prefill_s, decode_s=time.perf_counter() - decode_start)


@dataclass
class SpeculativeGeneration(Generation):
    """``generate_speculative``'s output: a ``Generation`` and how the drafts fared."""

    num_steps: int = 0
    """Forwards of the main model after the prefill (one per verification)."""
    num_drafted: int = 0
    """Tokens the multi-token modules proposed."""
    num_accepted: int = 0
    """Of those, the ones the main model's greedy choice confirmed (kept without a forward of their own)."""

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / max(self.num_drafted, 1)


@torch.no_grad()
def generate_speculative(model: Transformer, prompt_ids_BS: torch.Tensor, *, max_new_tokens: int,
                         stop_id: int | None = None) -> SpeculativeGeneration:
    """Greedy decoding of one sequence drafted by the model's own multi-token modules
    (``model.mtp_depth`` D): after each verified token the modules propose the next D, one
    forward of the main model over the verified token and the drafts checks them all, and the
    longest run its argmax agrees with is kept plus its own next token. Every kept token is the
    main model's argmax after the kept tokens before it, so the output is greedy decoding's.

    Caches: the main model's, and one per module, rewound after each step to what was verified
    (module k's position t is final once the token t + k is; the later ones depended on drafts).
    Temperature sampling and batches of several sequences are not supported (ValueError).
    """
    cfg = model.config
    B, num_prompt = prompt_ids_BS.shape
    require(cfg.mtp_depth >= 1, "model.mtp_depth", cfg.mtp_depth, "must be >= 1 to draft with the multi-token modules")
    require(B == 1, "batch size", B, "must be 1 for speculative decoding (each sequence keeps its own drafts)")
    require(cfg.document_separator is None, "model.document_separator", cfg.document_separator,
            "must be None for speculative decoding (the caches are rewound, the document bookkeeping cannot be)")
    require(max_new_tokens >= 1, "max_new_tokens", max_new_tokens, "must be >= 1")
    limit = num_prompt + max_new_tokens
    require(limit <= cfg.max_seq_len, "prompt tokens + max_new_tokens", f"{num_prompt} + {max_new_tokens}",
            f"must be <= model.max_seq_len ({cfg.max_seq_len})")
    rope = cfg.rope_scaling
    if rope is not None and rope.rope_type == "dynamic":
        # The verifying forward rotates its drafts with the stretch of its last position, where
        # greedy decoding gives each position the stretch of its own step.
        assert rope.original_max_seq_len is not None  # required with "dynamic"
        require(limit <= rope.original_max_seq_len, "prompt tokens + max_new_tokens",
                f"{num_prompt} + {max_new_tokens}", f"must be <= model.rope_scaling.original_max_seq_len "
                f"({rope.original_max_seq_len}) for speculative decoding with rope_type 'dynamic'")
    model.eval()
    device = prompt_ids_BS.device
    start = time.perf_counter()
    main = model.new_cache(1, max_len=limit)
    drafts = _MtpDrafter(model, max_len=limit)
    out = model(prompt_ids_BS, cache=main)
    drafts.add_verified(0, out.hidden_BSD)
    tokens = prompt_ids_BS[0].tolist() + [int(out.logits[0, -1].argmax())]  # a host sync per step
    _synchronize(device)
    prefill_s, decode_start = time.perf_counter() - start, time.perf_counter()
    result = SpeculativeGeneration(ids_BS=prompt_ids_BS, num_prompt=num_prompt, num_new=0, prefill_s=prefill_s,
                                   decode_s=0.0)
    while len(tokens) < limit and (stop_id is None or tokens[-1] != stop_id):
        n = len(tokens) - 1  # positions the main model has run; tokens[n] is verified, not yet run
        proposed = drafts.propose(tokens, num=min(cfg.mtp_depth, limit - len(tokens) - 1))
        step = model(torch.tensor([tokens[n:] + proposed], device=device), cache=main)
        greedy = step.logits[0].argmax(dim=-1).tolist()
        kept = 0
        while kept < len(proposed) and proposed[kept] == greedy[kept]:
            kept += 1
        _rewind(main, n + kept + 1)
        drafts.add_verified(0, step.hidden_BSD[:, :kept + 1])
        tokens += proposed[:kept] + [greedy[kept]]
        result.num_steps += 1
        result.num_drafted += len(proposed)
        result.num_accepted += kept
    if stop_id is not None and stop_id in tokens[num_prompt:]:
        tokens = tokens[:tokens.index(stop_id, num_prompt) + 1]
    tokens = tokens[:limit]
    _synchronize(device)
    result.ids_BS = torch.tensor([tokens], device=device)
    result.num_new, result.decode_s = len(tokens) - num_prompt, time.perf_counter() - decode_start
    return result


class _MtpDrafter:
    """The multi-token modules as a draft model over a growing sequence, each with its own
    attention cache. ``states[j]``: the hidden states h^j (h^0: the main model's final-norm output)
    at the positions whose inputs are all verified; module j's cache holds those positions too."""

    def __init__(self, model: Transformer, *, max_len: int) -> None:
        self.model = model
        device = model.tok_embeddings.weight.device
        # The dtype Transformer.new_cache picks: autocast's when it is on, else the weights'.
        autocast = torch.is_autocast_enabled(device.type)
        dtype = torch.get_autocast_dtype(device.type) if autocast else model.tok_embeddings.weight.dtype
        blocks = [cast(TransformerBlock, m.block) for m in model.mtp_modules()]
        self.caches = [DecodeCache([b.attention.new_cache(1, max_len=max_len, dtype=dtype, device=device)],
                                   batch_size=1, max_len=max_len, document_separator=None, device=device)
                       for b in blocks]
        self.states: list[torch.Tensor | None] = [None] * (len(self.caches) + 1)

    def add_verified(self, depth: int, h_B1D: torch.Tensor) -> None:
        have = self.states[depth]
        self.states[depth] = h_B1D if have is None else torch.cat([have, h_B1D], dim=1)

    def num_verified(self, depth: int) -> int:
        have = self.states[depth]
        return 0 if have is None else have.shape[1]

    def propose(self, tokens: list[int], *, num: int) -> list[int]:
        """Up to ``num`` draft tokens after ``tokens`` (the last one verified, not yet run by the
        main model): module j runs its positions from its cache's end to n - 1, the last reading
        the draft j - 1 places ahead, and proposes the token at n + j."""
        model, cfg = self.model, self.model.config
        n = len(tokens) - 1
        device = model.tok_embeddings.weight.device
        ids = list(tokens)
        prev = self.states[0]  # h^0 at positions 0 .. n-1
        for j, module in enumerate(model.mtp_modules()[:num], start=1):
            assert prev is not None and prev.shape[1] == n, "h^{j-1} must cover every run position"
            a = self.num_verified(j)
            new_ids = torch.tensor([ids[a + j:n + j]], device=device)
            begin, mask = self.caches[j - 1].begin(new_ids)
            assert begin == a, (begin, a)
            cos, sin = rope_rows(cfg, model.rope_cos_SA, model.rope_sin_SA, begin, n)
            x, _ = module(prev[:, a:n], model.tok_embeddings(new_ids), cos, sin, mask, self.caches[j - 1].layers[0])
            h = module.norm(x)
            ids.append(int(model.output(h[:, -1]).argmax()))
            # Positions t <= n - j read verified tokens only: kept; the later ones read drafts.
            verified = max(a, n - j + 1)
            self.add_verified(j, h[:, :verified - a])
            _rewind(self.caches[j - 1], verified)
            done = self.states[j]
            prev = h if done is None or a == 0 else torch.cat([done[:, :a], h], dim=1)
        return ids[n + 1:]


def _rewind(cache: DecodeCache, length: int) -> None:
    """Forget the positions from ``length`` on (keys of rejected drafts): the next ``begin`` writes there."""
    cache.num_cached = length
    for layer in cache.layers:
        layer.length = length


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels, so that a time measured after it is their time."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
