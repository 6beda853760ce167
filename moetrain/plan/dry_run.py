"""Dry run at the real world size (``moetrain plan --dry-run``): one rank of an N-process job built
for real, with nothing allocated, and its model-state bytes counted from the tensors it holds.

    moetrain plan --config deepseek-v3 --nproc 1024 --dry-run [--rank R]

What runs is the trainer's own setup for one rank ``R`` of ``N``, in the trainer's order:

1. a fake process group of world N (torch's ``FakeStore`` and backend "fake": every collective
   returns at once, nothing leaves the process), and ``ParallelDims`` builds its mesh on it;
2. the model, built on the meta device (shapes, no storage), with its LoRA adapters (``apply_lora``);
3. ``parallelize``: expert parallelism (dispatchers, experts sharded over ep, and with
   ``parallel.etp`` their hidden dim over etp), checkpointing,
   compile, then DDP (ZeRO 0/1) or the FSDP2 units (ZeRO 2/3), with the job's settings;
4. the optimizer, ``build_optimizer`` + ``wrap_optimizer`` (ZeRO-1: ``ZeroShardedOptimizer``),
   stepped once on placeholder meta gradients, so AdamW creates its states itself;
5. the weight average (optim.ema_decay) and the ``Rebalancer`` (its replica banks, with
   parallel.expert_slots_per_rank and moe.rebalance_every > 0).

Then the bytes are read off what was built: parameters from the storage behind each local shard
(FSDP2's padded shard storage included), optimizer states from the optimizer's ``state``, and
gradients from the buffers the data-parallel wrapper reduces into (there is no backward):

* DDP (stages 0/1): its reducer's flat buckets, which hold every replicated gradient
  (``gradient_as_bucket_view``), plus one local-shard-sized gradient per expert weight (DDP
  ignores those; autograd accumulates them).
* FSDP2 (stages 2/3): the reduce-scatter leaves each sharded gradient as a view into one output
  buffer per unit, a padded shard per parameter, in the parameters' dtype (torch's
  ``foreach_reduce``); so each trainable parameter's gradient costs its padded shard.

The replica banks count their weights, and as much again for the gradient of each trainable one;
1-bit Adam's residuals (dp.grad_compression "onebit") are the flat buffers its reducers allocate.

The process group is process-wide: ``dry_run`` refuses to run where one exists, and
``dry_run_isolated`` runs it in a fresh interpreter then. Offloaded states are out of scope: a
meta tensor cannot be copied to the host.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from moetrain.config.job import JobConfig
from moetrain.plan.model_states import (
    Layout,
    StateBytes,
    buffer_bytes,
    param_specs,
    rank_state_bytes,
    state_bytes_per_rank,
)
from moetrain.plan.planner import resolve_vocab


@dataclass
class DryRun:
    """One rank's model states, counted from the tensors the real parallelisation built, next to
    the planner's numbers for the same rank."""

    world: int
    rank: int
    rank_note: str
    """How ``rank`` was chosen (given, or the largest-memory rank and why)."""
    ep: int
    zero_stage: int
    hsdp_replicate: int
    dtype: str
    measured: StateBytes
    planned: StateBytes
    measured_buffer_bytes: int
    """Buffers (rotary tables, routing counters, the selection bias): never sharded."""
    planned_buffer_bytes: int
    num_param_tensors: int
    param_devices: list[str]
    """Devices of every parameter's local tensor: ["meta"] when nothing was allocated."""
    build_s: float
    """Seconds from the fake process group to the stepped optimizer."""
    etp: int = 1
    """parallel.etp: the experts' hidden dim split over etp ranks (1 = not split)."""

    @property
    def matches(self) -> bool:
        return self.measured == self.planned and self.measured_buffer_bytes == self.planned_buffer_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DryRun:
        return cls(**{**d, "measured": StateBytes(**d["measured"]), "planned": StateBytes(**d["planned"])})


