"""Routing traces (``log.routing_trace``) and routing replay (``moe.routing_replay``).

A trace lives in ``<run_dir>/routing_trace``: ``index.json`` (the model geometry, the recorded steps
and ``layouts``: the ``world_size``, ``ep`` and ``etp`` that wrote the steps from ``from_step`` on,
one entry per resume at another layout) and one safetensors file per recorded step and rank,
``step_{step:08d}.rank{rank:05d}.safetensors`` (no pickle). Each rank writes its own tokens, so
recording needs no collective:

* "counts" (on the ``log.every`` steps): ``counts.<layer>`` int32 [E], the routed copies of this
  rank's tokens per expert (before capacity drops). Summed over the rank files of a step, they are
  the global batch's counts (under tp the ranks hold sequence slices; under pp each rank has its
  stage's layers).
* "full" (every step): ``ids.<layer>`` int16 [T_rank, K], the top-k expert ids of every token this
  rank routed, its micro-batches one after another, and ``blocks`` int64 [R, 2], the global offset
  and length of each run of consecutive tokens in the step's global batch, in the order of the ids
  (sequences in the loader's order, ``micro * micro_batch + dp_rank * local_batch``, times seq_len).
  At tp = 1 a micro-batch is one run; under tensor (sequence) parallelism a rank routes positions
  ``tp_rank * S/tp ... (tp_rank + 1) * S/tp - 1`` of each of its sequences: one run per sequence.
  Replay at any layout reassembles the global ``[T, K]`` ids from the blocks and hands each rank
  its own.

"counts" reads each MoE layer's ``trace_routed_E``, which the layer adds to in every training forward
with its routing statistics (``MoELayer.record_step_stats``: not in an activation-checkpointing
recompute, nor in the pipeline's shape inference), inside the compiled graph under ``train.compile``;
the recorder zeroes it before a recorded step and reads it after. "full" reads the routers' output
through forward hooks it registers itself (in training mode, and not in a recompute); under
``train.compile`` dynamo traces the hook, which splits each MoE block's graph. The replay sets
``router.replay_idx_TK`` before each micro-batch and clears it after the step. Reading a trace (its
index, a step's ids, the per-expert and per-rank loads): :mod:`moetrain.train.routing_trace_read`.

Shape legend: T tokens, E experts, K experts per token, A micro-batches per step, L MoE layers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config.force_skew import parse_force_skew
from moetrain.distributed.data_parallel.ddp import unwrap
from moetrain.models.moe.layer import MoELayer
from moetrain.models.moe.skew import skew_seed, skew_weights, skewed_assignment
from moetrain.train.routing_trace_read import (
    FORMAT,
    INDEX,
    TRACE_DIR,
    layouts,
    load_step_ids,
    read_index,
    step_file,
    step_layout,
)

# Re-exported: the report, the skew planner and the benchmarks read a trace's loads through this module.
from moetrain.train.routing_trace_read import expert_loads as expert_loads
from moetrain.train.routing_trace_read import rank_loads as rank_loads
from moetrain.train.routing_trace_read import straggler_factors as straggler_factors
from moetrain.utils.files import atomic_write_text
from moetrain.utils.safetensors_io import ShardedWriter, TensorSpec, read_header


def moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    return [(name, m) for name, m in unwrap(model).named_modules() if isinstance(m, MoELayer)]


@dataclass(frozen=True)
class Geometry:
    """What a trace must share with the run that replays it, and where this rank's tokens lie."""

    num_experts: int
    top_k: int
    tokens_per_step: int
    seq_len: int
    micro_batch: int
    """Sequences of one micro-batch over all data-parallel ranks."""
    local_batch: int
    """Sequences of one micro-batch on this rank (and on each rank of its tp group)."""
    dp_rank: int
    tp: int = 1
    tp_rank: int = 0

    def runs(self, micro: int) -> list[tuple[int, int]]:
        """(global token offset, token count) of each run of consecutive global tokens this rank
        routes in micro-batch ``micro``, in the order its MoE layers see them: the local
        ``[B, S/tp]`` positions flattened (the MoE layer under tp takes its sequence shard)."""
        first = micro * self.micro_batch + self.dp_rank * self.local_batch
        if self.tp == 1:  # whole sequences: one run
            return [(first * self.seq_len, self.local_batch * self.seq_len)]
        shard = self.seq_len // self.tp
        return [((first + b) * self.seq_len + self.tp_rank * shard, shard) for b in range(self.local_batch)]

    def positions(self, micro: int) -> torch.Tensor:
        """``[T_rank]`` global token indices of micro-batch ``micro`` on this rank (see :meth:`runs`)."""
        return torch.cat([torch.arange(start, start + length) for start, length in self.runs(micro)])


