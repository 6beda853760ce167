"""Pipeline-parallel parity harness: ranks under parallel.pp = 2 (with dp, ep, ZeRO-2) against one
plain process training the same model on the same global batch with the same micro-batches.

The reference (``run_reference``) is a single ``Transformer``: per step, M micro-steps over the
global micro-batches (the dp ranks' micro-batch m concatenated in dp order), each backward of
``(loss + aux_loss) / M``, then clipping and AdamW. The ranks (``pp_worker``) cut the same model
into stages, run the schedule over their dp slice and return, per step, the loss and aux sums,
the gradient norm and every gradient of their stages as full tensors, and the parameters after
the last step.

Shape legend: M micro-batches, B micro-batch size, S sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.distributed.data_parallel.ddp import wrap_optimizer
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.distributed.parallelize import collect_comm_times, enable_comm_timing
from moetrain.distributed.pipeline.stages import build_pipeline_model, parallelize_pipeline
from moetrain.models.moe import MoELayer
from moetrain.models.transformer import Transformer
from moetrain.train.balancing import install_balancing
from moetrain.train.pipeline_step import PipelineStep

VOCAB, SEQ = 64, 8


@dataclass
class PPCase:
    name: str
    pp: int = 2
    ep: int = 1
    tp: int = 1
    etp: int = 1
    zero_stage: int = 0
    schedule: str = "1f1b"
    virtual_stages: int = 1
    num_layers: int = 4
    micro_batches: int = 2
    micro_batch_size: int = 2
    steps: int = 3
    moe: dict = field(default_factory=dict)
    max_grad_norm: float = 0.0
    empty_experts_from_layer: int | None = None
    """Blocks from this index on route every token to experts 0 and 1 (a selection bias): with
    ep = 2 the experts of the second ep rank receive nothing."""
    split: str = "layers"
    activation_checkpointing: str = "none"
    """``parallelize_pipeline``'s ``activation_checkpointing`` ("none", "full", ...)."""
    balancing: bool = False
    """Install the between-step balancing (``install_balancing``) on the optimizer, and record
    every MoE layer's selection bias after every step."""
    prev_step_routed: tuple[int, ...] | None = None
    """With ``moe.aux_loss_type="global_batch"``: the routed counts preset in every MoE layer's
    ``prev_step_routed_E`` (the first step's f_e, instead of the uniform one that gives no gradient)."""
    model: dict = field(default_factory=dict)
    """Extra ``ModelConfig`` fields (``mtp_depth``, ``tie_embeddings``, ...)."""
    meta: bool = False
    """Build the ranks' model on the meta device (the kept stages initialised by name)."""
    save_to: str = ""
    """Save a checkpoint (model and optimizer) into this folder before the last step."""
    comm_timing: bool = False
    """Time the collectives as log.comm_timing does (``enable_comm_timing``); the counts are returned."""

    def configs(self) -> tuple[ModelConfig, MoEConfig]:
        moe = {"num_experts": 4, "top_k": 2, "expert_hidden_dim": 16, "aux_loss_coef": 0.1, "z_loss_coef": 0.01,
               **self.moe}
        if self.empty_experts_from_layer is not None:
            moe["expert_bias"] = True
        return (ModelConfig(vocab_size=VOCAB, dim=16, num_layers=self.num_layers, num_heads=2, max_seq_len=SEQ,
                            **self.model), MoEConfig(**moe))


def build_model(case: PPCase, *, meta: bool = False) -> Transformer:
    cfg, moe = case.configs()
    if meta:
        with torch.device("meta"):
            model = Transformer(cfg, moe=moe, seed=0)
    else:
        model = Transformer(cfg, moe=moe, seed=0)
    if case.empty_experts_from_layer is not None and not meta:
        with torch.no_grad():
            for layer in list(model.layers)[case.empty_experts_from_layer:]:
                layer.feed_forward.router.expert_bias.copy_(torch.tensor([100.0, 100.0, -100.0, -100.0]))
    if case.prev_step_routed is not None and not meta:
        for m in model.modules():
            if isinstance(m, MoELayer):
                m.prev_step_routed_E.copy_(torch.tensor(case.prev_step_routed))
    return model


