"""Sharded, atomic, resumable checkpoints on ``torch.distributed.checkpoint`` (DCP).

Layout of ``checkpoint.dir``::

    step_000000100/          one complete checkpoint (renamed into place only once every file is written)
        .metadata            DCP index: global shapes and which file holds which shard
        __0_0.distcp ...     DCP data, one file per writing rank
        manifest.json        step, layout, size and sha256 of every file above; written last
    step_000000200/
    latest                   "step_000000200": the newest complete checkpoint
    .step_000000300.tmp/     a save in progress, or one killed mid-way: never read, removed at the next start

What a checkpoint holds (DCP keys):

    model.<fqn>                parameters and persistent buffers (router state such as expert biases);
                               expert weights are DTensors sharded over ``ep``, so DCP stores them by
                               *global* expert index and any other layout can read them back
    optim.state.<fqn>.<name>   AdamW moments and step counts, keyed by parameter name, also global
    optim.param_groups.<i>.*   learning rate, betas, ... of each parameter group
    trainer                    JSON text: step, LR schedule, loss scaler, data position, skip counters,
                               the resolved job config (so a checkpoint alone can be exported)
    rng.rank<r>                RNG states of rank r (torch, numpy, python, cuda)

The state dicts come from ``torch.distributed.checkpoint.state_dict.get_state_dict`` on the
*unwrapped* model, which handles plain tensors, ep-sharded DTensors and FSDP2 shards alike:
that is what lets a checkpoint saved at one (world, ep, zero) layout load at another. ZeRO-1's
element-sliced optimizer state goes through its ``consolidated()`` form (the stage-0 state), so a
stage-1 checkpoint is an ordinary one.

Saving and loading are collective: every rank calls them, in the same order.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from moetrain.distributed.zero import ZeroShardedOptimizer

log = logging.getLogger("moetrain")

FORMAT = "moetrain-dcp/1"
LATEST = "latest"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d{9})$")
# Debris of saves that did not finish: the folder being written, or a same-step checkpoint
# moved aside for its replacement.
_TMP_RE = re.compile(r"^\.step_\d{9}\.(tmp|old-\d+)$")
_HASH_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (missing, partial, corrupt or of another model). A
    ``ValueError`` so that the command line reports it as one clear line."""


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


# --- finding checkpoints ---------------------------------------------------------------------------


def list_checkpoints(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of the complete-looking checkpoints in ``folder`` (those with a manifest),
    oldest first. Temporary folders of interrupted saves are never listed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The checkpoint ``folder/latest`` names; if that pointer is missing or stale (its target is
    gone or incomplete), the newest complete checkpoint, with a warning; None when there is none."""
    folder = Path(folder)
    pointer = folder / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        target = folder / name
        if _STEP_RE.match(name) and (target / MANIFEST).is_file():
            return target
        log.warning("%s names %r, which is not a complete checkpoint; using the newest complete one",
                    pointer, name)
    found = list_checkpoints(folder)
    return found[-1][1] if found else None


def resolve_checkpoint(spec: str | os.PathLike) -> Path:
    """A checkpoint path from a user's ``spec``: one checkpoint folder (it holds a manifest), or a
    folder of checkpoints (its latest). Raises ``CheckpointError`` naming what is missing."""
    path = Path(spec)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if (path / MANIFEST).is_file() or (path / ".metadata").is_file():
        return path
    if path.name.startswith(".") and path.name.endswith(".tmp"):
        raise CheckpointError(f"checkpoint {str(path)!r} is the temporary folder of a save that never "
                              "finished; load the previous checkpoint instead")
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{str(path)!r} holds no complete checkpoint (no step_*/{MANIFEST}); "
                              "an interrupted save leaves only a .step_*.tmp folder")
    return latest


# --- RNG states ------------------------------------------------------------------------------------


def capture_rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- saving ----------------------------------------------------------------------------------------


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    # Makes a rename durable: without it a crash can lose the new directory entry.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (network mounts) cannot fsync a directory; the rename stays atomic
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _agree(error: str | None) -> None:
    """Rank 0's outcome to every rank: all raise, or none (a rank that carried on alone would
    block in the next collective)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise RuntimeError(error)


