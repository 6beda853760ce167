"""Saving and loading the training state through DCP (the folder layout is in
``moetrain.train.checkpoint``).

What a checkpoint holds (DCP keys; tensors only, so that loading unpickles nothing: see
``moetrain.train.checkpoint.index``):

    model.<fqn>                parameters and persistent buffers (router state such as expert biases);
                               expert weights are DTensors sharded over ``ep``, so DCP stores them by
                               *global* expert index and any other layout can read them back
    ema.<fqn>                  with optim.ema_decay: the moving average of each trainable parameter,
                               sharded like it (``moetrain.train.weight_average``)
    optim.state.<fqn>.<name>   AdamW moments and step counts, keyed by parameter name, also global
    optim.param_groups         JSON text (a uint8 tensor): learning rate, betas, ... of each group
    trainer                    JSON text (a uint8 tensor): step, LR schedule, loss scaler, data
                               position, skip counters, the resolved job config (so a checkpoint
                               alone can be exported)
    rng.rank<r>.<name>         RNG states of rank r as tensors (``moetrain.train.rng_state``)
    grad_compression.rank<r>.<name>
                               the 1-bit gradient compression's error-feedback residuals of rank r
                               and the layout they belong to (``MoEDataParallel.compression_state_dict``)

The state dicts come from ``torch.distributed.checkpoint.state_dict.get_state_dict`` on the
*unwrapped* model, which handles plain tensors, ep-sharded DTensors and FSDP2 shards alike:
that is what lets a checkpoint saved at one (world, ep, zero) layout load at another. ZeRO-1's
element-sliced optimizer state goes through its ``consolidated()`` form (the stage-0 state), so a
stage-1 checkpoint is an ordinary one.

Saving and loading are collective: every rank calls them, in the same order.
"""


from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from moetrain.distributed.data_parallel.zero1 import ZeroShardedOptimizer
from moetrain.train.checkpoint.files import (
    CheckpointError,
    commit_checkpoint,
    dcp_write_error,
    file_record,
    rank_world,
    read_manifest,
    step_dir_name,
    verify_checkpoint,
)
from moetrain.train.checkpoint.index import (
    INDEX,
    SafeReader,
    index_to_json,
    json_entry,
    saved_like,
    text_tensor,
)
from moetrain.train.rng_state import capture_rng_state, rng_state_problems
from moetrain.utils.files import atomic_write_text

log = logging.getLogger("moetrain")


# --- saving ----------------------------------------------------------------------------------------


