"""Rank function for the gradient-overlap test (``test_grad_overlap.py``): which gradient
collectives a backward issues, when, and how.

The recorder is a ``TorchDispatchMode``: every collective reaches the dispatcher as a ``c10d`` op
(``c10d::allreduce_``, ``c10d::_reduce_scatter_base_``, ...), whoever issues it: DDP's C++
reducer (its built-in fp32 bucket all-reduce), this package's comm hook and expert hooks, or
FSDP2's post-backward. The recorder notes the op, its group, its ``async_op`` flag and whether a
backward was running (``torch._C._current_graph_task_id() != -1``), then runs the op unchanged.
A tensor hook on the embedding's output marks the moment the backward reaches the embedding: the
embedding's weight gradient, the last gradient of the model, is computed after it.

The model is ``zero_parity``'s with both blocks MoE; 4 ranks at ep = 2 (dp = 4, edp = 2).
"""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from moetrain.distributed import ParallelDims, no_sync, parallelize, wrap_optimizer
from moetrain.distributed.data_parallel.finalize import finalize_grads
from moetrain.distributed.expert_parallel.apply import apply_expert_parallel
from moetrain.train.optim import build_optimizer
from moetrain.utils.tensors import local_tensor
from tests.distributed.workers.zero_parity import GLOBAL_BATCH, Run, build, make_batches, model_configs

EMBEDDING_GRAD = "embedding_grad"
"""The event that marks the backward reaching the embedding (its weight gradient comes next)."""

BUCKET_CAP_MB = 0.01
"""About 2,600 fp32 elements per DDP bucket: the dense parameters (~40,000) fill several."""

_REDUCTIONS = {
    torch.ops.c10d.allreduce_.default: "all_reduce",
    torch.ops.c10d.allreduce_coalesced_.default: "all_reduce",
    torch.ops.c10d._reduce_scatter_base_.default: "reduce_scatter",
    torch.ops.c10d.reduce_scatter_.default: "reduce_scatter",
    torch.ops.c10d.reduce_scatter_tensor_coalesced_.default: "reduce_scatter",
}


def _group_name(group) -> str:
    """The name of a collective's group, boxed (a TorchScript object) as the dispatcher passes it."""
    return (dist.ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else group).group_name


class CollectiveRecorder(TorchDispatchMode):
    """Appends one event per reduction collective to ``events``, then runs it unchanged."""

    def __init__(self, events: list[dict], group_names: dict[str, str]) -> None:
        super().__init__()
        self.events = events
        self.group_names = group_names  # c10d group name -> "dp" / "edp"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _REDUCTIONS:
            schema = func._schema.arguments
            bound = {a.name: a.default_value for a in schema}
            bound.update({a.name: v for a, v in zip(schema, args, strict=False)}, **kwargs)
            self.events.append({"op": _REDUCTIONS[func],
                                "group": self.group_names.get(_group_name(bound["process_group"]), "other"),
                                "async": bool(bound["async_op"]),
                                "in_backward": torch._C._current_graph_task_id() != -1})
        return func(*args, **kwargs)


def _record(rank: int, world_size: int, stage: int, mode: str, steps: int) -> dict:
    """``steps`` training steps of the tiny model at ``stage`` with ``mode``; the events of the
    last backward, the number of expert parameters and edp."""
    run = Run("overlap", zero_stage=stage, ep=2, model={"moe_every": 1})
    dims = ParallelDims(world_size=world_size, ep=run.ep, num_experts=model_configs(run)[1].num_experts)
    dims.build_mesh("cpu")
    model = build(run)
    train_model = parallelize(model, dims, zero_stage=stage, grad_compression=mode, bucket_cap_mb=BUCKET_CAP_MB)
    opt = wrap_optimizer(build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8),
                         dims, zero_stage=stage)
    events: list[dict] = []

    def mark_embedding_grad(_module, _inputs, h_BSD: torch.Tensor) -> None:
        h_BSD.register_hook(lambda _grad: events.append({"op": EMBEDDING_GRAD}))

    model.tok_embeddings.register_forward_hook(mark_embedding_grad)
    groups = {dims.group("dp").group_name: "dp", dims.group("edp").group_name: "edp"}
    B = GLOBAL_BATCH // world_size
    batches = make_batches(run, steps)
    for s in range(steps):
        tokens = batches[s][rank * B:(rank + 1) * B]
        output = train_model(tokens[:, :-1], tokens[:, 1:])
        events.clear()
        with CollectiveRecorder(events, groups):
            output.total_loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    num_expert_params = sum(1 for n, _ in model.named_parameters() if ".experts." in n)
    return {"events": events, "num_expert_params": num_expert_params, "edp": dims.edp}