def _gather_to_main(obj: Any) -> list[Any] | None:
    rank, world = _rank_world()
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def clean_stale_tmp(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporary folders of interrupted saves (call on one rank, before any save)."""
    folder = Path(folder)
    removed = []
    if folder.is_dir():
        for p in folder.iterdir():
            if _TMP_RE.match(p.name):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """DCP keys optimizer state by parameter name: the optimizer must step the model's own
    parameters (not, say, flat shards of them; ZeRO-1's optimizer is consolidated first)."""
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
    if foreign:
        raise ValueError(f"the optimizer steps {foreign} tensors that are not parameters of the model "
                         f"({type(optimizer).__name__}): checkpoints key optimizer state by parameter "
                         "name, so they need an optimizer over the model's own parameters")


def save_checkpoint(folder: str | os.PathLike, step: int, *, model: nn.Module,
                    optimizer: torch.optim.Optimizer, trainer_state: dict, rng_state: dict | None = None,
                    keep_last: int = 0, layout: dict | None = None) -> Path:
    """Write checkpoint ``step`` of ``model`` (unwrapped: no DDP wrapper) and ``optimizer`` into
    ``folder`` atomically, point ``latest`` at it and keep the newest ``keep_last`` (0 = all).

    Collective. All ranks write into ``.step_N.tmp``; once DCP has written its index, every rank
    hashes the files it wrote, rank 0 writes the manifest and renames the folder into place, then
    moves ``latest``. A process killed at any point before the rename leaves the previous
    checkpoint and ``latest`` untouched. Returns the checkpoint's path.
    """
    folder = Path(folder)
    rank, world = _rank_world()
    name = step_dir_name(step)
    final, tmp = folder / name, folder / f".{name}.tmp"
    t0 = time.perf_counter()
    if isinstance(optimizer, ZeroShardedOptimizer):
        optimizer = optimizer.consolidated()  # collective; the full state lives until this returns
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

    # 2. DCP writes every rank's shards (replicated entries once) and, on rank 0, the index.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    rng = rng_state if rng_state is not None else capture_rng_state()
    state = {"model": model_sd, "optim": optim_sd, "trainer": json.dumps(trainer_state, sort_keys=True),
             "rng": {f"rank{rank}": pickle.dumps(rng)}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True))

    # 3. Each rank hashes its own data files (in parallel); rank 0 writes the manifest.
    mine: dict[str, dict] | str
    try:
        mine = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                for p in sorted(tmp.glob(f"__{rank}_*.distcp"))}
    except OSError as e:
        mine = f"rank {rank} could not hash its checkpoint files: {e}"
    gathered = _gather_to_main(mine)
    error = None
    if rank == 0:
        try:
            failures = [g for g in gathered if isinstance(g, str)]
            if failures:
                raise RuntimeError("; ".join(failures))
            files = {k: v for g in gathered for k, v in g.items()}
            meta = tmp / ".metadata"
            files[meta.name] = {"bytes": meta.stat().st_size, "sha256": _sha256(meta)}
            manifest = {"format": FORMAT, "step": step, "world_size": world, "layout": layout or {},
                        "torch": torch.__version__, "time": time.time(), "files": files}
            _write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
            _fsync_dir(tmp)
            # 4. Into place. A checkpoint of the same step (saved again after a resume) is moved
            #    aside first and deleted only once the new one is in place.
            old = None
            if final.exists():
                old = folder / f".{name}.old-{os.getpid()}"
                os.replace(final, old)
            os.replace(tmp, final)
            _fsync_dir(folder)
            _write_atomic(folder / LATEST, name + "\n")
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            _prune(folder, keep_last=keep_last, keep=final)
        except Exception as e:  # noqa: BLE001 - every rank must learn that the save failed
            error = f"saving checkpoint {final} failed: {type(e).__name__}: {e}"
    _agree(error)
    log.info("saved checkpoint %s (%.2f s)", final, time.perf_counter() - t0)
    return final