def _agree(error: str | None, group: dist.ProcessGroup | None = None) -> None:
    """Rank 0's outcome to every rank of ``group`` (default: the world): all raise, or none (a rank
    that carried on alone would block in the next collective)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0, group=group)
        error = box[0]
    if error is not None:
        raise RuntimeError(error)


def _gather_to_main(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    rank, world = rank_world()
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """DCP keys optimizer state by parameter name: the optimizer must step the model's own
    parameters (not, say, flat shards of them; ZeRO-1's optimizer is consolidated first)."""
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
    if foreign:
        raise ValueError(f"the optimizer steps {foreign} tensors that are not parameters of the model "
                         f"({type(optimizer).__name__}): checkpoints key optimizer state by parameter "
                         "name, so they need an optimizer over the model's own parameters")


def _state_to_save(model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict,
                   rng: dict[str, torch.Tensor], rank: int, grad_compression: dict[str, torch.Tensor],
                   ema: dict[str, torch.Tensor] | None) -> dict:
    """The DCP state dict of a save: tensors only (see ``moetrain.train.checkpoint.index``)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        groups = json.dumps(optim_sd["param_groups"])
    except TypeError as e:
        raise ValueError(f"the optimizer's param_groups hold a value that is not JSON ({e}); "
                         "checkpoints store them as JSON text") from e
    state = {"model": model_sd, "optim": {"state": optim_sd["state"], "param_groups": text_tensor(groups)},
             "trainer": text_tensor(json.dumps(trainer_state, sort_keys=True)),
             "rng": {f"rank{rank}": rng}}
    if grad_compression:
        state["grad_compression"] = {f"rank{rank}": grad_compression}
    if ema is not None:
        state["ema"] = ema
    others = sorted(k for k, v in flatten_state_dict(state)[0].items() if not isinstance(v, torch.Tensor))
    if others:
        raise ValueError(f"checkpoint entries {others[:8]} are not tensors: DCP would pickle them, and "
                         "loading a pickle can run code, so checkpoints hold tensors only")
    return state


def _commit_on_main(tmp: Path, final: Path, gathered: list, metadata: Metadata | None, *, step: int,
                    layout: dict | None, keep_last: int) -> str | None:
    """Rank 0: write the JSON index and the manifest, rename into place, move ``latest``, prune.
    Returns the error every rank must raise, or None."""
    try:
        failures = [g for g in gathered if isinstance(g, str)]
        if failures:
            raise RuntimeError("; ".join(dict.fromkeys(failures)))  # a failure DCP reported on every rank once
        assert metadata is not None, "rank 0 wrote its data, so DCP returned the index"
        files = {k: v for g in gathered for k, v in g.items()}
        atomic_write_text(tmp / INDEX, json.dumps(index_to_json(metadata)), durable=True)
        for name in (".metadata", INDEX):
            files[name] = file_record(tmp / name)
        commit_checkpoint(tmp, final, step=step, world_size=len(gathered), layout=layout or {},
                          files=files, keep_last=keep_last)
    except Exception as e:  # noqa: BLE001 - every rank must learn that the save failed
        return f"saving checkpoint {final} failed: {type(e).__name__}: {e}"
    return None


@dataclass(frozen=True)
class PendingSave:
    """A save whose DCP data is still to be written: ``state`` into ``tmp``, then published as ``final``."""

    tmp: Path
    final: Path
    step: int
    state: dict
    """The DCP state dict (tensors only); the live tensors, until an asynchronous save stages a copy."""
    layout: dict | None
    keep_last: int
    t0: float


def begin_save(folder: str | os.PathLike, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
               trainer_state: dict, rng_state: dict[str, torch.Tensor] | None = None, keep_last: int = 0,
               layout: dict | None = None, grad_compression_state: dict[str, torch.Tensor] | None = None,
               ema_state: dict[str, torch.Tensor] | None = None) -> PendingSave:
    """The first part of ``save_checkpoint`` (same arguments): a clean temporary folder and the
    state dict to write into it. Collective."""
    folder = Path(folder)
    rank, _ = rank_world()
    name = step_dir_name(step)
    final, tmp = folder / name, folder / f".{name}.tmp"
    t0 = time.perf_counter()
    if isinstance(optimizer, ZeroShardedOptimizer):
        optimizer = optimizer.consolidated()  # collective; the full state lives as long as the state dict
    _check_optimizer(model, optimizer)

    # 1. A clean temporary folder (left over by a save of the same step killed earlier).
    error = None
    if rank == 0:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            error = f"cannot create checkpoint folder {tmp}: {e}"
    _agree(error)
    rng = rng_state if rng_state is not None else capture_rng_state()
    state = _state_to_save(model, optimizer, trainer_state, rng, rank, grad_compression_state or {}, ema_state)
    return PendingSave(tmp=tmp, final=final, step=step, state=state, layout=layout, keep_last=keep_last, t0=t0)


def checkpoint_writer(tmp: Path) -> dcp.FileSystemWriter:
    """DCP's writer of one checkpoint: one file per rank, each fsynced before the manifest names it."""
    return dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)


def publish_save(pending: PendingSave, metadata: Metadata | None, *, write_error: str | None = None,
                 group: dist.ProcessGroup | None = None) -> Path:
    """The last part of a save, once DCP has written ``pending``'s data (on this rank: ``metadata``,
    or ``write_error`` when it failed): every rank hashes the files it wrote, rank 0 writes the
    index and the manifest and renames the folder into place, then moves ``latest``. Collective
    over ``group`` (default: the world); every rank raises if any rank failed."""
    rank, _ = rank_world()
    tmp = pending.tmp
    mine: dict[str, dict] | str
    if write_error is not None:
        mine = write_error
    else:
        try:
            mine = {p.name: file_record(p) for p in sorted(tmp.glob(f"__{rank}_*.distcp"))}
        except OSError as e:
            mine = f"rank {rank} could not hash its checkpoint files: {e}"
    gathered = _gather_to_main(mine, group)
    error = None
    if rank == 0:
        assert gathered is not None  # rank 0 is where they were gathered
        error = _commit_on_main(tmp, pending.final, gathered, metadata, step=pending.step,
                                layout=pending.layout, keep_last=pending.keep_last)
    _agree(error, group)
    log.info("saved checkpoint %s (%.2f s)", pending.final, time.perf_counter() - pending.t0)
    return pending.final


