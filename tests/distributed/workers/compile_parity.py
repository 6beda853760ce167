"""Compile parity harness: ``train.compile`` (every block through ``torch.compile``, inductor) under
expert parallelism, ZeRO 0-3, pipeline parallelism and activation checkpointing on real gloo
ranks, against the eager single-process reference of the same model and global batch (the
reference each harness's own parity tests hold the eager layouts to).

Data-parallel layouts (``kind="dp"``) are the ZeRO harness's model, batches and reference
(``tests.distributed.workers.zero_parity``) with ``compile=True`` passed to ``parallelize``; the
pipeline layout (``kind="pp"``) is the pipeline harness's (``pipeline_worker``) with
``compile=True`` passed to ``parallelize_pipeline``. Every case also returns dynamo's counts after
each step: graphs compiled (a later step that adds graphs recompiled) and graph breaks met, with
their reasons; steps after the first run under ``error_on_recompile``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch._dynamo
import torch.distributed as dist
from torch._dynamo.utils import counters

from moetrain.distributed import (
    ParallelDims,
    clip_global_grad_norm_,
    collect_comm_stats,
    parallelize,
    wrap_optimizer,
)
from moetrain.distributed.pipeline.stages import build_pipeline_model, parallelize_pipeline
from moetrain.models.moe.layer import MoELayer
from moetrain.train.optim import build_optimizer
from moetrain.train.pipeline_step import PipelineStep
from tests.distributed.workers import pipeline_worker, zero_parity


@dataclass
class CompileCase:
    name: str
    kind: str = "dp"
    """"dp": the ZeRO harness at ``zero_stage``/``ep``; "pp": the pipeline harness at pp = 2."""
    zero_stage: int = 0
    ep: int = 1
    ac: str = "none"
    steps: int = 4

    def zero_run(self) -> zero_parity.Run:
        return zero_parity.Run(self.name, self.zero_stage, ep=self.ep, steps=self.steps, ac=self.ac)

    def pp_case(self) -> pipeline_worker.PPCase:
        return pipeline_worker.PPCase(self.name, pp=2, num_layers=2, steps=self.steps, zero_stage=self.zero_stage,
                                      activation_checkpointing=self.ac)


def reference(case: CompileCase, world_size: int) -> list[float]:
    """The eager single-process losses of ``case``, as its harness defines the loss of a step."""
    if case.kind == "pp":
        return pipeline_worker.run_reference(case.pp_case(), dp=world_size // 2)["loss"]
    return zero_parity.run_reference(case.zero_run())["loss"]


def _dp_losses(case: CompileCase, rank: int, world_size: int, on_step, *, compile: bool = True) -> list[float]:
    run = case.zero_run()
    dims = ParallelDims(world_size=world_size, ep=run.ep, num_experts=zero_parity.model_configs(run)[1].num_experts)
    dims.build_mesh("cpu")
    model = zero_parity.build(run)
    train_model = parallelize(model, dims, activation_checkpointing=run.ac, zero_stage=run.zero_stage, compile=compile)
    # zero_parity's optimizer settings, so its reference applies.
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    opt = wrap_optimizer(opt, dims, zero_stage=run.zero_stage)
    params = list(model.parameters())
    B = zero_parity.GLOBAL_BATCH // world_size
    losses = []
    for batch in zero_parity.make_batches(run, run.steps):
        tokens = batch[rank * B:(rank + 1) * B]
        out = train_model(tokens[:, :-1], tokens[:, 1:])
        out.total_loss.backward()
        clip_global_grad_norm_(params, run.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = torch.tensor([out.loss.item()])
        dist.all_reduce(loss)
        losses.append(loss.item() / world_size)
        on_step(model)
    return losses


def _pp_losses(case: CompileCase, world_size: int, on_step) -> list[float]:
    pc = case.pp_case()
    dims = ParallelDims(world_size=world_size, pp=pc.pp)
    dims.build_mesh("cpu")
    pm = build_pipeline_model(pipeline_worker.build_model(pc), pp_rank=dims.pp_rank, pp=pc.pp,
                              seq_len=pipeline_worker.SEQ, device=torch.device("cpu"), seed=0)
    parallelize_pipeline(pm, dims, zero_stage=pc.zero_stage, activation_checkpointing=pc.activation_checkpointing,
                         compile=True)
    step = PipelineStep(pm, dims, schedule=pc.schedule, num_microbatches=pc.micro_batches, device=torch.device("cpu"))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    losses = []
    for ids_DXS, labels_DXS in pipeline_worker.make_batches(pc, dims.dp):
        loss, _ = step.forward_backward(ids_DXS[dims.dp_rank], labels_DXS[dims.dp_rank])
        step.clip_grad_norm_(list(pm.parameters()), pc.max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        on_step(pm)
    return losses


def _dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks met while tracing) since the last ``counters.clear()``."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def compile_worker(rank: int, world_size: int, cases: list[CompileCase]) -> dict:
    """Each case on this rank: its losses per step, dynamo's counts after each step (graphs
    compiled and graph breaks met so far: the first step traces everything once) and the routed
    copies per expert of every MoE layer on this rank in each step. Under expert parallelism also
    the exchange's byte counters after each step (``CommStats``), compiled and in an eager run of
    the same case."""
    # No profile of earlier runs (dynamo's local PGO, kept on disk, marks the values that changed in
    # them dynamic from the start): whether a step recompiles must not depend on what ran before.
    torch._dynamo.config.automatic_dynamic_local_pgo = False
    out = {}
    for case in cases:
        comm: list[dict[str, float]] = []
        eager_comm: list[dict[str, float]] = []
        if case.ep > 1:
            _dp_losses(case, rank, world_size, lambda model, acc=eager_comm: acc.append(_read_comm(model)),
                       compile=False)
        # A fresh dynamo per case: compiled code of earlier models must not count against this
        # one's cache limit, nor its graphs be counted here. Inductor's on-disk graph cache stays.
        torch._dynamo.reset()
        counters.clear()
        counts: list[tuple[int, int]] = []
        loads: list[list[int]] = []

        def on_step(model: torch.nn.Module, counts=counts, loads=loads, comm=comm, ep=case.ep) -> None:
            counts.append(_dynamo_counts())
            loads.append([n for m in model.modules() if isinstance(m, MoELayer) for n in m.tokens_per_expert.tolist()])
            if ep > 1:
                comm.append(_read_comm(model))
            # After the first step every step must run the code compiled in it, whatever its expert
            # loads: a recompilation raises, naming the guard that failed.
            torch._dynamo.config.error_on_recompile = True

        try:
            if case.kind == "pp":
                losses = _pp_losses(case, world_size, on_step)
            else:
                losses = _dp_losses(case, rank, world_size, on_step)
        finally:
            torch._dynamo.config.error_on_recompile = False
        out[case.name] = {"loss": losses, "graphs": [g for g, _ in counts], "graph_breaks": [b for _, b in counts],
                          "loads": loads, "break_reasons": dict(counters["graph_break"]), "comm": comm,
                          "comm_eager": eager_comm}
    return out


def _read_comm(model: torch.nn.Module) -> dict[str, float]:
    """The expert-parallel byte counters of ``model`` since the last read (they restart)."""
    return collect_comm_stats(model).as_metrics()
