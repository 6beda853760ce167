"""Rank functions for the gradient-compression tests (``test_grad_compression.py``).

The tiny model is ``zero_parity``'s (two blocks, the first MoE with 4 experts); it is wrapped the
way ``parallelize`` does at stage 0, with ``grad_compression`` passed to ``apply_data_parallel``;
"onebit" trains with ``build_optimizer``'s 1-bit Adam, as the trainer does.
"""

from __future__ import annotations

import gc
import logging

import torch
import torch.distributed as dist

from moetrain.distributed import ParallelDims, no_sync
from moetrain.distributed.data_parallel.compression import OneBitReducer
from moetrain.distributed.data_parallel.ddp import (
    apply_data_parallel,
    grad_comm_metrics,
    grad_compression_state,
    load_grad_compression_state,
)
from moetrain.distributed.expert_parallel.apply import apply_expert_parallel
from moetrain.train.checkpoint.state import load_checkpoint, save_checkpoint
from moetrain.train.optim import build_optimizer
from tests.distributed.workers.zero_parity import GLOBAL_BATCH, Run, build, make_batches, model_configs


def _release(*objs) -> None:
    """Drop DDP wrappers before the process group goes: gloo aborts at exit otherwise."""
    del objs
    gc.collect()
    dist.barrier()


def reducer_worker(rank: int, world_size: int, grads: list[list[list[torch.Tensor]]]) -> dict:
    """``OneBitReducer`` over the world on known gradients ``grads[step][rank][tensor]``: the
    results, the residuals and the bytes after every step."""
    shapes = {f"t{i}": g.numel() for i, g in enumerate(grads[0][rank])}
    reducer = OneBitReducer(None, shapes)
    out = []
    for step in grads:
        tensors = [g.clone() for g in step[rank]]
        num_bytes = reducer.all_reduce_sum(tensors, list(shapes))
        out.append({"result": tensors, "bytes": num_bytes,
                    "worker": {k: v.clone() for k, v in reducer.worker.items()},
                    "server": {k: v.clone() for k, v in reducer.server.items()}})
    return out


def _wrapped(world_size: int, *, ep: int, mode: str):
    run = Run("gc", zero_stage=0, ep=ep)
    dims = ParallelDims(world_size=world_size, ep=ep, num_experts=model_configs(run)[1].num_experts)
    dims.build_mesh("cpu")
    model = build(run)
    apply_expert_parallel(model, dims)
    return run, dims, model, apply_data_parallel(model, dims, grad_compression=mode)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad


def grads_worker(rank: int, world_size: int, mode: str, ep: int) -> dict:
    """One backward of the tiny model per mode ("none" and ``mode``) on this rank's batch: the
    reduced gradients, every rank's local (unreduced) gradients, and the byte counters; for
    "onebit" also the gradients of a backward in local-gradient mode (its compression stage)."""
    out = {}
    B = GLOBAL_BATCH // world_size
    for m in ("none", mode):
        run, dims, model, ddp = _wrapped(world_size, ep=ep, mode=m)
        tokens = make_batches(run, 1)[0][rank * B:(rank + 1) * B]
        with no_sync(ddp):
            ddp(tokens[:, :-1], tokens[:, 1:]).total_loss.backward()
        local = {n: _local(p).clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        ddp(tokens[:, :-1], tokens[:, 1:]).total_loss.backward()
        out[m] = {"grads": {n: _local(p).clone() for n, p in model.named_parameters()}, "local": local,
                  "stats": grad_comm_metrics(ddp), "numel": {n: _local(p).numel() for n, p in model.named_parameters()},
                  "dp": dims.dp, "edp": dims.edp}
        if m == "onebit":
            model.zero_grad(set_to_none=True)
            ddp.set_local_gradients(True)
            ddp(tokens[:, :-1], tokens[:, 1:]).total_loss.backward()
            out[m]["local_mode"] = {n: _local(p).clone() for n, p in model.named_parameters()}
            out[m]["local_mode_stats"] = grad_comm_metrics(ddp)
        _release(ddp, model)
    return out


def _train(ddp, model, opt, run: Run, rank: int, world_size: int, steps: range, num_steps: int) -> list[float]:
    B = GLOBAL_BATCH // world_size
    batches = make_batches(run, num_steps)  # the same batches whatever part of the run this is
    losses = []
    for s in steps:
        tokens = batches[s][rank * B:(rank + 1) * B]
        out = ddp(tokens[:, :-1], tokens[:, 1:])
        out.total_loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world_size)
    return losses


def _optimizer(model, ddp):
    return build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, data_parallel=ddp,
                           onebit_warmup_steps=2)


