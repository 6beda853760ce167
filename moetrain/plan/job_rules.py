"""The job config's own rules, applied to the layouts ``moetrain plan`` lists.

Each row of a plan table stands for a job: the planned config with the row's settings as
overrides, the ones ``moetrain train`` would be given (``--parallel.zero_stage=2
--parallel.ep=8 --zero.offload_optimizer=cpu ...``). A row is valid only when that job passes
what ``moetrain train --nproc W`` checks before it starts a process: ``JobConfig``'s cross-field
rules (gradient compression, Muon, offload, pipeline model and reduction, rebalancing, ...),
``ParallelDims`` at the world size and the micro-batch count of the pipeline schedule. The
planner repeats none of these rules, so a new one reaches its tables without an edit here.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

from moetrain.config.job import JobConfig
from moetrain.config.train import TrainConfig
from moetrain.distributed.parallel_dims import ParallelDims


class LayoutRules:
    """``reason(parallel=..., zero=..., train=...)``: why the planned config with those fields
    replaced cannot train on ``world`` processes of ``per_node`` a node (the config's message), or
    None. Answers are cached by the fields, so each distinct job is built once however many rows
    (checkpointing, offload, HSDP, ...) share it. ``micro_batch_size`` is the one the plan assumes
    (its accumulation steps follow from the global batch)."""

    def __init__(self, cfg: JobConfig, *, world: int, per_node: int, micro_batch_size: int | None = None) -> None:
        self.cfg, self.world, self.per_node = cfg, world, per_node
        self._train = {} if micro_batch_size in (None, cfg.train.micro_batch_size) else {
            "micro_batch_size": micro_batch_size, "grad_accum": None}
        self._cache: dict[tuple, str | None] = {}

    def reason(self, *, parallel: dict, zero: dict | None = None, train: dict | None = None) -> str | None:
        sections = (parallel, zero or {}, {**self._train, **(train or {})})
        key = tuple(tuple(sorted(s.items())) for s in sections)
        if key not in self._cache:
            self._cache[key] = self._check(*sections)
        return self._cache[key]

    def _check(self, parallel: dict, zero: dict, train: dict) -> str | None:
        cfg = self.cfg
        try:
            with warnings.catch_warnings():
                # The planned config's warnings were shown once, when it loaded.
                warnings.simplefilter("ignore")
                job = replace(cfg, parallel=replace(cfg.parallel, **parallel), zero=replace(cfg.zero, **zero),
                              train=replace(cfg.train, **train))
            ParallelDims.from_config(job.parallel, world_size=self.world, ranks_per_node=self.per_node,
                                     num_experts=job.moe.num_experts if job.model.is_moe else None)
            job.grad_accum_steps(self.world)
        except ValueError as e:
            return str(e)
        return None

    def main_row(self, *, zero_stage: int, ep: int, offload: str, ac: str, hsdp_replicate: int) -> str | None:
        """A row of the main table: every rank data-parallel (tp = pp = etp = 1) at this stage, ep,
        offload ("none", "optimizer" or "params"), checkpointing and HSDP; hierarchical all-to-all
        as the config asks where ep > 1."""
        return self.reason(
            parallel={"zero_stage": zero_stage, "ep": ep, "hsdp_replicate": hsdp_replicate, "tp": 1, "pp": 1,
                      "etp": 1, "ep_hierarchical": self.cfg.parallel.ep_hierarchical and ep > 1},
            zero={"offload_optimizer": "none" if offload == "none" else "cpu",
                  "offload_param": "cpu" if offload == "params" else "none"},
            # The interval belongs to every_n: the other rows stand for the job with it reset.
            train={"activation_checkpointing": ac, **({} if ac == "every_n" else {
                "activation_checkpointing_every": TrainConfig.activation_checkpointing_every})})

    def tp_row(self, tp: int) -> str | None:
        """A row of the tensor-parallel table: the config with ``parallel.tp`` set (dp follows)."""
        return self.reason(parallel={"tp": tp, "dp": -1})

    def etp_row(self, *, ep: int, etp: int) -> str | None:
        """A row of the expert tensor-parallel table: ep x etp at ZeRO stage 0 (which etp allows),
        no offload, tp = pp = 1."""
        return self.reason(parallel={"ep": ep, "etp": etp, "zero_stage": 0, "hsdp_replicate": 1, "tp": 1, "pp": 1,
                                     "dp": -1},
                           zero={"offload_optimizer": "none", "offload_param": "none"})

    def pp_row(self, *, pp: int, schedule: str, virtual_stages: int) -> str | None:
        """A row of the pipeline table: the config with these pipeline settings, tp = 1."""
        return self.reason(parallel={"pp": pp, "pp_schedule": schedule, "pp_virtual_stages": virtual_stages,
                                     "tp": 1, "dp": -1})