def _prune(folder: Path, *, keep_last: int, keep: Path) -> None:
    if keep_last <= 0:
        return
    checkpoints = list_checkpoints(folder)
    for _, path in checkpoints[:-keep_last]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)


# --- verifying -------------------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike) -> dict:
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no {MANIFEST}: it is incomplete (a save that did not finish "
            f"writes the manifest last) or not a moetrain checkpoint")
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is unreadable ({e})") from e
    if data.get("format") != FORMAT or not isinstance(data.get("files"), dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is not a {FORMAT} manifest "
                              f"(format {data.get('format')!r})")
    return data


def _check_files(path: Path, files: dict[str, dict]) -> list[str]:
    problems = []
    for name, want in sorted(files.items()):
        f = path / name
        if not f.is_file():
            problems.append(f"file {name} is missing")
            continue
        size = f.stat().st_size
        if size != want["bytes"]:
            problems.append(f"file {name} has {size} bytes, the manifest says {want['bytes']} (truncated?)")
        elif _sha256(f) != want["sha256"]:
            problems.append(f"file {name} does not match its sha256 in the manifest (corrupted)")
    return problems


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check every file of checkpoint ``path`` against its manifest (size and sha256); returns the
    manifest. Collective when a process group exists: rank r checks every world-th file, and the
    problems of all ranks are reported together. Raises ``CheckpointError`` naming each problem."""
    path = Path(path)
    manifest = read_manifest(path)
    rank, world = _rank_world()
    names = sorted(manifest["files"])
    mine = {n: manifest["files"][n] for n in names[rank::world]}
    problems = _check_files(path, mine)
    if world > 1:
        everyone: list[list[str]] = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(everyone, problems)
        problems = [p for rank_problems in everyone for p in rank_problems]
    if problems:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt or partial: "
                              + "; ".join(sorted(problems)))
    return manifest


# --- loading ---------------------------------------------------------------------------------------


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    trainer_state: dict
    """The JSON ``trainer`` entry: step, scheduler, scaler, data, counters, config."""
    rng_state: dict | None
    """This rank's RNG states, or None when the checkpoint was saved by fewer ranks."""
    manifest: dict


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