def largest_rank(cfg: JobConfig, world: int, *, specs=None) -> tuple[int, str]:
    """The rank with the most model-state bytes (the lowest such rank on ties), and a note on how
    it was found: from the exact per-rank shard arithmetic of ``model_states`` over all ``world``
    ranks, which the tests check against dry runs of first, middle and last ranks. Ranks differ
    only in which chunk of each sharded tensor they keep: ``torch.chunk``-style shards give the
    full chunks to the first ranks and the remainder (maybe nothing) to the last."""
    specs = specs if specs is not None else param_specs(resolve_vocab(cfg), cfg.moe, finetune=cfg.finetune)
    per_rank = state_bytes_per_rank(specs, Layout.of_config(cfg, world))
    totals = [s.total for s in per_rank]
    rank = totals.index(max(totals))
    spread = f"{min(totals)}..{max(totals)} bytes over the {world} ranks" if min(totals) != max(totals) \
        else f"all {world} ranks equal"
    return rank, f"the largest-memory rank (planner's per-rank shard arithmetic: {spread})"


def _check(cfg: JobConfig, world: int, rank: int | None) -> None:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"--nproc ({world!r}) must be an int >= 1")
    if rank is not None and (not isinstance(rank, int) or not 0 <= rank < world):
        raise ValueError(f"--rank ({rank!r}) must be an int in [0, --nproc ({world}))")
    if cfg.parallel.dp not in (-1, world):
        raise ValueError(f"parallel.dp ({cfg.parallel.dp}) must be -1 or the world size ({world}) for a dry run")
    for name in ("tp", "pp"):
        if getattr(cfg.parallel, name) != 1:
            raise ValueError(f"parallel.{name} ({getattr(cfg.parallel, name)}) must be 1 for a dry run: it measures "
                             "the dp x ep (x etp) layouts of the planner's shard arithmetic (plan without --dry-run "
                             "has the tp and pp tables)")
    for name, value in (("zero.offload_optimizer", cfg.zero.offload_optimizer),
                        ("zero.offload_param", cfg.zero.offload_param)):
        if value != "none":
            raise ValueError(f"{name} ({value!r}) must be 'none' for a dry run: offloaded shards are copied to "
                             "host memory, which meta tensors cannot be (plan without --dry-run covers offload)")


@contextlib.contextmanager
def fake_process_group(*, world: int, rank: int):
    """torch's fake process group of ``world`` ranks, as rank ``rank``, for the duration."""
    import torch.distributed as dist

    # A tests-only module of torch (the one backend that emulates any world in one process), so it
    # is imported here, only when a dry run asks for it.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group (use dry_run_isolated)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _without_ddp_shape_check():
    """DDP's constructor all-gathers every rank's parameter shapes and compares them on the host:
    a meta tensor cannot be read back, and under a fake process group every "rank" is this
    process, so there is nothing to compare. Only that check is skipped (torch's module attribute,
    restored on exit); the rest is DDP's own construction (module-state broadcast, reducer, buckets)."""
    import torch.nn.parallel.distributed as ddp_module

    saved = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = saved


def dry_run(cfg: JobConfig, *, nproc: int, rank: int | None = None) -> DryRun:
    """Build rank ``rank`` (default: ``largest_rank``) of ``cfg`` on ``nproc`` processes on the
    meta device under a fake process group and count its model states (module docstring). Needs
    a process without a process group; leaves none behind."""
    _check(cfg, nproc, rank)
    model_cfg = resolve_vocab(cfg)
    specs = param_specs(model_cfg, cfg.moe, finetune=cfg.finetune)
    note = "given (--rank)"
    if rank is None:
        rank, note = largest_rank(cfg, nproc, specs=specs)
    t0 = time.perf_counter()
    with fake_process_group(world=nproc, rank=rank):
        model, wrapped, optimizer, average, rebalancer = _build(cfg, model_cfg, nproc)
        measured = StateBytes(param=_param_bytes(model), grad=_grad_bytes(model, wrapped),
                              optim=_optim_bytes(optimizer),
                              average=sum(_storage_bytes(t) for t in average.values()),
                              replica=_replica_bytes(rebalancer), residual=_residual_bytes(wrapped))
        buffers = sum(_storage_bytes(b) for b in model.buffers())
        devices = sorted({_local(p).device.type for p in model.parameters()})
        num_params = sum(1 for _ in model.parameters())
    build_s = time.perf_counter() - t0
    planned = rank_state_bytes(specs, Layout.of_config(cfg, nproc), rank)
    return DryRun(world=nproc, rank=rank, rank_note=note, ep=cfg.parallel.ep, zero_stage=cfg.parallel.zero_stage,
                  hsdp_replicate=cfg.parallel.hsdp_replicate, dtype=cfg.train.dtype, measured=measured,
                  planned=planned, measured_buffer_bytes=buffers, planned_buffer_bytes=buffer_bytes(model_cfg, cfg.moe),
                  num_param_tensors=num_params, param_devices=devices, build_s=build_s, etp=cfg.parallel.etp)


