"""Pipeline parallelism for the single-device ``Transformer``, on ``torch.distributed.pipelining``.

The model is cut from outside, torchtitan-style: every rank builds (or meta-builds) the whole
model, keeps the blocks of its stages and drops the rest. What stays is

    PipelineModel   the rank's part under the model's own parameter names (``tok_embeddings``,
                    ``layers.<i>``, ``norm``, ``output``): the optimizer, the checkpoint and the
                    balancer see it, and a checkpoint saved at pp=2 loads into one process
    PipelineChunk   one stage (``parallel.pp_virtual_stages`` of them per rank), sharing the
                    modules of the PipelineModel: what a ``PipelineStage`` runs

Stages and ranks. ``num_stages = pp * pp_virtual_stages`` contiguous runs of blocks
(:func:`split_stages`); rank ``r`` of the pp group holds stages ``r, r + pp, r + 2 pp, ...``
(the "loop" placement interleaved 1F1B needs). The first stage also holds the embedding, the
last the final norm, the head and the multi-token modules (``model.mtp_depth``).

The shared embedding. The multi-token modules read the token embedding, and a tied head
(``model.tie_embeddings``) is the embedding; both live on the last stage. As in Megatron-LM,
the last stage then holds a copy of ``tok_embeddings`` under the same name: initialised by name,
so equal to the first stage's, its gradient summed with the first stage's over the two ranks
(``embedding_groups``) before clipping and the step, so the two copies stay bitwise equal. The
gradient norm counts it once (``PipelineStep.clip_grad_norm_``), and a checkpoint holds it once
(both ranks write the same entry; DCP keeps one) and gives it to both on loading.

The MoE auxiliary loss. The schedule back-propagates only the last stage's loss, but every
stage's MoE layers add a load-balancing term to the objective. Each chunk attaches the sum of its
layers' aux losses to its output with :class:`AuxLossScaler` (Megatron's MoEAuxLossAutoScaler):
the identity in the forward, whose backward also hands the aux loss the gradient
``aux_grad_scale``. With the LM loss divided by the micro-batch count M in the loss function and
``aux_grad_scale = 1 / M`` (times an fp16 loss scale), the accumulated gradient is that of
``mean over micro-batches of (loss + aux)``: the one-process objective, for any M and any
stage split. The schedule's own division by M is therefore off (``scale_grads=False``).

Gradient reduction. At ZeRO stages 2/3 each chunk is an FSDP2 root and the schedule runs its
reduce-scatters after the last micro-batch. At stages 0/1 the chunks are not wrapped in DDP (the
schedule runs every forward under ``no_sync``, which hides the expert shards' edp reduction of
``MoEDataParallel``): ``finalize_grads`` reduces after the schedule instead, by the same rule
(``moetrain.distributed.data_parallel.finalize``: scale by 1/dp, sum over the copies), one flat
all-reduce per group and dtype.

Shape legend: B batch (a micro-batch inside a stage), S sequence, D model dim, V vocabulary.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from moetrain.config.pipeline import check_pipeline_model, check_pipeline_reduction, shares_embedding
from moetrain.config.zero import check_offload
from moetrain.distributed.comm.timer import CommTimer, timed_exchange
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.distributed.tensor_parallel import apply_tensor_parallel
from moetrain.models.attention import attention_mask, rope_rows, rope_table_for
from moetrain.models.init import init_parameters
from moetrain.models.moe.layer import MoELayer
from moetrain.models.mtp import MTPModule, mtp_losses
from moetrain.models.transformer import Transformer

PP_SPLITS = ("layers", "params", "flops")


class AuxLossScaler(torch.autograd.Function):
    """``h`` unchanged in the forward; the backward passes ``h``'s gradient through and gives
    ``aux`` (a 0-dim loss computed from this stage's activations) the gradient ``scale``, as if
    ``scale * aux`` had been added to the loss the schedule back-propagates."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_meta = scale, (aux.shape, aux.dtype, aux.device)
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_h, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


# ----- the stage split (pure arithmetic) ---------------------------------------------------------


def layer_costs(model: Transformer, split: str, *, seq_len: int) -> tuple[list[float], float, float]:
    """``(cost of each block, extra cost of the first stage, extra cost of the last stage)`` for
    ``parallel.pp_split``: "layers" 1 per block and no extras; "params" parameter counts (every
    expert; embedding first, final norm and head last); "flops" training FLOPs per token, 6 per
    active matmul parameter (top_k of the routed experts) plus attention's ``6 H (A + U) S``
    (``flops_per_token``'s terms), the head's 6 V D last and nothing for the embedding lookup.
    The multi-token modules sit on the last stage: their blocks, projections and norms, its copy of
    the embedding when the head is untied (params), and per depth a block and one more head pass (flops)."""
    if split not in PP_SPLITS:
        raise ValueError(f"parallel.pp_split ({split!r}) must be one of {', '.join(map(repr, PP_SPLITS))}")
    if split == "layers":
        return [1.0] * len(model.layers), 0.0, 0.0
    costs = [_block_cost(model, layer, split, seq_len=seq_len) for layer in model.layers]
    mtp = [m for m in model.mtp if isinstance(m, MTPModule)]
    if split == "params":
        head = sum(p.numel() for p in model.output.parameters()) + sum(p.numel() for p in model.norm.parameters())
        embedding = model.tok_embeddings.weight.numel()
        copy = embedding if mtp and model.output.weight is not model.tok_embeddings.weight else 0
        extra = sum(p.numel() for m in mtp for p in m.parameters())
        return costs, float(embedding), float(head + copy + extra)
    head = 6 * model.output.weight.numel()
    mtp_flops = 0.0
    for m in mtp:  # each depth: its block, its projection and one more head pass
        mtp_flops += _block_cost(model, m.block, split, seq_len=seq_len) + 6 * m.eh_proj.weight.numel() + head
    return costs, 0.0, head + mtp_flops


def _block_cost(model: Transformer, layer: nn.Module, split: str, *, seq_len: int) -> float:
    total = sum(p.numel() for p in layer.parameters())
    if split == "params":
        return float(total)
    cfg, moe = model.config, model.moe_config
    ffn = layer.feed_forward
    expert = sum(p.numel() for p in ffn.experts.parameters()) if isinstance(ffn, MoELayer) else 0
    active = total - expert + expert * moe.top_k // moe.num_experts
    head_dim = cfg.resolved_head_dim
    v_dim = cfg.v_head_dim if cfg.attention == "mla" else head_dim
    return float(6 * active + 6 * cfg.num_heads * (head_dim + v_dim) * seq_len)


def split_stages(costs: list[float], num_stages: int, *, first_extra: float = 0.0,
                 last_extra: float = 0.0) -> list[range]:
    """Contiguous runs of blocks, one per stage, each non-empty, that minimise the largest stage
    cost (the first stage's including ``first_extra``, the last's ``last_extra``). Ties go to
    the cut whose earlier stages are the larger (so equal costs give the first ``L % n`` stages
    one block more). Exact dynamic programme, O(n L^2)."""
    num_layers = len(costs)
    if not isinstance(num_stages, int) or num_stages < 1 or num_stages > num_layers:
        raise ValueError(f"pipeline stages ({num_stages!r} = parallel.pp * parallel.pp_virtual_stages) must be "
                         f">= 1 and <= model.num_layers ({num_layers}): every stage holds at least one block")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(lo: int, hi: int, stage: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == num_stages - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    # best[s][i]: the smallest largest-stage cost of blocks i.. over stages s.. (cut at the right).
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[num_stages][num_layers] = 0.0
    for s in range(num_stages - 1, -1, -1):
        for i in range(num_layers - (num_stages - s), -1, -1):
            # Largest first: ties keep the longest run for stage s.
            for j in range(num_layers - (num_stages - s - 1), i, -1):
                value = max(cost(i, j, s), best[s + 1][j])
                if value < best[s][i] - 1e-9 * max(1.0, abs(value)):
                    best[s][i], cut[s][i] = value, j
    ranges, i = [], 0
    for s in range(num_stages):
        ranges.append(range(i, cut[s][i]))
        i = cut[s][i]
    return ranges


def rank_stage_ids(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The stages rank ``pp_rank`` holds: ``pp_rank + k * pp`` (interleaved 1F1B's loop order)."""
    return [pp_rank + k * pp for k in range(virtual_stages)]


# ----- the modules -------------------------------------------------------------------------------


class PipelineChunk(nn.Module):
    """One pipeline stage of a ``Transformer``: its blocks (under their model indices), and the
    embedding on the first stage, the final norm and head on the last. ``forward`` takes token
    ids ``[B, S]`` on the first stage, the hidden state ``[B, S, D]`` elsewhere, and returns the
    hidden state, or on the last stage the logits ``[B, S, V]``. ``tokens_BS`` (the token ids, on
    every stage) is needed only when ``model.document_separator`` masks attention by document."""

    rope_cos_SA: torch.Tensor
    rope_sin_SA: torch.Tensor

    def __init__(self, model: Transformer, layer_ids: range, *, stage_id: int, num_stages: int) -> None:
        super().__init__()
        self.config, self.stage_id = model.config, stage_id
        self.is_first, self.is_last = stage_id == 0, stage_id == num_stages - 1
        embeds = self.is_first or (self.is_last and shares_embedding(model.config))
        # Registered first, so a tied head's weight is named tok_embeddings.weight, as in the model.
        self.tok_embeddings = model.tok_embeddings if embeds else None
        self.embedding_dropout = model.embedding_dropout if embeds else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if self.is_last else None
        self.output = model.output if self.is_last else None
        self.mtp = model.mtp if self.is_last else None
        self.register_buffer("rope_cos_SA", model.rope_cos_SA, persistent=False)
        self.register_buffer("rope_sin_SA", model.rope_sin_SA, persistent=False)
        self.aux_grad_scale = 1.0
        """The gradient the aux loss gets per micro-batch: 1 / micro-batches (times the loss scale)."""
        self.timer = CommTimer(enabled=True, device=model.rope_cos_SA.device)
        """Forward and backward compute spans of this stage (host clocks on CPU, events on a GPU)."""
        self.aux_sum = torch.zeros((), dtype=torch.float64, device=model.rope_cos_SA.device)
        """This stage's aux losses, summed over the micro-batches since the last ``pop_aux_sum``."""
        self.mtp_sum = torch.zeros(model.config.mtp_depth, dtype=torch.float64, device=model.rope_cos_SA.device)
        """The last stage's cross-entropy of each multi-token depth, summed like ``aux_sum``."""
        self.recording = True
        """Off while the schedule infers shapes (see ``muted``)."""
        self.sequence_shards = 1
        """parallel.tp once tensor parallelism is applied: the hidden state a stage receives holds
        S / tp positions of every sequence."""

    @contextlib.contextmanager
    def muted(self):
        """The schedule's shape inference runs one extra forward and backward on the first step
        (on uninitialised inputs past the first stage): it must not count into the aux-loss sum,
        the timings or the MoE layers' routing statistics of the step."""
        layers = [m for m in self.modules() if isinstance(m, MoELayer)]
        tracked = [m.track_routing_stats for m in layers]
        timed, self.recording, self.timer.enabled = self.timer.enabled, False, False
        for m in layers:
            m.track_routing_stats = False
        try:
            yield
        finally:
            self.recording, self.timer.enabled = True, timed
            for m, on in zip(layers, tracked, strict=True):
                m.track_routing_stats = on

    def forward(self, x: torch.Tensor, tokens_BS: torch.Tensor | None = None,
                labels_BS: torch.Tensor | None = None) -> torch.Tensor:
        """``labels_BS`` (the next-token labels, given to every stage while training): the last
        stage adds the multi-token losses, which need them and ``tokens_BS``, to the objective."""
        if self.config.document_separator is not None and tokens_BS is None:
            raise ValueError("model.document_separator masks attention by document: every pipeline stage "
                             "needs the token ids (tokens_BS)")
        h_BSD = x
        if self.is_first:
            assert self.tok_embeddings is not None and self.embedding_dropout is not None
            h_BSD = self.embedding_dropout(self.tok_embeddings(x))
        # Past the first stage the stream is this rank's sequence shard under tensor parallelism.
        S = x.shape[1] if self.is_first else x.shape[1] * self.sequence_shards
        # Without a document separator (or padding, which the lm head does not mask) the mask
        # is None whatever the tokens: SDPA's own causal kernel.
        mask_B1SK = None if tokens_BS is None else attention_mask(
            tokens_BS, causal=self.config.causal, document_separator=self.config.document_separator,
            padding_mask_BS=None)
        kind = f"stage{self.stage_id}"
        mtp = None
        if self.is_last and self.config.mtp_depth > 0 and labels_BS is not None:
            if tokens_BS is None:
                raise ValueError("model.mtp_depth > 0: the last pipeline stage needs the token ids (tokens_BS)")
            mtp = (tokens_BS, labels_BS)
        return timed_exchange(lambda h: self._blocks(h, S, mask_B1SK, mtp), h_BSD, self.timer,
                              kind=f"{kind}_forward", backward_kind=f"{kind}_backward")

    def _blocks(self, h_BSD: torch.Tensor, S: int, mask_B1SK: torch.Tensor | None,
                mtp: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        cos_SP, sin_SP = rope_rows(self.config, self.rope_cos_SA, self.rope_sin_SA, 0, S)
        aux_losses = []
        for layer in self.layers.values():
            h_BSD, aux = layer(h_BSD, cos_SP, sin_SP, mask_B1SK)
            if aux is not None:
                aux_losses.append(aux.loss.float())
        if self.is_last:
            assert self.output is not None and self.norm is not None
            h_BSD = self.norm(h_BSD)
            out = self.output(h_BSD)
            if mtp is not None:
                out = self._add_mtp_loss(out, h_BSD, *mtp, cos_SP, sin_SP, aux_losses)
            else:
                out = self._add_aux_loss(out, aux_losses)
            return out
        # p2p sends need contiguous tensors.
        return self._add_aux_loss(h_BSD, aux_losses).contiguous()

    def _add_aux_loss(self, h: torch.Tensor, aux_losses: list[torch.Tensor],
                      extra: torch.Tensor | None = None) -> torch.Tensor:
        """``h`` with this stage's aux losses (and ``extra``, the weighted multi-token loss)
        attached for the backward (``AuxLossScaler``); the aux losses recorded."""
        if not aux_losses and extra is None:
            return h
        total = torch.stack(aux_losses).sum() if aux_losses else torch.zeros((), device=h.device)
        if aux_losses and self.training and self.recording:
            with torch.no_grad():
                self.aux_sum += total.detach().double()
        if extra is not None:
            total = total + extra
        if total.requires_grad and torch.is_grad_enabled():
            h = AuxLossScaler.apply(h, total, self.aux_grad_scale)
        return h

    def _add_mtp_loss(self, logits_BSV: torch.Tensor, h_BSD: torch.Tensor, tokens_BS: torch.Tensor,
                      labels_BS: torch.Tensor, cos_SP: torch.Tensor, sin_SP: torch.Tensor,
                      aux_losses: list[torch.Tensor]) -> torch.Tensor:
        """The logits with ``model.mtp_loss_weight * mean_k L_k`` and the modules' MoE aux losses
        attached (the same objective as ``Transformer.forward``'s); each depth's loss recorded."""
        assert self.mtp is not None and self.tok_embeddings is not None and self.embedding_dropout is not None
        assert self.output is not None
        cfg, embedding, dropout = self.config, self.tok_embeddings, self.embedding_dropout
        per_depth, moe_aux = mtp_losses(
            self.mtp, h_BSD, tokens_BS, labels_BS, embed=lambda ids: dropout(embedding(ids)), output=self.output,
            cos_SP=cos_SP, sin_SP=sin_SP, mask_fn=lambda ids: attention_mask(
                ids, causal=cfg.causal, document_separator=cfg.document_separator, padding_mask_BS=None))
        if self.training and self.recording:
            with torch.no_grad():
                self.mtp_sum += per_depth.detach().double()
        aux_losses = aux_losses + [a.loss.float() for a in moe_aux]
        return self._add_aux_loss(logits_BSV, aux_losses, cfg.mtp_loss_weight * per_depth.mean())

    def pop_aux_sum(self) -> torch.Tensor:
        out, self.aux_sum = self.aux_sum, torch.zeros_like(self.aux_sum)
        return out

    def pop_mtp_sum(self) -> torch.Tensor:
        out, self.mtp_sum = self.mtp_sum, torch.zeros_like(self.mtp_sum)
        return out


class PipelineModel(nn.Module):
    """The stages of one rank under the model's parameter names (the blocks a rank does not hold
    are absent from ``layers``); ``chunks`` are the stages themselves, in stage order."""

    def __init__(self, model: Transformer, stage_layers: list[range], stage_ids: list[int]) -> None:
        super().__init__()
        self.config, self.moe_config = model.config, model.moe_config
        self.num_stages, self.stage_ids = len(stage_layers), list(stage_ids)
        # Plain list, not registered: parameters are named through the modules below only.
        self.chunks = [PipelineChunk(model, stage_layers[s], stage_id=s, num_stages=self.num_stages)
                       for s in stage_ids]
        first, last = self.chunks[0], self.chunks[-1]
        self.tok_embeddings = first.tok_embeddings if first.is_first else last.tok_embeddings
        self.layers = nn.ModuleDict({k: v for c in self.chunks for k, v in c.layers.items()})
        self.norm, self.output, self.mtp = last.norm, last.output, last.mtp
        self.holds_embedding_copy = last.is_last and not first.is_first and last.tok_embeddings is not None
        """This rank's ``tok_embeddings`` is the last stage's copy of the first stage's."""

    def train(self, mode: bool = True) -> PipelineModel:
        super().train(mode)
        for chunk in self.chunks:  # not submodules (see above), so not reached by super().train
            chunk.train(mode)
        return self


def build_pipeline_model(model: Transformer, *, pp_rank: int, pp: int, virtual_stages: int = 1,
                         split: str = "layers", seq_len: int | None = None,
                         device: torch.device | None = None, seed: int = 0) -> PipelineModel:
    """This rank's stages of ``model`` (built whole, the same on every rank, possibly on the meta
    device: then only the kept modules are materialised on ``device`` and initialised from
    ``seed``, drawn by parameter name exactly as ``Transformer.init_weights`` draws the whole
    model's)."""
    cfg = model.config
    check_pipeline_model(cfg, pp=pp, virtual_stages=virtual_stages)
    costs, first_extra, last_extra = layer_costs(model, split, seq_len=seq_len or cfg.max_seq_len)
    stage_layers = split_stages(costs, pp * virtual_stages, first_extra=first_extra, last_extra=last_extra)
    pm = PipelineModel(model, stage_layers, rank_stage_ids(pp_rank, pp, virtual_stages))
    if model.tok_embeddings.weight.is_meta:
        if device is None:
            raise ValueError("a model built on the meta device needs the device to materialise its stages on")
        for chunk in pm.chunks:  # the kept modules only: the dropped blocks stay on meta
            chunk.to_empty(device=device)
            chunk.aux_sum = torch.zeros((), dtype=torch.float64, device=device)
            chunk.mtp_sum = torch.zeros(cfg.mtp_depth, dtype=torch.float64, device=device)
            if chunk.is_last and cfg.head == "lm" and cfg.tie_embeddings:
                # to_empty gives the two holders of the tied weight two new tensors: tie them again.
                assert chunk.tok_embeddings is not None and chunk.output is not None
                chunk.output.weight = chunk.tok_embeddings.weight
            chunk.timer = CommTimer(enabled=True, device=torch.device(device))
        # The chunks keep the whole model's parameter names, so they get the whole model's draws.
        init_parameters(pm, cfg, seed)
        cos_SP, sin_SP = rope_table_for(cfg)
        with torch.no_grad():
            for chunk in pm.chunks:
                chunk.rope_cos_SA.copy_(cos_SP)
                chunk.rope_sin_SA.copy_(sin_SP)
    return pm


# ----- parallelising the stages and the schedule -------------------------------------------------


def parallelize_pipeline(pm: PipelineModel, dims: ParallelDims, *, activation_checkpointing: str = "none",
                         activation_checkpointing_every: int = 2, compile: bool = False, zero_stage: int = 0,
                         mixed_precision: str = "fp32", offload_params: bool = False,
                         offload_optimizer: bool = False, pin_memory: bool = True, hsdp_replicate: int = 1,
                         grad_compression: str = "none", bucket_cap_mb: float = 25.0) -> None:
    """``parallelize``'s fixed order applied to this rank's stages, in place: 1. tensor
    parallelism over the stage's tp group (the stream between stages is then each rank's sequence
    shard, sent to the same tp rank of the next stage), 2. expert parallelism over the stage's ep
    group, 3. activation checkpointing, 4. compile per block, 5. data parallelism: FSDP2 per chunk
    at ZeRO stages 2/3 (each chunk a root over its blocks); nothing at 0/1, where
    ``finalize_grads`` reduces after the schedule.
    ``bucket_cap_mb`` (DDP's) has no use here: the stage 0/1 reduction is one flat buffer."""
    from moetrain.distributed.data_parallel.ddp import apply_data_parallel
    from moetrain.distributed.expert_parallel.apply import apply_expert_parallel
    from moetrain.distributed.parallelize import (
        apply_activation_checkpointing,
        checkpoint_blocks,
        compile_blocks,
    )

    del bucket_cap_mb
    check_pipeline_reduction(pp=dims.pp, grad_compression=grad_compression)
    check_offload(zero_stage, offload_optimizer=offload_optimizer, offload_param=offload_params, pp=dims.pp)
    apply_tensor_parallel(pm, dims)
    for chunk in pm.chunks:
        chunk.sequence_shards = dims.tp
    apply_expert_parallel(pm, dims)
    checkpointed = checkpoint_blocks(pm, activation_checkpointing, every=activation_checkpointing_every)
    apply_activation_checkpointing(checkpointed, compile=compile)
    if compile:
        compile_blocks(list(pm.layers.values()), checkpointed=checkpointed)
    if zero_stage >= 2:
        # FSDP2 warns that a root returning a view loses its pre-backward hook to an in-place op
        # on it; a chunk's output is only sent or fed to the loss, never modified in place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPPipelineChunk\) returned a view")
        for chunk in pm.chunks:
            apply_data_parallel(chunk, dims, zero_stage=zero_stage, blocks=list(chunk.layers.values()),
                                mixed_precision=mixed_precision, offload_params=offload_params,
                                offload_optimizer=offload_optimizer, pin_memory=pin_memory,
                                hsdp_replicate=hsdp_replicate)