def _flat_keys(state: dict) -> dict[str, Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    return flat


def _check_against_metadata(path: Path, expected: dict[str, Any], metadata) -> None:
    """Compare the entries we are about to read with the checkpoint's index; one error naming
    every missing, unexpected and mis-shaped entry (rather than DCP's first failure)."""
    saved = metadata.state_dict_metadata
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k, v in saved.items()
                  if k.startswith(("model.", "optim.state.")) and k not in expected]
    mismatched = []
    for k, v in expected.items():
        md = saved.get(k)
        if isinstance(v, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                if md is not None:
                    mismatched.append(f"{k} (saved as a non-tensor)")
                continue
            if tuple(md.size) != tuple(v.shape):
                mismatched.append(f"{k} (saved {tuple(md.size)}, this model {tuple(v.shape)})")
        elif md is not None and not isinstance(md, BytesStorageMetadata):
            mismatched.append(f"{k} (saved as a tensor)")
    problems = []

    def listed(keys: list[str], what: str) -> None:
        if keys:
            shown = ", ".join(sorted(keys)[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
            problems.append(f"{what}: {shown}")

    listed(missing, "missing entries")
    listed(unexpected, "entries this model does not have")
    listed(mismatched, "entries of another shape")
    if problems:
        raise CheckpointError(f"checkpoint {str(path)!r} does not match this model and optimizer: "
                              + "; ".join(problems) + ". Was it saved with another model config?")


def load_checkpoint(path: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    verify: bool = True) -> LoadedCheckpoint:
    """Load checkpoint ``path`` into ``model`` (unwrapped) and ``optimizer``, whatever layout
    (world size, ep) saved it. Collective.

    All or nothing: the files are checked against the manifest, the entries against the index,
    and DCP reads into fresh tensors; only when all of that succeeded are the values copied into
    the model and optimizer. Any failure raises ``CheckpointError`` and changes nothing.
    """
    path = Path(path)
    rank, _ = _rank_world()
    zero = optimizer if isinstance(optimizer, ZeroShardedOptimizer) else None
    if zero is not None:
        optimizer = zero.plain_optimizer()  # loaded in stage-0 form, then sliced (step 4)
    _check_optimizer(model, optimizer)
    # 1. Files: present, whole, unchanged.
    manifest = verify_checkpoint(path) if verify else read_manifest(path)
    reader = dcp.FileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except Exception as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: cannot read its DCP index .metadata ({e})") from e

    # 2. Entries: the state of this model and optimizer, in fresh tensors. (Empty per-parameter
    #    entries, planted by reading the optimizer's state defaultdict, would stop DCP from
    #    creating the state of a fresh optimizer.)
    for p in [p for p, s in optimizer.state.items() if not s]:
        del optimizer.state[p]
    fresh_optimizer = not optimizer.state
    try:
        # get_state_dict gives a fresh optimizer its state with one zero-learning-rate step.
        model_sd, optim_sd = get_state_dict(model, optimizer)
        rng_key = f"rank{rank}"
        has_rng = f"rng.{rng_key}" in metadata.state_dict_metadata
        state = {"model": _fresh_like(model_sd), "optim": _fresh_like(optim_sd), "trainer": ""}
        if has_rng:
            state["rng"] = {rng_key: b""}
        _check_against_metadata(path, _flat_keys(state), metadata)

        # 3. Read (every rank its own shards, resharded from whatever layout saved them).
        try:
            dcp.load(state, storage_reader=reader)
        except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
            raise CheckpointError(f"reading checkpoint {str(path)!r} failed; nothing was loaded: "
                                  f"{type(e).__name__}: {e}") from e
    except BaseException:
        if fresh_optimizer:
            optimizer.state.clear()  # that zero step must not outlive a failed load (Adam's step count)
        raise

    # 4. Only now into the live objects.
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if zero is not None:
        zero.load_consolidated(optimizer)
    trainer_state = json.loads(state["trainer"])
    rng_state = pickle.loads(state["rng"][rng_key]) if has_rng else None
    return LoadedCheckpoint(path=path, step=int(trainer_state["step"]), trainer_state=trainer_state,
                            rng_state=rng_state, manifest=manifest)


def load_model_weights(path: str | os.PathLike, *,
                       verify: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Full (consolidated) model tensors of checkpoint ``path`` in one process, without building the
    model or a process group, plus its trainer state (which holds the resolved config). For export."""
    path = Path(path)
    # Local checks only: this runs in one process, even where a process group happens to exist.
    _verify_local(path) if verify else read_manifest(path)
    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata()
    tensors = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            tensors[key[len("model."):]] = torch.empty(md.size, dtype=md.properties.dtype)
    state = {"model": tensors, "trainer": ""}
    try:
        with warnings.catch_warnings():
            # "torch.distributed is ... uninitialized, assuming ... a single process": intended.
            warnings.filterwarnings("ignore", message="torch.distributed is", category=UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"reading checkpoint {str(path)!r} failed: {type(e).__name__}: {e}") from e
    return state["model"], json.loads(state["trainer"])


def _verify_local(path: Path) -> dict:
    manifest = read_manifest(path)
    problems = _check_files(path, manifest["files"])
    if problems:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt or partial: " + "; ".join(problems))
    return manifest
