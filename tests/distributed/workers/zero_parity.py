"""ZeRO parity harness: the Transformer trained for a few AdamW steps on N gloo ranks at a ZeRO
stage and expert-parallel degree, against one plain process on the same global batch.

The reference (``run_reference``) is the single-device model with no process group: the
training loop of ``moetrain.train.trainer`` written out plainly (loss + aux, backward, global
norm clip, AdamW step). The ranks (``zero_worker``) build the same model from the same seed,
``parallelize`` it at the stage, wrap the optimizer (``wrap_optimizer``) and train on their
slices of each global batch: rank r owns sequences r*B:(r+1)*B, micro-batch m of the reference
is every rank's m-th micro-batch. Compared: the loss of every step (mean of the per-rank
losses), the global gradient norm, and every parameter after the last step.

Shape legend: B sequences per rank, S sequence length, W ranks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.distributed import ParallelDims, clip_global_grad_norm_, no_sync, parallelize, wrap_optimizer
from moetrain.models.transformer import Transformer
from moetrain.train.optim import build_optimizer
from moetrain.train.precision import DynamicLossScaler, autocast_context

GLOBAL_BATCH = 8
"""Sequences per step over all ranks: 4 per rank at W=2, 2 at W=4, one reference for both."""


@dataclass
class Run:
    name: str
    zero_stage: int
    ep: int = 1
    steps: int = 10
    micro_batches: int = 1
    ac: str = "none"
    dtype: str = "fp32"
    offload_params: bool = False
    offload_optimizer: bool = False
    hsdp_replicate: int = 1
    grad_clip: float = 1.0
    seq_len: int = 16
    model: dict = field(default_factory=dict)
    moe: dict = field(default_factory=dict)


def model_configs(run: Run) -> tuple[ModelConfig, MoEConfig]:
    """Two blocks, the first MoE and the second dense, with a tied embedding/head: every kind of
    FSDP unit (experts, MoE block, dense block, root with a shared parameter)."""
    model = ModelConfig(**{"vocab_size": 64, "dim": 32, "num_layers": 2, "num_heads": 2, "max_seq_len": 16,
                           "moe_every": 2, "tie_embeddings": True, **run.model})
    moe = MoEConfig(**{"num_experts": 4, "top_k": 2, "expert_hidden_dim": 32, **run.moe})
    return model, moe


def make_batches(run: Run, steps: int) -> torch.Tensor:
    """Token ids ``[steps, GLOBAL_BATCH, S + 1]`` (inputs are [:, :, :-1], labels [:, :, 1:]):
    counting sequences from random starts (next = previous + 1 mod 64), with one random token in
    four, so the loss falls fast and a wrong update shows in the loss curve, not only in the
    weights."""
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, 64, (steps, GLOBAL_BATCH, 1), generator=g)
    tokens = (start + torch.arange(run.seq_len + 1)) % 64
    noise = torch.randint(0, 64, tokens.shape, generator=g)
    return torch.where(torch.rand(tokens.shape, generator=g) < 0.25, noise, tokens)


def build(run: Run) -> Transformer:
    model_cfg, moe_cfg = model_configs(run)
    return Transformer(model_cfg, moe=moe_cfg, seed=7)


def _optimizer(model):
    return build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def _step(train_model, optimizer, params, rows_per_micro: list[torch.Tensor], run: Run, scaler) -> tuple[float, float]:
    """One optimizer step as the trainer takes it; returns (this process's loss, grad norm)."""
    n = len(rows_per_micro)
    loss_sum = 0.0
    for m, tokens in enumerate(rows_per_micro):
        ctx = no_sync(train_model) if m < n - 1 else contextlib.nullcontext()
        with ctx:
            with autocast_context(torch.device("cpu"), run.dtype):
                out = train_model(tokens[:, :-1], tokens[:, 1:])
            scaler.scale_loss(out.total_loss / n).backward()
        loss_sum += out.loss.item() / n
    finite = scaler.unscale_and_check(params)
    norm = clip_global_grad_norm_(params, run.grad_clip)
    if finite:
        optimizer.step()
    scaler.update(finite)
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, norm.item()


def _train(run: Run, model, train_model, opt, rows, mean_loss=float) -> tuple[list[float], list[float]]:
    """``run.steps`` steps of ``train_model``: step s trains on micro-batch m of ``rows(batch s)``,
    ``[m::micro_batches]``; returns the losses (through ``mean_loss``) and grad norms per step."""
    params = [p for p in model.parameters()]
    scaler = DynamicLossScaler(enabled=run.dtype == "fp16")
    batches = make_batches(run, run.steps)
    n = run.micro_batches
    losses, norms = [], []
    for s in range(run.steps):
        mine = rows(batches[s])
        loss, norm = _step(train_model, opt, params, [mine[m::n] for m in range(n)], run, scaler)
        losses.append(mean_loss(loss))
        norms.append(norm)
    return losses, norms


def run_reference(run: Run) -> dict:
    """One plain process on the global batch."""
    model = build(run)
    # Micro-batch m of the global batch = every rank's m-th micro-batch, in rank order; the
    # reference only needs the same set of sequences per micro-batch (the loss is a mean).
    losses, norms = _train(run, model, model, _optimizer(model), rows=lambda batch: batch)
    return {"loss": losses, "grad_norm": norms, "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def setup_run(run: Run, world_size: int):
    """(dims, plain model, parallelised model, wrapped optimizer) of ``run`` on this rank."""
    dims = ParallelDims(world_size=world_size, ep=run.ep, num_experts=model_configs(run)[1].num_experts)
    dims.build_mesh("cpu")
    model = build(run)
    train_model = parallelize(model, dims, activation_checkpointing=run.ac, zero_stage=run.zero_stage,
                              mixed_precision=run.dtype, offload_params=run.offload_params,
                              offload_optimizer=run.offload_optimizer, hsdp_replicate=run.hsdp_replicate)
    opt = wrap_optimizer(_optimizer(model), dims, zero_stage=run.zero_stage, offload_optimizer=run.offload_optimizer)
    return dims, model, train_model, opt


def memory_worker(rank: int, world_size: int, runs: list[Run]) -> dict:
    """For each run: two warm-up steps (DDP rebuilds its gradient buckets in the second), then
    one step under ``MemoryTracker``, holding the model output through backward as the trainer
    does; returns the tracker's peaks and the exact model-state bytes right after the step
    (gradients and optimizer states both present)."""
    from moetrain.utils.memory import MemoryTracker, model_state_bytes

    out = {}
    B = GLOBAL_BATCH // world_size
    for run in runs:
        _, model, train_model, opt = setup_run(run, world_size)
        batches = make_batches(run, 3)
        for s in range(3):
            tokens = batches[s][rank * B:(rank + 1) * B]
            tracker = MemoryTracker(train_model, opt) if s == 2 else contextlib.nullcontext()
            with tracker:
                output = train_model(tokens[:, :-1], tokens[:, 1:])
                output.total_loss.backward()
                del output  # the trainer's forward_backward returns before the optimizer step
                opt.step()
            if s < 2:
                opt.zero_grad(set_to_none=True)
        out[run.name] = {"states": model_state_bytes(model, opt), "peaks": tracker.report()}
        del model, train_model, opt
    return out


def _full(p: torch.Tensor) -> torch.Tensor:
    """The global tensor of a (possibly sharded) parameter; collective for DTensors."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _mean_over_ranks(loss: float, world_size: int) -> float:
    t = torch.tensor([loss])
    dist.all_reduce(t)
    return t.item() / world_size


def zero_worker(rank: int, world_size: int, runs: list[Run], probe=None) -> dict:
    """Runs on every rank: train each run, return losses and norms (every rank) and the full
    parameters (rank 0). ``probe(run, model, optimizer, dims)``, if given, runs after the last
    step and its result is returned under "probe"."""
    out = {}
    B = GLOBAL_BATCH // world_size
    for run in runs:
        dims, model, train_model, opt = setup_run(run, world_size)
        losses, norms = _train(run, model, train_model, opt, rows=lambda batch: batch[rank * B:(rank + 1) * B],
                               mean_loss=lambda loss: _mean_over_ranks(loss, world_size))
        full = {k: _full(v).detach().clone() for k, v in model.named_parameters()}
        res = {"loss": losses, "grad_norm": norms, "params": full if rank == 0 else None}
        if probe is not None:
            res["probe"] = probe(run, model, opt, dims)
        out[run.name] = res
        del model, train_model, opt
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def assert_matches(run: Run, ranks: list[dict], ref: dict, *, rtol: float, param_rtol: float | None = None) -> None:
    """Losses and grad norms of every step on every rank within ``rtol``, and all final
    parameters within ``param_rtol`` (norm-wise relative error; default ``rtol``). Parameters get
    their own bound because AdamW's first steps divide by sqrt(v): a gradient entry near zero
    turns its rounding difference into an update of order lr, the same at every stage (stage 0
    included) and for any summation order."""
    param_rtol = rtol if param_rtol is None else param_rtol
    for r, res in enumerate(ranks):
        got = res[run.name]
        for s, (a, b) in enumerate(zip(got["loss"], ref["loss"], strict=True)):
            assert abs(a - b) <= rtol * abs(b), f"[{run.name}] rank {r} step {s} loss {a!r} != {b!r}"
        for s, (a, b) in enumerate(zip(got["grad_norm"], ref["grad_norm"], strict=True)):
            assert abs(a - b) <= rtol * abs(b) + 1e-12, f"[{run.name}] rank {r} step {s} grad norm {a!r} != {b!r}"
    params = ranks[0][run.name]["params"]
    assert set(params) == set(ref["params"]), f"[{run.name}] parameter names differ"
    for name, exp in ref["params"].items():
        err = rel_err(params[name], exp)
        assert err <= param_rtol, f"[{run.name}] parameter {name}: relative error {err:.2e} > {param_rtol:g}"
