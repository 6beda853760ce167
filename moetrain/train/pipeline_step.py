"""One optimizer step's forward and backward under a pipeline schedule (parallel.pp > 1).

    step = PipelineStep(pm, dims, schedule="1f1b", num_microbatches=grad_accum, device=device)
    loss_sum, aux_sum = step.forward_backward(input_ids_BS, labels_BS)   # the step's M micro-batches, stacked
    norm = step.clip_grad_norm_(params, max_norm)                       # over every stage
    ...                                                                 # optimizer.step() as usual
    metrics.update(step.metrics(balancer))                              # at log steps (collective over pp)

The micro-batches are the gradient-accumulation steps: the trainer stacks its ``grad_accum``
loader batches into one ``[M * B, S]`` batch and the schedule cuts it back into the same M
micro-batches, so a pipelined step sees exactly the data of an unpipelined one. The objective
is the same too, ``mean over micro-batches of (lm loss + aux loss)``: the loss function weighs
each micro-batch's cross-entropy by ``1 / M`` and every stage hands its MoE aux losses the
gradient ``1 / M`` (``moetrain.distributed.pipeline.stages.AuxLossScaler``), both times the fp16
loss scale when there is one. Routing statistics need nothing extra: every stage's MoE layers
run every micro-batch and count it into their step buffers, which the balancer's pre-step hook
reads once per step as without pipelining.

The returned sums are the same on every rank: the lm loss exists on the last stage, the aux loss
in pieces on every stage, and one all-reduce over the pp group adds them up. With
``model.mtp_depth`` the last stage adds ``mtp_loss_weight * mean_k L_k`` to the objective (through
its aux-loss scaler, so with the same ``1 / M``) and ``mtp_sums`` holds each depth's sum.

The shared embedding (a tied head, the multi-token modules): the last stage's copy of
``tok_embeddings`` gets its gradient summed with the first stage's over ``embedding_group``
after the data-parallel reduction, so both hold the one-process gradient and step alike.

Shape legend: M micro-batches, B micro-batch size, S sequence, V vocabulary.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moetrain.config.pipeline import shares_embedding
from moetrain.distributed.data_parallel.finalize import finalize_grads
from moetrain.distributed.data_parallel.grads import clip_to_norm_, global_grad_norm
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.distributed.pipeline.schedule import build_schedule, forward_only
from moetrain.distributed.pipeline.stages import PipelineModel
from moetrain.models.transformer import IGNORE_INDEX
from moetrain.train.evaluate import lm_metrics, score_valid_rows
from moetrain.train.precision import autocast_context
from moetrain.utils.tensors import local_tensor


class PipelineStep:
    """The schedule of one rank's stages and the per-step bookkeeping around it.

    ``pp_group`` defaults to ``dims.group("pp")``. After the schedule ``finalize_grads`` reduces the
    stage gradients over dp (at ZeRO 2/3 the FSDP2 units did it inside)."""

    def __init__(self, pm: PipelineModel, dims: ParallelDims, *, schedule: str, num_microbatches: int,
                 device: torch.device, dtype: str = "fp32", pp_group: dist.ProcessGroup | None = None) -> None:
        self.pm, self.dims, self.device, self.dtype = pm, dims, device, dtype
        self.num_microbatches = num_microbatches
        self.pp_group = pp_group if pp_group is not None else dims.group("pp")
        self.holds_first = 0 in pm.stage_ids
        self.holds_last = pm.num_stages - 1 in pm.stage_ids
        self._loss_weight = 1.0 / num_microbatches
        self._raw_losses: dict[int, torch.Tensor] = {}
        self.schedule = build_schedule(pm, schedule=schedule, num_microbatches=num_microbatches,
                                       pp_group=self.pp_group, device=device, loss_fn=self._loss)
        self._step_seconds = 0.0
        self._steps = 0
        self.embedding_group = embedding_group(dims, self.pp_group) if shares_embedding(pm.config) else None
        """First and last stage ranks of this pipeline (None: nothing shared)."""
        self.mtp_sums = torch.zeros(pm.config.mtp_depth, dtype=torch.float64, device=device)
        """Each multi-token depth's loss summed over the last step's micro-batches, on every rank."""

    def _loss(self, logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        # Cross-entropy in fp32, as Transformer.forward computes it.
        loss = F.cross_entropy(logits_BSV.float().flatten(0, -2), labels_BS.flatten(), ignore_index=IGNORE_INDEX)
        # Keyed by the weighted output the schedule keeps: its shape inference calls this too.
        self._raw_losses[id(out := loss * self._loss_weight)] = loss.detach()
        return out

    def forward_backward(self, input_ids_BS: torch.Tensor, labels_BS: torch.Tensor, *,
                         loss_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the schedule over the step's micro-batches (stacked along the batch) and leave the
        gradients of this rank's stages reduced over dp. Returns ``(sum over micro-batches of the
        lm loss, the same of the aux loss)``, fp32, equal on every rank. Collective."""
        M = self.num_microbatches
        if input_ids_BS.shape[0] % M != 0:
            raise ValueError(f"the step's batch ({input_ids_BS.shape[0]} sequences) must split into "
                             f"{M} equal micro-batches")
        self._loss_weight = loss_scale / M
        for chunk in self.pm.chunks:
            chunk.aux_grad_scale = loss_scale / M
        self._raw_losses = {}
        kwargs = {}
        if self.pm.config.document_separator is not None or self.pm.config.mtp_depth > 0:
            kwargs["tokens_BS"] = input_ids_BS
        if self.pm.config.mtp_depth > 0:
            kwargs["labels_BS"] = labels_BS
        args = (input_ids_BS,) if self.holds_first else ()
        target = labels_BS if self.holds_last else None
        t0 = time.perf_counter()
        with autocast_context(self.device, self.dtype):
            losses: list[torch.Tensor] = []
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        finalize_grads(self.pm, self.dims)
        self._sum_shared_embedding_grad()
        self._step_seconds += time.perf_counter() - t0
        self._steps += 1
        sums = torch.zeros(2 + self.pm.config.mtp_depth, dtype=torch.float64, device=self.device)
        if losses:  # the rank holding the last stage: one loss per micro-batch
            sums[0] = torch.stack([self._raw_losses[id(w)] for w in losses]).double().sum()
        self._raw_losses = {}
        for chunk in self.pm.chunks:
            sums[1] += chunk.pop_aux_sum()
            sums[2:] += chunk.pop_mtp_sum()
        dist.all_reduce(sums, group=self.pp_group)
        self.mtp_sums = sums[2:]
        return sums[0].float(), sums[1].float()

    @torch.no_grad()
    def _sum_shared_embedding_grad(self) -> None:
        """Megatron's embedding all-reduce: the first stage's and the last stage's copy of
        ``tok_embeddings`` each hold the gradient of their own uses; their sum is the whole
        model's. Both ranks shard the copy alike (same dp/tp position), so the local shards add."""
        if self.embedding_group is None or self.pm.tok_embeddings is None:
            return
        if not self.pm.tok_embeddings.weight.requires_grad:  # frozen on both stages (LoRA): nothing to sum
            return
        grad = self.pm.tok_embeddings.weight.grad
        assert grad is not None, "both stages use the shared embedding in every training step"
        dist.all_reduce(local_tensor(grad), group=self.embedding_group)

    @torch.no_grad()
    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient (every stage's, dp/ep shards and the
        shared embedding counted once); returns the norm before clipping. Collective."""
        params = [p for p in params if p.grad is not None]
        embedding = self.pm.tok_embeddings
        copy = embedding.weight if self.pm.holds_embedding_copy and embedding is not None else None
        # Each stage's squared norm (summed over its dp/ep shards), summed over the pp group.
        sq = global_grad_norm([p for p in params if p is not copy]).pow(2)
        if dist.get_world_size(self.pp_group) > 1:
            dist.all_reduce(sq, group=self.pp_group)
        norm = sq.sqrt()
        clip_to_norm_(params, norm, max_norm)
        return norm

    @torch.no_grad()
    def evaluate(self, batches) -> dict:
        """``evaluate_lm``'s metrics (the mean loss per scored token of ``batches``, a loader's
        ``eval_batches``, over dp) with the batches run stage after stage. Every rank of a pp group
        reads the same batches; the last stage's token losses reach the others."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        num_tokens = 0
        for input_ids_BS, labels_BS, valid_B in batches:
            labels_BS = score_valid_rows(labels_BS, valid_B)
            n = int((labels_BS != IGNORE_INDEX).sum())
            input_ids_BS, labels_BS = input_ids_BS.to(self.device), labels_BS.to(self.device)
            tokens = input_ids_BS if self.pm.config.document_separator is not None else None
            with autocast_context(self.device, self.dtype):
                logits = forward_only(self.pm, input_ids_BS, self.pp_group, tokens)
            if logits is not None and n:
                loss_sum += F.cross_entropy(logits.float().flatten(0, -2), labels_BS.flatten(),
                                            ignore_index=IGNORE_INDEX, reduction="sum").double()
            num_tokens += n
        dist.all_reduce(loss_sum, group=self.pp_group)  # the last stage's losses to every rank
        return lm_metrics(loss_sum, num_tokens, self.dims)

    def discard_timings(self) -> None:
        """Drop the stage timings since the last ``metrics`` (an evaluation's forwards)."""
        for chunk in self.pm.chunks:
            chunk.timer.read()

    def metrics(self, balancer=None) -> dict:
        """Per-stage timings since the last call, ``pp_time/stage<s>_forward`` and ``_backward``
        (compute seconds per step on the stage's rank) and ``pp_time/rank<r>_step`` (the whole
        schedule step of pp rank r, bubble and transfers included), plus the balancer's expert
        metrics of every stage's MoE layers in layer order. Collective over the pp group."""
        mine: dict[str, float] = {}
        steps = max(self._steps, 1)
        for chunk in self.pm.chunks:
            for key, value in chunk.timer.read().items():
                if key.startswith("comm_time/"):
                    mine[f"pp_time/{key[len('comm_time/'):]}"] = value / steps
        rank = dist.get_rank(self.pp_group)
        mine[f"pp_time/rank{rank}_step"] = self._step_seconds / steps
        self._step_seconds, self._steps = 0.0, 0
        layers = balancer.metrics() if balancer is not None else {}
        names = [name for name, _ in balancer.named_layers] if balancer is not None else []
        gathered: list = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(gathered, (mine, names, layers), group=self.pp_group)
        out: dict = {}
        for timings, _, _ in gathered:
            out.update(timings)
        out.update(merge_layer_metrics([(n, m) for _, n, m in gathered]))
        return out