def _build(cfg: JobConfig, model_cfg, world: int):
    """The trainer's build_model + build_optimizer (weight average and rebalancer too) for this rank,
    on the meta device. Returns the model, its wrapper, the stepped optimizer, the average's tensors
    by id and the rebalancer."""
    import torch

    from moetrain.distributed.data_parallel.ddp import wrap_optimizer, zero_settings
    from moetrain.distributed.expert_parallel.rebalance import Rebalancer, rebalance_settings
    from moetrain.distributed.parallel_dims import ParallelDims
    from moetrain.distributed.parallelize import parallelize
    from moetrain.models.lora import apply_lora
    from moetrain.models.transformer import Transformer
    from moetrain.train.optim import build_optimizer, optimizer_settings
    from moetrain.train.weight_average import WeightAverage

    dims = ParallelDims.from_config(cfg.parallel, world_size=world,
                                    num_experts=cfg.moe.num_experts if model_cfg.is_moe else None)
    dims.build_mesh()  # "cpu" for the fake backend: the device type only names the mesh
    with torch.device("meta"):
        model = Transformer(model_cfg, moe=cfg.moe if model_cfg.is_moe else None, seed=cfg.train.seed)
        apply_lora(model, cfg.finetune, seed=cfg.train.seed)  # as the trainer's build_model
    t, o = cfg.train, cfg.optim
    with _without_ddp_shape_check():
        wrapped = parallelize(model, dims, activation_checkpointing=t.activation_checkpointing,
                              activation_checkpointing_every=t.activation_checkpointing_every, compile=t.compile,
                              grad_compression=cfg.dp.grad_compression, **zero_settings(cfg))
    optimizer = wrap_optimizer(build_optimizer(model, **optimizer_settings(o)),
                               dims, zero_stage=cfg.parallel.zero_stage,
                               offload_optimizer=cfg.zero.offload_optimizer == "cpu",
                               bucket_numel=cfg.zero.allgather_bucket_size)
    # One step on placeholder meta gradients: AdamW (and Muon) allocate their states lazily, in the step.
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in params:
        p.grad = None
    average = WeightAverage(model, decay=o.ema_decay).state_dict() if o.ema_decay > 0 else {}
    rebalancer = Rebalancer(model, dims, **rebalance_settings(cfg))  # replica banks, as the trainer attaches them
    return model, wrapped, optimizer, {id(t): t for t in average.values()}, rebalancer  # a tied weight once


def _local(t):
    from moetrain.utils.tensors import local_tensor

    return local_tensor(t)


def _storage_bytes(t) -> int:
    """Bytes of the storage behind ``t``'s local tensor (a padded FSDP2 shard counts its padding)."""
    return _local(t).untyped_storage().nbytes()


def _param_bytes(model) -> int:
    return sum(_storage_bytes(p) for p in model.parameters())


def _fsdp_params(model) -> list:
    """FSDP2's per-parameter records (``FSDPParam``) of every unit of ``model``: private torch
    API, the only place the padded shard sizes are kept."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                out += group.fsdp_params
    return out


def _grad_bytes(model, wrapped) -> int:
    """Gradient bytes after a backward, from the wrapper's buffers (module docstring)."""
    from torch.nn.parallel import DistributedDataParallel

    fsdp_params = _fsdp_params(model)
    if fsdp_params:
        assert len(fsdp_params) == sum(1 for _ in model.parameters()), "a parameter outside every FSDP unit"
        return sum(fp.padded_sharded_param_size.numel() * fp.sharded_param.dtype.itemsize for fp in fsdp_params
                   if fp.sharded_param.requires_grad)
    if isinstance(wrapped, DistributedDataParallel):
        buckets = sum(b.buffer().untyped_storage().nbytes() for b in wrapped.reducer._get_zeros_like_grad_buckets())
        ignored = set(wrapped.parameters_to_ignore)
        experts = sum(_local(p).numel() * p.dtype.itemsize for n, p in model.named_parameters()
                      if n in ignored and p.requires_grad)
        return buckets + experts
    # No data parallelism: autograd gives every parameter a gradient of its own (local) shape.
    return sum(_local(p).numel() * p.dtype.itemsize for p in model.parameters() if p.requires_grad)