def overlap_worker(rank: int, world_size: int, cases: list[tuple[int, str]], *, steps: int = 2) -> dict:
    """``_record`` for each ``(zero_stage, grad_compression)`` of ``cases``. Two steps by default:
    DDP rebuilds its buckets in gradient order after the first backward, so only later backwards
    show its real buckets."""
    out = {}
    for stage, mode in cases:
        out[(stage, mode)] = _record(rank, world_size, stage, mode, steps)
        gc.collect()  # DDP wrappers go before the process group does: gloo aborts at exit otherwise
        dist.barrier()
    return out


def bf16_expert_worker(rank: int, world_size: int) -> dict:
    """Stage 0, "bf16", ep = 2: this rank's local expert gradients (a ``no_sync`` backward), then
    the reduced ones of a synced backward on the same batch, and the ranks of its edp group."""
    run = Run("bf16", zero_stage=0, ep=2, model={"moe_every": 1})
    dims = ParallelDims(world_size=world_size, ep=run.ep, num_experts=model_configs(run)[1].num_experts)
    dims.build_mesh("cpu")
    model = build(run)
    train_model = parallelize(model, dims, zero_stage=0, grad_compression="bf16", bucket_cap_mb=BUCKET_CAP_MB)
    B = GLOBAL_BATCH // world_size
    tokens = make_batches(run, 1)[0][rank * B:(rank + 1) * B]
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n}
    out = {"edp_ranks": dist.get_process_group_ranks(dims.group("edp"))}
    for key, ctx in (("local", no_sync(train_model)), ("reduced", contextlib.nullcontext())):
        with ctx:
            train_model(tokens[:, :-1], tokens[:, 1:]).total_loss.backward()
        out[key] = {n: p.grad.to_local().clone() for n, p in experts.items()}
        model.zero_grad(set_to_none=True)
    del model, train_model
    gc.collect()
    dist.barrier()
    return out


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: local_tensor(p.grad).clone() for n, p in model.named_parameters()}


def finalize_worker(rank: int, world_size: int) -> dict:
    """Stage 0, fp32, ep = 2: the gradients of one synced backward reduced by ``MoEDataParallel``'s
    hooks, the same after ``finalize_grads`` on that wrapper, and those of the same backward on the
    bare model (expert parallelism only, nothing reduced) before and after ``finalize_grads``."""
    run = Run("finalize", zero_stage=0, ep=2, model={"moe_every": 1})
    dims = ParallelDims(world_size=world_size, ep=run.ep, num_experts=model_configs(run)[1].num_experts)
    dims.build_mesh("cpu")
    B = GLOBAL_BATCH // world_size
    tokens = make_batches(run, 1)[0][rank * B:(rank + 1) * B]
    model = build(run)
    wrapper = parallelize(model, dims, zero_stage=0)
    wrapper(tokens[:, :-1], tokens[:, 1:]).total_loss.backward()
    out = {"hooks": _grads(model)}
    finalize_grads(wrapper, dims)
    out["hooks_then_finalize"] = _grads(model)
    bare = apply_expert_parallel(build(run), dims)
    bare(tokens[:, :-1], tokens[:, 1:]).total_loss.backward()
    out["local"] = _grads(bare)
    finalize_grads(bare, dims)
    out["finalize"] = _grads(bare)
    out["experts"] = [n for n, _ in model.named_parameters() if ".experts." in n]
    del model, wrapper, bare
    gc.collect()
    dist.barrier()
    return out