def merge_layer_metrics(per_stage: list[tuple[list[str], dict]]) -> dict:
    """The balancer metrics of several stages as one model's: each stage's per-layer lists
    (``expert_share``, ``load_cv``, ...) joined in model layer order (layers named
    ``layers.<i>....``, then the multi-token modules' ``mtp.<k>....``); entries that are not
    per-layer lists are taken from the first stage that has them."""
    order: list[tuple[str, int, int, int]] = []  # ("layers" or "mtp", index, stage, position in the stage)
    for s, (names, _) in enumerate(per_stage):
        order += [(name.split(".")[0], int(name.split(".")[1]), s, j) for j, name in enumerate(names)]
    order.sort()
    out: dict = {}
    keys = dict.fromkeys(k for _, m in per_stage for k in m)
    for key in keys:
        per_layer = all(isinstance(m.get(key), list) and len(m[key]) == len(n) for n, m in per_stage if m)
        if per_layer:
            out[key] = [per_stage[s][1][key][j] for _, _, s, j in order]
        else:
            out[key] = next(m[key] for _, m in per_stage if key in m)
    return out


def embedding_group(dims: ParallelDims, pp_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The first and the last stage's rank of this rank's pipeline (Megatron's embedding group): the
    pp group itself at pp = 2. Collective over the world (every pipeline's group is created)."""
    pp = dist.get_world_size(pp_group)
    if pp == 2:
        return pp_group
    mine = None
    for ranks in dims.pp_group_ranks():
        group = dist.new_group([ranks[0], ranks[-1]])
        if dist.get_rank() in ranks:
            mine = group
    assert mine is not None, "every rank is in one pipeline"
    return mine


def build_pipeline(model, dims: ParallelDims, cfg, *, grad_accum: int, device: torch.device
                   ) -> tuple[PipelineModel, PipelineStep]:
    """This rank's stages of ``model`` parallelised as ``parallelize`` would (EP, checkpointing,
    compile, FSDP2 at ZeRO 2/3), and the step that runs them under ``parallel.pp_schedule``."""
    from moetrain.distributed.data_parallel.ddp import zero_settings
    from moetrain.distributed.pipeline.stages import build_pipeline_model, parallelize_pipeline

    p, t = cfg.parallel, cfg.train
    pm = build_pipeline_model(model, pp_rank=dims.pp_rank, pp=p.pp, virtual_stages=p.pp_virtual_stages,
                              split=p.pp_split, seq_len=cfg.data.seq_len)
    parallelize_pipeline(pm, dims, activation_checkpointing=t.activation_checkpointing,
                         activation_checkpointing_every=t.activation_checkpointing_every, compile=t.compile,
                         grad_compression=cfg.dp.grad_compression, **zero_settings(cfg))
    step = PipelineStep(pm, dims, schedule=p.pp_schedule, num_microbatches=grad_accum, device=device,
                        dtype=t.dtype)
    return pm, step


def next_step_batch(loader, grad_accum: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's ``grad_accum`` loader micro-batches stacked into one ``[M * B, S]`` batch, which the
    schedule cuts back into the same micro-batches."""
    batches = [loader.next_batch() for _ in range(grad_accum)]
    input_ids_BS, labels_BS = (torch.cat([b[i] for b in batches]).to(device) for i in (0, 1))
    return input_ids_BS, labels_BS
