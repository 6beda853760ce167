"""Activation memory of one micro-batch on one rank, from the shapes the model code saves for
backward.

Every term below is a tensor that ``moetrain.models`` keeps alive until its backward (found by
reading the code and checked with a saved-tensor hook), for T tokens on the rank, in bytes:

    block input x                     T*D          (saved by the attention norm)
    RMSNorm (x2 per block)            2*T*D + 4*T  (normalised x, its scaled output; 1/rms)
    attention                         T*H*A + 2*T*G*A + T*H*A + 4*T*H
                                      (rotated q; rotated k and v; the attention output, which
                                       the out-projection reads as a view; the softmax
                                       log-sum-exp of the CPU/flash kernel)
    latent attention (MLA)            [T*Q + norm(Q)] + T*(R+P) + norm(R) + 2*T*H*(N+P)
                                      + T*H*(N+U) + T*H*U + 4*T*H
                                      (q latent and q_norm, with q_lora_rank Q; the kv latent
                                       with the rotary key, and kv_norm; q and k concatenated
                                       [nope, rope]; the up-projected k_nope and v, v a view of
                                       it; the output; log-sum-exp of the memory-efficient kernel.
                                       On CPU, where v's dim differs from q's, SDPA runs its math
                                       path and saves the B*H*S*S probabilities as well)
    residual after attention          T*D
    dense FFN                         gelu 2*T*F_d, swiglu 4*T*F_d (hidden, activation[, gate,
                                      product])
    router (fp32)                     T*E*(4+4+4+8) + 8*T  (logits, probabilities, sorted
                                      probabilities, sort order; log-sum-exp, renorm sum)
    dispatch                          N*(8+8+4)    (copy order, token index, copy weight)
    routed experts                    N_r*D (input rows) + gelu 2*N_r*F, swiglu 4*N_r*F
                                      + N*D (their output, kept by the weighted combine)
    shared experts                    like a dense FFN of hidden F_s
    head                              T*D (final norm) x2, T*V (logits), 4*T*V (fp32 log-softmax)

    multi-token depth k (mtp_depth)   on T_k = B*(S-k) positions: hnorm and enorm (their outputs
                                      unsaved), the embedding read, the 2*T_k*D concatenation,
                                      a whole block, its norm, 4*T_k*V (fp32 log-softmax; its
                                      logits are not kept)

with N = T*K routed copies (times min(1, capacity factor); expert choice routes
E*ceil(cf*T*K/E), about cf*T*K, for any cf), N_r the copies this rank's experts receive (N on
average: the planner assumes balanced routing), G key/value heads of size A, norm(W) an RMSNorm
over W features as the one above.

The peak comes either in the backward of the loss, where the gradients of the log-softmax and of
the logits (2 * 4*T*V) join everything saved, or in some block's backward, where that block's
saved tensors, the blocks before it and the logits (still held by the caller's output) meet the
block's working gradients (an FFN's: 2 or 3 x rows x hidden; attention's: q, k, v, output).
Activation checkpointing keeps only a checkpointed module's input and recomputes the module in
its backward, so its internals exist for one module at a time. It checkpoints the trunk's blocks
("full", "every_n") or every MoE layer ("moe", the multi-token blocks' too). With multi-token
modules the last depth's loss backward comes first, with everything saved.

Mixed precision (bf16/fp16): matmul outputs and what they feed are 2 bytes; the RMSNorm
internals, the router, the attention log-sum-exp and the log-softmax stay fp32, and the logits
get an fp32 copy for the loss. The fp32 formula is the one tested against measurement.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig


@dataclass
class ActivationEstimate:
    saved_bytes: int
    """Bytes saved for backward at the end of the forward (all blocks, head included)."""
    peak_bytes: int
    """Estimated peak of activation memory in the step (what ``MemoryTracker`` reports as
    ``activation_peak_bytes``)."""
    a2a_buffer_bytes: int
    """Bytes of one MoE layer's all-to-all send and receive buffers, alive during its exchange
    (0 without expert parallelism)."""
    terms: dict[str, int] = field(default_factory=dict)
    """The named parts of ``saved_bytes``; ``head`` is what follows the last block (the final norm,
    the head and the multi-token modules: the last pipeline stage's)."""


def _ffn_bytes(T: int, hidden: int, activation: str, b: int) -> int:
    return (4 if activation == "swiglu" else 2) * T * hidden * b


def _norm_bytes(T: int, width: int, b: int, dtype: str, *, output_saved: bool = True) -> int:
    """An RMSNorm over ``width`` features: its normalised x, its output when the next op saves it
    (a matmul does, a concatenation does not), and 1/rms."""
    per = b if dtype == "fp32" else 4 + b
    return (2 if output_saved else 1) * T * width * per + 4 * T


def _attention_bytes(model: ModelConfig, T: int, b: int, dtype: str) -> tuple[int, int]:
    """(saved, working gradients in backward) of one attention module for T tokens."""
    H = model.num_heads
    if model.attention == "mla":
        N, P, U = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
        R, Q = model.kv_lora_rank, model.q_lora_rank
        q_latent = 0 if Q is None else T * Q * b + _norm_bytes(T, Q, b, dtype)  # wq_a's output, q_norm
        kv_latent = T * (R + P) * b + _norm_bytes(T, R, b, dtype)  # wkv_a's output (c and k_rope), kv_norm
        # q and k concatenated [nope, rope], the expanded k_nope/v (v is a view of it), the output.
        qkv = 2 * T * H * (N + P) * b + T * H * (N + U) * b + T * H * U * b
        saved = q_latent + kv_latent + qkv + 4 * T * H
        return saved, 2 * T * H * (N + P + U) * b
    G, A = model.resolved_num_kv_heads, model.resolved_head_dim
    # Rotated q; rotated k and v; the output (the out-projection reads a view of it); log-sum-exp.
    saved = T * H * A * b + 2 * T * G * A * b + T * H * A * b + 4 * T * H
    return saved, (2 * T * H * A + 2 * T * G * A) * b


@dataclass
class _Block:
    """One transformer block's activations for its token count: ``attn`` (input, attention norm,
    attention, residual, FFN norm), ``ffn`` (the FFN's saved tensors), ``transient`` (its largest
    working gradients in backward)."""

    attn: int
    ffn: int
    transient: int


def _block(model: ModelConfig, moe: MoEConfig, *, is_moe: bool, T: int, N: int, N_recv: int, b: int,
           dtype: str) -> _Block:
    D, E, K = model.dim, moe.num_experts, moe.top_k
    norm = _norm_bytes(T, D, b, dtype)
    attention, attn_transient = _attention_bytes(model, T, b, dtype)
    attn = T * D * b + norm + attention + T * D * b + norm  # input, norm, attention, residual, FFN norm
    if is_moe:
        router = T * E * (3 * 4 + 8) + 4 * T + (4 * T if moe.renormalize and K > 1 else 0)
        dispatch = N * (8 + 8 + 4)
        experts = N_recv * D * b + _ffn_bytes(N_recv, moe.expert_hidden_dim, moe.activation, b) + N * D * b
        shared = (_ffn_bytes(T, moe.resolved_shared_hidden_dim, moe.activation, b)
                  if moe.num_shared_experts > 0 else 0)
        ffn = router + dispatch + experts + shared
        # The gradients of the hidden activation and pre-activation (and the gate's for swiglu).
        ffn_transient = (3 if moe.activation == "swiglu" else 2) * N_recv * moe.expert_hidden_dim * b
    else:
        hidden = model.resolved_dense_hidden_dim
        ffn = _ffn_bytes(T, hidden, model.activation, b)
        ffn_transient = (3 if model.activation == "swiglu" else 2) * T * hidden * b
    return _Block(attn=attn, ffn=ffn, transient=max(attn_transient, ffn_transient))


def estimate_activations(model: ModelConfig, moe: MoEConfig, *, micro_batch_size: int, seq_len: int,
                         ep: int = 1, ac: str = "none", ac_every: int = 2, dtype: str = "fp32",
                         recv_copies: int | None = None) -> ActivationEstimate:
    """Activation bytes of one micro-batch of ``micro_batch_size`` sequences of ``seq_len`` on a
    rank with expert-parallel degree ``ep`` and checkpointing mode ``ac`` (none/full/moe/every_n).
    ``recv_copies``: the routed copies this rank's experts receive per MoE layer (default: as many
    as it sends, balanced routing; ``moetrain.plan.skew`` gives the hottest rank's under skew)."""
    V = model.vocab_size
    if V is None:
        raise ValueError("model.vocab_size (None) must be set to estimate activations")
    T, D = micro_batch_size * seq_len, model.dim
    b = 4 if dtype == "fp32" else 2  # compute dtype of matmul outputs
    f32 = 4
    N = _routed_copies(moe, T)
    # Balanced routing: a rank's experts receive, on average, what it sends.
    N_recv = N if recv_copies is None else recv_copies

    def block(is_moe: bool, tokens: int) -> _Block:
        return _block(model, moe, is_moe=is_moe, T=tokens, N=N * tokens // T, N_recv=N_recv * tokens // T,
                      b=b, dtype=dtype)

    blocks = [(i, model.is_moe_layer(i)) for i in range(model.num_layers)]
    checkpointed = _checkpointed(ac, blocks, ac_every)

    saved = 0
    terms = {"attention_blocks": 0, "moe_ffn": 0, "dense_ffn": 0}
    backward_points = []  # activation bytes alive during each block's backward, minus the head
    for i, is_moe in blocks:
        blk = block(is_moe, T)
        if checkpointed.get(i) == "block":
            kept_bytes = T * D * b  # the block's input
        elif checkpointed.get(i) == "ffn":
            kept_bytes = blk.attn  # the MoE layer keeps only its input (the norm output)
        else:
            kept_bytes = blk.attn + blk.ffn
        # Blocks before i still hold what they saved; block i holds its internals (recomputed
        # if checkpointed); its incoming gradient and working gradients come on top.
        backward_points.append(saved + blk.attn + blk.ffn + T * D * b + blk.transient)
        saved += kept_bytes
        terms["moe_ffn" if is_moe else "dense_ffn"] += kept_bytes - min(kept_bytes, blk.attn)
        terms["attention_blocks"] += min(kept_bytes, blk.attn)

    logits = T * V * b + (T * V * f32 if dtype != "fp32" else 0)
    # The last block's output, the final norm, the logits, the log-softmax.
    head = T * D * b + _norm_bytes(T, D, b, dtype) + logits + T * V * f32
    saved += head
    # The loss's backward, with everything saved; or a block's backward, where of the head only
    # the logits are left (the caller's output still holds them).
    peak = max(saved + 2 * T * V * f32, max(backward_points, default=0) + T * V * b)
    mtp_saved, mtp_peak = _mtp(model, block, micro_batch_size=micro_batch_size, seq_len=seq_len, ac=ac, b=b,
                               dtype=dtype, before=saved)
    # The multi-token modules sit after the head: the last pipeline stage's, as the head.
    terms["head"] = head + mtp_saved
    saved += mtp_saved
    peak = max(peak, mtp_peak)
    a2a = (N + N_recv) * D * b if ep > 1 else 0  # send and receive buffers of one dispatch
    return ActivationEstimate(saved_bytes=saved, peak_bytes=peak, a2a_buffer_bytes=a2a, terms=terms)


def _routed_copies(moe: MoEConfig, T: int) -> int:
    """Routed copies of T tokens: T K, capped by a token-choice capacity factor below 1; expert
    choice takes E ceil(cf T K / E) of them, about cf T K, whatever cf."""
    K, cf = moe.top_k, moe.capacity_factor
    if moe.is_expert_choice and cf is not None:
        return moe.num_experts * math.ceil(cf * T * K / moe.num_experts)
    return int(T * K * (1.0 if cf is None else min(1.0, cf)))


def _mtp(model: ModelConfig, block: Callable[[bool, int], _Block], *, micro_batch_size: int, seq_len: int, ac: str,
         b: int, dtype: str, before: int) -> tuple[int, int]:
    """(saved bytes, peak) of the multi-token modules (``moetrain.models.mtp``), run after the
    head, given the ``before`` bytes saved by the trunk and the head. Depth k sees T_k = B (S - k)
    positions and saves: its two input norms (whose outputs the concatenation does not keep), the
    embedding it reads, the concatenation ``eh_proj`` reads, a whole block (only its MoE layer is
    checkpointed, under "moe": "full" and "every_n" checkpoint the trunk's blocks), its norm and the
    fp32 log-softmax of its head pass (the logits themselves are not kept). Backward runs the last
    depth first: its loss's gradients (2 x T_k V fp32) meet everything saved; then its block's
    working gradients meet the depths before it."""
    D, V = model.dim, model.vocab_size
    assert V is not None
    saved, points = 0, []
    for k in range(1, model.mtp_depth + 1):
        T = micro_batch_size * (seq_len - k)
        blk = block(model.is_moe, T)
        inputs = (2 * _norm_bytes(T, D, b, dtype, output_saved=False) + T * D * b  # hnorm, enorm, the embedding
                  + 2 * T * D * b)  # the concatenation
        body = blk.attn + (0 if ac == "moe" and model.is_moe else blk.ffn)
        head = T * D * b + _norm_bytes(T, D, b, dtype) + T * V * 4  # block output, norm, log-softmax
        # Its loss's backward (the gradient handed back by the depth after it, T D, on top); then
        # its block's backward, the block recomputed if checkpointed.
        points.append((before + saved + inputs + body + head + 2 * T * V * 4 + T * D * b,
                       before + saved + inputs + blk.attn + blk.ffn + 2 * T * D * b + blk.transient))
        saved += inputs + body + head
    return saved, max((max(p) for p in points), default=0)


def _checkpointed(ac: str, blocks: list[tuple[int, bool]], every: int) -> dict[int, str]:
    """Block index -> "block" (the whole block recomputed) or "ffn" (its MoE layer only)."""
    if ac == "none":
        return {}
    if ac == "full":
        return {i: "block" for i, _ in blocks}
    if ac == "moe":
        return {i: "ffn" for i, is_moe in blocks if is_moe}
    if ac == "every_n":
        return {i: "block" for i, _ in blocks[::every]}
    raise ValueError(f"train.activation_checkpointing ({ac!r}) must be one of 'none', 'full', 'moe', 'every_n'")


def moe_layers_recomputed(model: ModelConfig, ac: str, every: int) -> int:
    """MoE layers whose forward activation checkpointing ``ac`` repeats in backward (their
    all-to-alls and etp collectives with it): "moe" checkpoints the multi-token blocks' MoE layers
    too, "full" and "every_n" only the trunk's blocks."""
    if ac == "moe":
        return len(model.moe_layer_ids) + (model.mtp_depth if model.is_moe else 0)
    if ac == "full":
        return len(model.moe_layer_ids)
    if ac == "every_n":
        return sum(1 for i in range(0, model.num_layers, every) if model.is_moe_layer(i))
    return 0