class RoutingRecorder:
    """Writes this rank's part of the trace; ``start_step`` / ``before_micro`` / ``finish_step``
    are called by the trainer around each optimizer step."""

    def __init__(self, model: nn.Module, *, mode: str, every: int, run_dir: Path, geometry: Geometry,
                 num_micro: int, rank: int, world_size: int, ep: int, is_main: bool, start_step: int,
                 etp: int = 1) -> None:
        self.mode, self.every, self.geometry, self.num_micro = mode, every, geometry, num_micro
        self.rank, self.is_main = rank, is_main
        self.folder = run_dir / TRACE_DIR
        self.layers = moe_layers(model)
        self.active = False
        self._ids: dict[str, list[torch.Tensor]] = {}
        self._handles = [] if mode == "counts" else [layer.router.register_forward_hook(self._hook(name))
                                                      for name, layer in self.layers]
        # "counts" needs the layers' routing statistics, which the balancer turns on (the trainer
        # installs it for every MoE model); the recorder turns on those it finds off, and off again.
        self._tracking = [layer for _, layer in self.layers if mode == "counts" and not layer.track_routing_stats]
        for layer in self._tracking:
            layer.track_routing_stats = True
        # The layer names of every rank (pipeline stages hold different layers): one gather at setup.
        names = [name for name, _ in self.layers]
        every_names: list[list[str]] = [names]
        if dist.is_initialized() and world_size > 1:
            every_names = [[] for _ in range(world_size)]
            dist.all_gather_object(every_names, names)
        all_names = list(dict.fromkeys(n for rank_names in every_names for n in rank_names))
        layout = {"from_step": start_step + 1, "world_size": world_size, "ep": ep, "etp": etp}
        self.index: dict[str, Any] = {
            "format": FORMAT, "mode": mode, "layers": all_names, "num_experts": geometry.num_experts,
            "top_k": geometry.top_k, "tokens_per_step": geometry.tokens_per_step, "world_size": world_size,
            "ep": ep, "etp": etp, "steps": [], "layouts": [layout]}
        if is_main:
            self.folder.mkdir(parents=True, exist_ok=True)
            old = self.folder / INDEX
            if old.is_file():  # a resumed run: keep the steps it had recorded up to the resume point
                prev = json.loads(old.read_text())
                if all(prev.get(k) == self.index[k] for k in ("mode", "layers", "num_experts", "top_k",
                                                              "tokens_per_step")):
                    self.index["steps"] = [s for s in prev.get("steps", []) if s <= start_step]
                    kept = [lay for lay in layouts(prev) if lay["from_step"] <= start_step]
                    self.index["layouts"] = kept + [layout]
        self._dirty = False

    def _hook(self, name: str):
        def hook(router: nn.Module, args, out) -> None:
            # Evaluation forwards are not training steps; an activation-checkpointing recompute
            # (a graph task is executing) routes the same tokens a second time.
            if not (self.active and router.training) or torch._C._current_graph_task_id() != -1:
                return
            self._ids[name].append(out.idx_TK.detach().to("cpu", torch.int16))
        return hook

    def start_step(self, step: int) -> None:
        """``step``: the 1-based number of the step about to run."""
        self.step = step
        self.active = self.mode == "full" or step % self.every == 0
        if not self.active:
            return
        for name, layer in self.layers:
            if self.mode == "counts":
                layer.trace_routed_E.zero_()  # outside the compiled graph: no recompile
            else:
                self._ids[name] = []

    def finish_step(self) -> None:
        if not self.active:
            return
        self.active = False
        tensors: dict[str, torch.Tensor] = {}
        if self.mode == "counts":
            # host sync
            tensors = {f"counts.{n}": layer.trace_routed_E.to("cpu", torch.int32) for n, layer in self.layers}
        else:
            starts = [run for m in range(self.num_micro) for run in self.geometry.runs(m)]
            tensors["blocks"] = torch.tensor(starts, dtype=torch.int64)
            expect = sum(length for _, length in starts)
            for n, parts in self._ids.items():
                ids_TK = torch.cat(parts) if parts else torch.empty(0, self.geometry.top_k, dtype=torch.int16)
                if ids_TK.shape[0] != expect:
                    raise RuntimeError(f"routing trace: layer {n} routed {ids_TK.shape[0]} tokens in step "
                                       f"{self.step}, not the {expect} of this rank's micro-batches")
                tensors[f"ids.{n}"] = ids_TK
        specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
        name = step_file(self.step, self.rank)
        # Not durable: a log like metrics.jsonl, and an fsync of every rank on every logged step
        # would stall the next collective wherever the run folder is on a network filesystem.
        with ShardedWriter(self.folder, specs, metadata={"step": str(self.step)}, weights=name, durable=False) as w:
            for k, v in tensors.items():
                w.write(k, v)
            w.close()
        if self.is_main:
            self.index["steps"].append(self.step)
            atomic_write_text(self.folder / INDEX, json.dumps(self.index) + "\n")

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for layer in self._tracking:
            layer.track_routing_stats = False