def make_batches(case: PPCase, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, ``[dp, M * B, S]`` token ids and labels (dp slice d, micro-batch m = rows m*B..)."""
    g = torch.Generator().manual_seed(1234)
    shape = (case.steps, dp, case.micro_batches * case.micro_batch_size, SEQ + 1)
    tokens = torch.randint(0, VOCAB, shape, generator=g)
    return [(tokens[s, ..., :-1], tokens[s, ..., 1:]) for s in range(case.steps)]


def _expert_bias(module) -> dict[str, torch.Tensor]:
    return {name: m.router.expert_bias.clone() for name, m in module.named_modules()
            if isinstance(m, MoELayer) and m.router.expert_bias is not None}


def run_reference(case: PPCase, dp: int) -> dict:
    model = build_model(case)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if case.balancing:
        install_balancing(opt, model)
    M, B = case.micro_batches, case.micro_batch_size
    out = {"loss": [], "aux": [], "mtp": [], "norm": [], "grads": [], "expert_bias": [], "dropped": 0}
    for ids_DXS, labels_DXS in make_batches(case, dp):
        loss_sum = aux_sum = 0.0
        mtp_sum = torch.zeros(model.config.mtp_depth, dtype=torch.float64)
        for m in range(M):
            ids = ids_DXS[:, m * B:(m + 1) * B].reshape(-1, SEQ)
            labels = labels_DXS[:, m * B:(m + 1) * B].reshape(-1, SEQ)
            o = model(ids, labels)
            (o.total_loss / M).backward()
            if o.mtp_losses is not None:
                mtp_sum += o.mtp_losses.detach().double()
            loss_sum += o.loss.item()
            out["dropped"] += sum(int(a.num_dropped) for a in o.moe_aux)
            aux_sum += o.aux_loss.item()
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), case.max_grad_norm or float("inf"))
        out["loss"].append(loss_sum)
        out["aux"].append(aux_sum)
        out["mtp"].append(mtp_sum.tolist())
        out["norm"].append(float(norm))
        opt.step()
        opt.zero_grad()
        out["expert_bias"].append(_expert_bias(model))
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _layout(t: torch.Tensor) -> tuple:
    """Placements and local shape (a plain tensor: its shape)."""
    local = getattr(t, "_local_tensor", t)
    return tuple(getattr(t, "placements", ())), tuple(local.shape)


def pp_worker(rank: int, world: int, case: PPCase, *, meta: bool = False) -> dict:
    """One rank of ``case``; a ``dims``-less pp-only world when ``world == case.pp``."""
    dims = ParallelDims(world_size=world, ep=case.ep, pp=case.pp, tp=case.tp, etp=case.etp)
    dims.build_mesh("cpu")
    meta = meta or case.meta
    pm = build_pipeline_model(build_model(case, meta=meta), pp_rank=dims.pp_rank, pp=case.pp,
                              virtual_stages=case.virtual_stages, split=case.split, seq_len=SEQ,
                              device=torch.device("cpu"), seed=0)
    if meta and case.empty_experts_from_layer is not None:
        raise ValueError("the empty-experts bias is set on a materialised model")
    parallelize_pipeline(pm, dims, zero_stage=case.zero_stage, activation_checkpointing=case.activation_checkpointing)
    step = PipelineStep(pm, dims, schedule=case.schedule, num_microbatches=case.micro_batches,
                        device=torch.device("cpu"))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    if case.zero_stage == 1:
        opt = wrap_optimizer(opt, dims, zero_stage=1)
    if case.balancing:
        install_balancing(opt, pm, dims)
    if case.comm_timing:
        enable_comm_timing(pm, pm, opt, torch.device("cpu"))
    out = {"loss": [], "aux": [], "mtp": [], "norm": [], "grads": [], "stage_ids": pm.stage_ids,
           "dp_rank": dims.dp_rank, "expert_bias": []}
    for i, (ids_DXS, labels_DXS) in enumerate(make_batches(case, dims.dp)):
        if case.save_to and i == case.steps - 1:
            from moetrain.train.checkpoint.state import save_checkpoint

            save_checkpoint(case.save_to, i, model=pm, optimizer=opt, trainer_state={"step": i})
        loss, aux = step.forward_backward(ids_DXS[dims.dp_rank], labels_DXS[dims.dp_rank])
        out["grad_layouts_match"] = out.get("grad_layouts_match", True) and all(
            _layout(p.grad) == _layout(p) for p in pm.parameters() if p.grad is not None)
        # Full gradients (collective over each DTensor's mesh, same order on every rank of a stage).
        out["grads"].append({n: _full(p.grad).clone() for n, p in pm.named_parameters() if p.grad is not None})
        norm = step.clip_grad_norm_(list(pm.parameters()), case.max_grad_norm)
        out["loss"].append(float(loss))
        out["aux"].append(float(aux))
        out["mtp"].append(step.mtp_sums.tolist())
        out["norm"].append(float(norm))
        opt.step()
        opt.zero_grad()
        out["expert_bias"].append(_expert_bias(pm))
    out["params"] = {n: _full(p.detach()).clone() for n, p in pm.named_parameters()}
    out["metrics"] = step.metrics()
    if case.comm_timing:
        out["comm_times"] = collect_comm_times(pm, pm, opt)
    if case.tp > 1 and pm.chunks[0].is_first:
        try:  # refused before the stage's first collective, so it cannot hang the other ranks
            pm.chunks[0](torch.zeros(1, SEQ - 1, dtype=torch.long))
        except ValueError as e:
            out["odd_length_error"] = str(e)
    dist.barrier()
    return out


def run_cases(rank: int, world: int, cases: list[PPCase]) -> dict:
    """Several cases in one launch (each builds its own mesh)."""
    return {c.name: pp_worker(rank, world, c) for c in cases}