def resume_worker(rank: int, world_size: int, folder: str, *, steps: int = 6, stop: int = 3) -> dict:
    """onebit at ep=1 (1-bit Adam, 2 warmup steps): ``steps`` uninterrupted; then ``stop`` steps, a
    checkpoint, a fresh model that loads it and trains on; then a load of the same checkpoint at
    ep=2 (another layout)."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("moetrain").addHandler(handler)
    run, _, model, ddp = _wrapped(world_size, ep=1, mode="onebit")
    opt = _optimizer(model, ddp)
    straight = _train(ddp, model, opt, run, rank, world_size, range(steps), steps)
    _release(ddp, model, opt)

    run, _, model, ddp = _wrapped(world_size, ep=1, mode="onebit")
    opt = _optimizer(model, ddp)
    first = _train(ddp, model, opt, run, rank, world_size, range(stop), steps)
    saved = grad_compression_state(ddp)
    path = save_checkpoint(folder, stop, model=model, optimizer=opt, trainer_state={"step": stop},
                           grad_compression_state=saved)
    _release(ddp, model, opt)

    run, _, model, ddp = _wrapped(world_size, ep=1, mode="onebit")
    opt = _optimizer(model, ddp)
    loaded = load_checkpoint(path, model=model, optimizer=opt)
    load_grad_compression_state(ddp, loaded.grad_compression_state)
    restored_equal = all(torch.equal(v, saved[k]) for k, v in grad_compression_state(ddp).items())
    rest = _train(ddp, model, opt, run, rank, world_size, range(stop, steps), steps)
    _release(ddp, model, opt)

    num_warnings = len(records)
    run, _, model, ddp = _wrapped(world_size, ep=2, mode="onebit")
    opt = _optimizer(model, ddp)
    loaded = load_checkpoint(path, model=model, optimizer=opt)
    load_grad_compression_state(ddp, loaded.grad_compression_state)
    reset = all(not v.any() for k, v in grad_compression_state(ddp).items() if k != "layout")
    _release(ddp, model, opt)
    logging.getLogger("moetrain").removeHandler(handler)
    return {"straight": straight, "resumed": first + rest, "restored_equal": restored_equal,
            "nonzero_saved": any(v.any() for k, v in saved.items() if k != "layout"),
            "warnings_same_layout": records[:num_warnings], "warnings_other_layout": records[num_warnings:],
            "reset": reset}


def packed_worker(rank: int, world_size: int, inputs: list[list[list[torch.Tensor]]],
                  calls: list[list[int]], bucket_elements: int) -> list[dict]:
    """``OneBitReducer`` on ``inputs[step][rank][tensor]``, tensor i named ``t{i}``, step s passing
    the tensors ``calls[s]`` in that order: over the world, over the world in buckets of
    ``bucket_elements`` padded elements, and over pairs of ranks ({0, 1}, {2, 3}, as edp groups
    are). Halfway, the world's reducer is replaced by a fresh one that loads the saved residuals
    through ``state_dict``'s views (as a checkpoint load does). After every step: the results,
    each reducer's residuals, bytes and all-to-all calls."""
    names = [f"t{i}" for i in range(len(inputs[0][rank]))]
    shapes = {n: t.numel() for n, t in zip(names, inputs[0][rank], strict=True)}
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    reducers = {"world": OneBitReducer(None, shapes),
                "bucketed": OneBitReducer(None, shapes, bucket_elements=bucket_elements),
                "pair": OneBitReducer(pairs[rank // 2], shapes)}
    calls_made = [0]
    all_to_all = dist.all_to_all_single

    def counted(*args, **kwargs):
        calls_made[0] += 1
        return all_to_all(*args, **kwargs)

    dist.all_to_all_single = counted  # this rank's process only
    out = []
    for s, (step, call) in enumerate(zip(inputs, calls, strict=True)):
        if s == len(inputs) // 2:
            saved, fresh = reducers["world"].state_dict(), OneBitReducer(None, shapes)
            for key, value in fresh.state_dict().items():
                value.copy_(saved[key])
            reducers["world"] = fresh
        record = {}
        for kind, reducer in reducers.items():
            tensors = [step[rank][i].clone() for i in call]
            calls_made[0] = 0
            num_bytes = reducer.all_reduce_sum(tensors, [names[i] for i in call])
            record[kind] = {"result": dict(zip([names[i] for i in call], tensors, strict=True)), "bytes": num_bytes,
                            "state": {k: v.clone() for k, v in reducer.state_dict().items()},
                            "all_to_alls": calls_made[0]}
        out.append(record)
    return out