class RoutingReplay:
    """Feeds the recorded ids of each step to the routers (``moe.routing_replay``, or ``moe.force_skew``
    "trace:PATH": ``field`` is the one the errors name)."""

    def __init__(self, path: str | os.PathLike, model: nn.Module, *, geometry: Geometry, first_step: int,
                 last_step: int, field: str = "moe.routing_replay") -> None:
        try:
            self.folder, self.index = read_index(path)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from e
        self.geometry = geometry
        self.layers = moe_layers(model)
        check_trace(self.folder, self.index, layer_names=[n for n, _ in self.layers], geometry=geometry,
                    steps=range(first_step, last_step + 1), field=field)
        self._ids: dict[str, torch.Tensor] = {}

    def start_step(self, step: int) -> None:
        self._ids = load_step_ids(self.folder, self.index, step, [n for n, _ in self.layers],
                                  num_tokens=self.geometry.tokens_per_step, num_experts=self.geometry.num_experts)

    def before_micro(self, micro: int) -> None:
        positions_T = self.geometry.positions(micro)
        for name, layer in self.layers:
            ids_TK = self._ids[name].index_select(0, positions_T)
            layer.router.replay_idx_TK = ids_TK.to(layer.tokens_per_expert.device)

    def finish_step(self) -> None:
        for _, layer in self.layers:
            layer.router.replay_idx_TK = None
        self._ids = {}


def check_trace(folder: Path, index: dict, *, layer_names: list[str], geometry: Geometry, steps: range,
                field: str = "moe.routing_replay") -> None:
    """Every mismatch between a trace and the run replaying it, as one ValueError naming ``field`` (the
    setting that gave the trace) and the file."""
    where = str(folder / INDEX)
    problems = []
    if index["mode"] != "full":
        problems.append(f'mode {index["mode"]!r} (replay needs log.routing_trace = "full")')
    if sorted(index["layers"]) != sorted(layer_names):
        problems.append(f"MoE layers {index['layers']} != this model's {layer_names}")
    for key, ours in (("num_experts", geometry.num_experts), ("top_k", geometry.top_k),
                      ("tokens_per_step", geometry.tokens_per_step)):
        if index[key] != ours:
            problems.append(f"{key} {index[key]} != this run's {ours}")
    missing = [s for s in steps if s not in set(index["steps"])]
    if missing:
        problems.append(f"steps {missing[:5]}{'...' if len(missing) > 5 else ''} not recorded")
    if problems:
        raise ValueError(f"{field}: trace {where!r} does not fit this run: {'; '.join(problems)}")
    for step in steps:
        for rank in range(step_layout(index, step)["world_size"]):
            _check_file(folder / step_file(step, rank), index, field=field)


