"""Activation memory of one micro-batch on one rank, from the shapes the model code saves for
backward.

Every term below is a tensor that ``moetrain.models`` keeps alive until its backward (found by
reading the code and checked with a saved-tensor hook), for T tokens on the rank, in bytes:

    block input x                     T*D          (saved by the attention norm)
    RMSNorm (x2 per block)            2*T*D + 4*T  (normalised x, its scaled output; 1/rms)
    attention                         T*D + 2*T*G*A + T*D + 4*T*H
                                      (rotated q; rotated k and v; the attention output, which
                                       the out-projection reads as a view; the softmax
                                       log-sum-exp of the CPU/flash kernel)
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

with N = T*K routed copies (times min(1, capacity factor)), N_r the copies this rank's experts
receive (N on average: the planner assumes balanced routing), G key/value heads of size A.

The peak comes either in the backward of the loss, where the gradients of the log-softmax and of
the logits (2 * 4*T*V) join everything saved, or in some block's backward, where that block's
saved tensors, the blocks before it and the logits (still held by the caller's output) meet the
block's working gradients (an FFN's: 2 or 3 x rows x hidden; attention's: q, k, v, output).
Activation checkpointing keeps only a checkpointed module's input and recomputes the module in
its backward, so its internals exist for one module at a time.

Mixed precision (bf16/fp16): matmul outputs and what they feed are 2 bytes; the RMSNorm
internals, the router, the attention log-sum-exp and the log-softmax stay fp32, and the logits
get an fp32 copy for the loss. The fp32 formula is the one tested against measurement.
"""

from __future__ import annotations

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
    """The named parts of ``saved_bytes``."""


def _ffn_bytes(T: int, hidden: int, activation: str, b: int) -> int:
    return (4 if activation == "swiglu" else 2) * T * hidden * b


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
    T, D, H = micro_batch_size * seq_len, model.dim, model.num_heads
    G, A = model.resolved_num_kv_heads, model.resolved_head_dim
    b = 4 if dtype == "fp32" else 2  # compute dtype of matmul outputs
    f32 = 4
    E, K = moe.num_experts, moe.top_k
    kept = 1.0 if moe.capacity_factor is None else min(1.0, moe.capacity_factor)
    N = int(T * K * kept)
    # Balanced routing: a rank's experts receive, on average, what it sends.
    N_recv = N if recv_copies is None else recv_copies

    norm = 2 * T * D * (b if dtype == "fp32" else f32 + b) + f32 * T
    attention = T * D * b + 2 * T * G * A * b + T * D * b + f32 * T * H
    attn_half = T * D * b + norm + attention + T * D * b  # input, norm, attention, residual
    ffn_norm = norm

    def moe_part() -> int:
        router = T * E * (3 * f32 + 8) + f32 * T + (f32 * T if moe.renormalize and K > 1 else 0)
        dispatch = N * (8 + 8 + f32)
        experts = N_recv * D * b + _ffn_bytes(N_recv, moe.expert_hidden_dim, moe.activation, b) + N * D * b
        shared = (_ffn_bytes(T, moe.resolved_shared_hidden_dim, moe.activation, b)
                  if moe.num_shared_experts > 0 else 0)
        return router + dispatch + experts + shared

    moe_ff = moe_part() if model.is_moe else 0
    dense_ff = _ffn_bytes(T, model.resolved_dense_hidden_dim, model.activation, b)
    # Gradients alive at once inside a block's backward: in an FFN, the gradients of the hidden
    # activation and of the pre-activation (and the gate's for swiglu), rows x hidden each; in
    # attention, those of q, k, v and the attention output.
    grads_per_hidden = 3 if moe.activation == "swiglu" else 2
    moe_transient = grads_per_hidden * N_recv * moe.expert_hidden_dim * b
    dense_transient = (3 if model.activation == "swiglu" else 2) * T * model.resolved_dense_hidden_dim * b
    attn_transient = (2 * T * D + 2 * T * G * A) * b
    blocks = [(i, model.is_moe_layer(i)) for i in range(model.num_layers)]
    checkpointed = _checkpointed(ac, blocks, ac_every)

    saved = 0
    terms = {"attention_blocks": 0, "moe_ffn": 0, "dense_ffn": 0}
    backward_points = []  # activation bytes alive during each block's backward, minus the head
    for i, is_moe in blocks:
        ff = moe_ff if is_moe else dense_ff
        inner = attn_half + ffn_norm + ff
        if checkpointed.get(i) == "block":
            kept_bytes = T * D * b  # the block's input
        elif checkpointed.get(i) == "ffn":
            kept_bytes = attn_half + ffn_norm  # the MoE layer keeps only its input (the norm output)
        else:
            kept_bytes = inner
        transient = max(attn_transient, moe_transient if is_moe else dense_transient)
        # Blocks before i still hold what they saved; block i holds its internals (recomputed
        # if checkpointed); its incoming gradient and working gradients come on top.
        backward_points.append(saved + inner + T * D * b + transient)
        saved += kept_bytes
        terms["moe_ffn" if is_moe else "dense_ffn"] += kept_bytes - min(kept_bytes, attn_half + ffn_norm)
        terms["attention_blocks"] += min(kept_bytes, attn_half + ffn_norm)

    logits = T * V * b + (T * V * f32 if dtype != "fp32" else 0)
    head = T * D * b + norm + logits + T * V * f32  # last block output, final norm, logits, log-softmax
    terms["head"] = head
    saved += head
    loss_backward = 2 * T * V * f32  # gradients of the log-softmax and of the logits
    # The loss's backward, with everything saved; or a block's backward, where of the head only
    # the logits are left (the caller's output still holds them).
    peak = max(saved + loss_backward, max(backward_points, default=0) + T * V * b)
    a2a = (N + N_recv) * D * b if ep > 1 else 0  # send and receive buffers of one dispatch
    return ActivationEstimate(saved_bytes=saved, peak_bytes=peak, a2a_buffer_bytes=a2a, terms=terms)


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
    all-to-alls and etp collectives with it)."""
    if ac in ("full", "moe"):
        return len(model.moe_layer_ids)
    if ac == "every_n":
        return sum(1 for i in range(0, model.num_layers, every) if model.is_moe_layer(i))
    return 0