def _replica_bytes(rebalancer) -> int:
    """The rebalancer's replica banks: each tensor's storage, twice for a trainable one (its
    gradient, the bank's shape, lives from the backward to ``sum_replica_grads``)."""
    banks = [t for _, dispatcher in rebalancer.layers for t in dispatcher.bank.values()]
    return sum(_storage_bytes(t) * (2 if t.requires_grad else 1) for t in banks)


def _residual_bytes(wrapped) -> int:
    """1-bit Adam's residuals: the flat worker and server buffers of each ``OneBitReducer`` (its
    state_dict's tensors are views of them, padding excluded; the buffers are what is allocated)."""
    from moetrain.distributed.data_parallel.ddp import MoEDataParallel

    if not isinstance(wrapped, MoEDataParallel):
        return 0
    reducers = [r for r in (wrapped._dense_reducer, wrapped._expert_reducer) if r is not None]
    flats = {id(t._base): t._base for r in reducers for t in r.state_dict().values() if t._base is not None}
    return sum(_storage_bytes(t) for t in flats.values())


def _optim_bytes(optimizer) -> int:
    import torch

    return sum(_storage_bytes(v) for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def dry_run_isolated(cfg: JobConfig, *, nproc: int, rank: int | None = None) -> DryRun:
    """``dry_run`` in this process when it has no process group, else in a fresh interpreter (the
    fake group is process-wide and would clash with the existing one)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return dry_run(cfg, nproc=nproc, rank=rank)
    from moetrain.config.loader import save_config

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        save_config(cfg, path)
        cmd = [sys.executable, "-m", "moetrain.plan.dry_run", str(path), str(nproc)]
        cmd += [] if rank is None else [str(rank)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return DryRun.from_dict(json.loads(out.stdout.strip().splitlines()[-1]))


def format_dry_run(d: DryRun, *, name: str | None = None) -> str:
    gib = 2**30
    stage = f"ZeRO-{d.zero_stage}" + (f", HSDP {d.hsdp_replicate} replicas" if d.hsdp_replicate > 1 else "")
    etp, edp = (f" x etp {d.etp}" if d.etp > 1 else ""), d.world // (d.ep * d.etp)
    lines = [(f"dry run{' of ' + name if name else ''}: world {d.world} = ep {d.ep}{etp} x edp {edp}, {stage}, "
             f"{d.dtype}; rank {d.rank}: {d.rank_note}"),
             (f"built in {d.build_s:.2f} s on the meta device under a fake process group; {d.num_param_tensors} "
             f"parameter tensors on {', '.join(d.param_devices)} (nothing allocated)"),
             f"{'':10s} {'dry run (bytes)':>18s} {'planner (bytes)':>18s} {'dry run GiB':>12s} {'diff':>8s}"]
    rows = [("param", d.measured.param, d.planned.param), ("grad", d.measured.grad, d.planned.grad),
            ("optim", d.measured.optim, d.planned.optim),
            *[(label, m, p) for label, m, p in (("average", d.measured.average, d.planned.average),
                                                 ("replicas", d.measured.replica, d.planned.replica),
                                                 ("1-bit res", d.measured.residual, d.planned.residual)) if m or p],
            ("total", d.measured.total, d.planned.total),
            ("buffers", d.measured_buffer_bytes, d.planned_buffer_bytes)]
    for label, m, p in rows:
        lines.append(f"{label:10s} {m:18d} {p:18d} {m / gib:12.3f} {m - p:8d}")
    lines.append("model states match the planner exactly" if d.matches else "MISMATCH between dry run and planner")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``python -m moetrain.plan.dry_run CONFIG.yaml NPROC [RANK]``: one dry run, as a JSON line
    (what ``dry_run_isolated`` starts)."""
    from moetrain.config.loader import load_config

    cfg = load_config(argv[0])
    result = dry_run(cfg, nproc=int(argv[1]), rank=int(argv[2]) if len(argv) > 2 else None)
    print(json.dumps(result.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