def _check_file(path: Path, index: dict, *, field: str) -> None:
    try:
        tensors, _ = read_header(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{field}: trace file {str(path)!r} is missing or corrupt ({e})") from e
    bad = []
    if "blocks" not in tensors or tensors["blocks"].dtype != torch.int64 or len(tensors["blocks"].shape) != 2:
        bad.append("no int64 [A, 2] 'blocks'")
    for name in index["layers"]:
        info = tensors.get(f"ids.{name}")
        if info is None or info.dtype != torch.int16 or len(info.shape) != 2 or info.shape[1] != index["top_k"]:
            bad.append(f"no int16 [T, {index['top_k']}] 'ids.{name}'")
    if bad:
        raise ValueError(f"{field}: trace file {str(path)!r} is corrupt: {'; '.join(bad)}")


class ForcedSkew(RoutingReplay):
    """``moe.force_skew`` (zipf, hot, drift): each rank draws the ids of the tokens it routes in each
    micro-batch (``Geometry.runs``), per MoE layer, from generators seeded by (step, layer, token
    block) alone (``skewed_assignment``), so a token gets the same experts at every layout. The draw
    is O(tokens of this rank x E) per layer and micro-batch, on the host, inside the timed step."""

    def __init__(self, kind: str, params: tuple, model: nn.Module, *, geometry: Geometry) -> None:
        self.kind, self.params, self.geometry = kind, params, geometry
        self.layers = moe_layers(model)
        self._ids = {}
        self._step, self._w_E = 0, torch.empty(0)

    def start_step(self, step: int) -> None:
        self._step = step
        self._w_E = skew_weights(self.kind, self.params, step=step, num_experts=self.geometry.num_experts)

    def before_micro(self, micro: int) -> None:
        g = self.geometry
        for i, (_, layer) in enumerate(self.layers):
            seed = skew_seed(self._step, i)
            ids_TK = torch.cat([skewed_assignment(self._w_E, num_tokens=length, top_k=g.top_k, seed=seed,
                                                  start=start) for start, length in g.runs(micro)])
            layer.router.replay_idx_TK = ids_TK.to(layer.tokens_per_expert.device)


class RoutingHooks:
    """The recorder and the replay of a run (either may be absent), called around each step."""

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def start_step(self, step: int) -> None:
        for p in self.parts:
            p.start_step(step)

    def before_micro(self, micro: int) -> None:
        for p in self.parts:
            if isinstance(p, RoutingReplay):
                p.before_micro(micro)

    def finish_step(self) -> None:
        for p in self.parts:
            p.finish_step()


def build_routing_hooks(cfg, model: nn.Module, *, run_dir: Path, rank: int, world_size: int, dp_rank: int,
                        dp_size: int, ep: int, grad_accum: int, is_main: bool, start_step: int, tp: int = 1,
                        tp_rank: int = 0) -> RoutingHooks:
    """``cfg``: the JobConfig. Replay is built first: a trace that does not fit raises before anything runs."""
    m = cfg.moe
    micro_batch = cfg.train.global_batch_size // grad_accum
    geometry = Geometry(num_experts=m.num_experts, top_k=m.top_k,
                        tokens_per_step=cfg.train.global_batch_size * cfg.data.seq_len, seq_len=cfg.data.seq_len,
                        micro_batch=micro_batch, local_batch=micro_batch // dp_size, dp_rank=dp_rank, tp=tp,
                        tp_rank=tp_rank)
    parts: list = []
    kind, params = parse_force_skew(m.force_skew, num_experts=m.num_experts)
    replay = m.routing_replay if kind != "trace" else params[0]
    if replay is not None:
        parts.append(RoutingReplay(replay, model, geometry=geometry, first_step=start_step + 1,
                                   last_step=cfg.train.steps,
                                   field="moe.force_skew" if kind == "trace" else "moe.routing_replay"))
    elif kind != "none":
        parts.append(ForcedSkew(kind, params, model, geometry=geometry))
    if cfg.log.routing_trace != "off":
        parts.append(RoutingRecorder(model, mode=cfg.log.routing_trace, every=cfg.log.every, run_dir=run_dir,
                                     geometry=geometry, num_micro=grad_accum, rank=rank, world_size=world_size,
                                     ep=ep, etp=cfg.parallel.etp, is_main=is_main, start_step=start_step))
    return RoutingHooks(parts)