def save_checkpoint(folder: str | os.PathLike, step: int, *, model: nn.Module,
                    optimizer: torch.optim.Optimizer, trainer_state: dict,
                    rng_state: dict[str, torch.Tensor] | None = None, keep_last: int = 0,
                    layout: dict | None = None, grad_compression_state: dict[str, torch.Tensor] | None = None,
                    ema_state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write checkpoint ``step`` of ``model`` (unwrapped: no DDP wrapper) and ``optimizer`` into
    ``folder`` atomically, point ``latest`` at it and keep the newest ``keep_last`` (0 = all).
    ``rng_state`` comes from ``capture_rng_state`` (default: the current state);
    ``grad_compression_state`` from ``grad_compression_state`` (this rank's residuals, if any);
    ``ema_state`` from ``WeightAverage.state_dict`` (the weight average, if the run keeps one).

    Collective. All ranks write into ``.step_N.tmp``; once DCP has written its index, every rank
    hashes the files it wrote, rank 0 writes the manifest and renames the folder into place, then
    moves ``latest``. A process killed at any point before the rename leaves the previous
    checkpoint and ``latest`` untouched. Returns the checkpoint's path. (``begin_save``,
    DCP's write and ``publish_save`` are its three parts; ``moetrain.train.checkpoint.background``
    runs the last two in a thread.)
    """
    pending = begin_save(folder, step, model=model, optimizer=optimizer, trainer_state=trainer_state,
                         rng_state=rng_state, keep_last=keep_last, layout=layout,
                         grad_compression_state=grad_compression_state, ema_state=ema_state)
    # DCP writes every rank's shards (replicated entries once) and, on rank 0, the index. A failed
    # write is published as failed, so every rank raises it with the step and the folder.
    try:
        metadata, error = dcp.save(pending.state, storage_writer=checkpoint_writer(pending.tmp)), None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must take part in publishing
        metadata, error = None, dcp_write_error(e, pending.tmp)
    return publish_save(pending, metadata, write_error=error)


# --- loading ---------------------------------------------------------------------------------------


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    trainer_state: dict
    """The JSON ``trainer`` entry: step, scheduler, scaler, data, counters, config."""
    rng_state: dict[str, torch.Tensor] | None
    """This rank's RNG states (for ``restore_rng_state``), or None when the checkpoint was saved by
    fewer ranks."""
    manifest: dict
    grad_compression_state: dict[str, torch.Tensor] | None = None
    """This rank's saved gradient-compression residuals (for ``load_grad_compression_state``), or
    None when the checkpoint holds none for this rank."""
    ema_state: dict[str, torch.Tensor] | None = None
    """The saved weight average read into tensors shaped like ``ema_like`` (for
    ``WeightAverage.load_state_dict``), or None when none was asked for or the checkpoint has none."""


def _fresh_like(obj: Any) -> Any:
    """The same nested structure with every tensor replaced by an uninitialised one of the same
    shape and placement (DTensors stay DTensors): DCP reads into these, so a load that fails half
    way leaves the live model and optimizer untouched."""
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj)
    if isinstance(obj, dict):
        return {k: _fresh_like(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fresh_like(v) for v in obj]
    return copy.deepcopy(obj)


def _listed(keys: list[str], what: str) -> list[str]:
    if not keys:
        return []
    shown = ", ".join(sorted(keys)[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
    return [f"{what}: {shown}"]


def _mismatch(path: Path, problems: list[str]) -> CheckpointError:
    return CheckpointError(f"checkpoint {str(path)!r} does not match this model and optimizer: "
                           + "; ".join(problems) + ". Was it saved with another model config?")


def _check_against_metadata(path: Path, expected: dict[str, torch.Tensor], metadata: Metadata, *,
                            held_elsewhere: frozenset[str] = frozenset()) -> None:
    """Compare the entries we are about to read with the checkpoint's index; one error naming
    every missing, unexpected and mis-shaped entry (rather than DCP's first failure).
    ``held_elsewhere``: entries other pipeline stages read (not unexpected here)."""
    saved = metadata.state_dict_metadata
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k.startswith(("model.", "optim.state.")) and k not in expected
                  and k not in held_elsewhere]
    shapes = {k: tuple(md.size) for k, md in saved.items() if isinstance(md, TensorStorageMetadata)}
    mismatched = [f"{k} (saved {shapes[k]}, this model {tuple(v.shape)})"
                  for k, v in expected.items() if k in shapes and shapes[k] != tuple(v.shape)]
    problems = (_listed(missing, "missing entries") + _listed(unexpected, "entries this model does not have")
                + _listed(mismatched, "entries of another shape"))
    if problems:
        raise _mismatch(path, problems)


def _param_groups(path: Path, live: list[dict], saved: Any, carried: frozenset[str] = frozenset()) -> list[dict]:
    """The saved param groups in the live groups' shape: every live key from the checkpoint,
    tuples (betas) as tuples, since JSON returns them as lists, and of the saved keys the live
    groups lack those in ``carried`` (what the live optimizer records as it trains and declares in
    ``carried_group_keys``, e.g. 1-bit Adam's ``onebit_frozen_at``; another optimizer drops them)."""
    if not isinstance(saved, list) or len(saved) != len(live) or not all(isinstance(g, dict) for g in saved):
        count = len(saved) if isinstance(saved, list) else type(saved).__name__
        raise _mismatch(path, [f"optim.param_groups holds {count} groups, this optimizer {len(live)}"])
    groups, missing = [], []
    for i, (mine, theirs) in enumerate(zip(live, saved, strict=True)):
        missing += [f"optim.param_groups.{i}.{k}" for k in mine if k not in theirs]
        # The parameters of a group are this optimizer's own (a pipeline stage holds some of the
        # model's); the saved values are its hyperparameters.
        groups.append({k: v if k == "params" else tuple(theirs[k])
                       if isinstance(v, tuple) and isinstance(theirs.get(k), list) else theirs.get(k)
                       for k, v in mine.items()} | {k: v for k, v in theirs.items() if k not in mine and k in carried})
    if missing:
        raise _mismatch(path, _listed(missing, "missing entries"))
    return groups


def _read_state(path: Path, reader: SafeReader, metadata: Metadata, model: nn.Module,
                optimizer: torch.optim.Optimizer, rank: int, pipeline_group=None,
                ema_like: dict[str, torch.Tensor] | None = None) -> tuple[dict, list[dict]]:
    """This rank's part of the checkpoint, read into fresh tensors; also the live optimizer's
    param groups (the shape the saved ones must take). With ``pipeline_group`` the model is one
    stage's share: the entries the other stages read are expected too (a collective over it)."""
    # get_state_dict gives a fresh optimizer its state with one zero-learning-rate step.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    prefix = f"rng.rank{rank}."
    rng = {k[len(prefix):]: saved_like(metadata, k) for k in metadata.state_dict_metadata
           if k.startswith(prefix)}
    state = {"model": _fresh_like(model_sd),
             "optim": {"state": _fresh_like(optim_sd["state"]),
                       "param_groups": saved_like(metadata, "optim.param_groups", torch.uint8)},
             "trainer": saved_like(metadata, "trainer", torch.uint8)}
    if rng:
        state["rng"] = {f"rank{rank}": rng}
    prefix = f"grad_compression.rank{rank}."
    residuals = {k[len(prefix):]: saved_like(metadata, k) for k in metadata.state_dict_metadata
                 if k.startswith(prefix)}
    if residuals:
        state["grad_compression"] = {f"rank{rank}": residuals}
    if ema_like is not None and has_weight_average(metadata):
        state["ema"] = _fresh_like(ema_like)
    expected = flatten_state_dict(state)[0]
    held_elsewhere: frozenset[str] = frozenset()
    if pipeline_group is not None:
        mine = sorted(k for k in expected if k.startswith(("model.", "optim.state.")))
        every: list = [None] * dist.get_world_size(pipeline_group)
        dist.all_gather_object(every, mine, group=pipeline_group)
        held_elsewhere = frozenset(k for keys in every for k in keys)
    _check_against_metadata(path, expected, metadata, held_elsewhere=held_elsewhere)
    # Every rank reads its own shards, resharded from whatever layout saved them.
    try:
        dcp.load(state, storage_reader=reader)
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        raise CheckpointError(f"reading checkpoint {str(path)!r} failed; nothing was loaded: "
                              f"{type(e).__name__}: {e}") from e
    return state, cast(list[dict], optim_sd["param_groups"])


def has_weight_average(metadata: Metadata) -> bool:
    return any(k.startswith("ema.") for k in metadata.state_dict_metadata)


def load_checkpoint(path: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    verify: bool = True, pipeline_group=None,
                    ema_like: dict[str, torch.Tensor] | None = None) -> LoadedCheckpoint:
    """Load checkpoint ``path`` into ``model`` (unwrapped) and ``optimizer``, whatever layout
    (world size, ep, pp) saved it. Collective. ``pipeline_group``: the model is this rank's
    pipeline stages (the pp group over which the stages together hold the whole model).
    ``ema_like``: read the saved weight average too, into tensors like these (``WeightAverage.state_dict``).

    All or nothing: the files are checked against the manifest, the entries against the index,
    and DCP reads into fresh tensors; only when all of that succeeded are the values copied into
    the model and optimizer. Any failure raises ``CheckpointError`` and changes nothing.
    """
    path = Path(path)
    rank, _ = rank_world()
    zero = optimizer if isinstance(optimizer, ZeroShardedOptimizer) else None
    if zero is not None:
        optimizer = zero.plain_optimizer()  # loaded in stage-0 form, then sliced (step 4)
    _check_optimizer(model, optimizer)
    # 1. Files: present, whole, unchanged; the index is JSON of tensor entries only.
    manifest = verify_checkpoint(path) if verify else read_manifest(path)
    reader = SafeReader(path)
    metadata = reader.read_metadata()

    # 2. Entries: the state of this model and optimizer, read into fresh tensors. (Empty
    #    per-parameter entries, planted by reading the optimizer's state defaultdict, would stop
    #    DCP from creating the state of a fresh optimizer.)
    for p in [p for p, s in optimizer.state.items() if not s]:
        del optimizer.state[p]
    fresh_optimizer = not optimizer.state
    try:
        state, live_groups = _read_state(path, reader, metadata, model, optimizer, rank, pipeline_group, ema_like)
        # 3. The JSON and RNG entries must decode before anything goes live.
        groups = _param_groups(path, live_groups, json_entry(path, state, "optim.param_groups"),
                               getattr(optimizer, "carried_group_keys", frozenset()))
        trainer_state = json_entry(path, state, "trainer")
        rng_state = state["rng"][f"rank{rank}"] if "rng" in state else None
        if not isinstance(trainer_state, dict) or "step" not in trainer_state:
            raise CheckpointError(f"checkpoint {str(path)!r}: the trainer entry has no step")
        problems = rng_state_problems(rng_state) if rng_state is not None else []
        if problems:
            raise CheckpointError(f"checkpoint {str(path)!r}: malformed RNG state of rank {rank}: "
                                  + "; ".join(problems))
    except BaseException:
        if fresh_optimizer:
            optimizer.state.clear()  # that zero step must not outlive a failed load (Adam's step count)
        raise

    # 4. Only now into the live objects.
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optim"]["state"], "param_groups": groups})
    if zero is not None:
        zero.load_consolidated(optimizer)
    residuals = state["grad_compression"][f"rank{rank}"] if "grad_compression" in state else None
    return LoadedCheckpoint(path=path, step=int(trainer_state["step"]), trainer_state=trainer_state,
                            rng_state=rng_state, manifest=manifest, grad_compression_state=residuals,
                            ema_state=state.get("ema"))

