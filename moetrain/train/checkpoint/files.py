"""The folder side of checkpoints: names, the manifest, the ``latest`` pointer, retention,
verification, and the one rule for the file names a checkpoint's own files give. Nothing here
reads tensors; ``moetrain.train.checkpoint.state`` does (the layout of ``checkpoint.dir`` is in
``moetrain.train.checkpoint``).

A checkpoint is complete once its ``manifest.json`` exists: the manifest is written last, inside
the temporary folder, which is then renamed into place. The manifest lists the size and sha256 of
every other file, so a truncated or flipped file is found before anything is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from moetrain.config.checkpoint import checkpoint_folder
from moetrain.distributed import runtime
from moetrain.utils.files import atomic_write_text, fsync_dir

log = logging.getLogger("moetrain")

FORMAT = "moetrain-dcp/2"
# Format 1 stored the RNG state, the trainer state and the optimizer settings as pickles and
# indexed the data with DCP's pickled .metadata: nothing of it can be read without unpickling.
_PICKLED_FORMATS = ("moetrain-dcp/1",)
LATEST = "latest"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d{9})$")
# Debris of saves that did not finish: the folder being written, or a same-step checkpoint
# moved aside for its replacement.
_TMP_RE = re.compile(r"^\.step_\d{9}\.(tmp|old-\d+)$")
_HASH_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (missing, partial, corrupt, unsafe or of another model).
    A ``ValueError`` so that the command line reports it as one clear line."""


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def require_file_name(name: object, *, named_by: str) -> str:
    """``name``, when it names a file directly inside the checkpoint folder; else a
    ``CheckpointError`` saying that ``named_by`` (the manifest, an index entry) names it. The
    manifest and the index both name files that are then opened under the folder: a name with a
    folder in it (``../x``, an absolute path) could point anywhere."""
    if not isinstance(name, str) or name in ("", ".", "..") or "\x00" in name or Path(name).name != name:
        raise CheckpointError(f"{named_by} names file {name!r}, which is not a file of the checkpoint folder")
    return name


def rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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


def clean_stale_tmp(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporary folders of interrupted saves (call on one rank, before any save). A
    published checkpoint moved aside for a same-step replacement (``.step_N.old-PID``) whose
    replacement never took its place is a complete checkpoint: it goes back to ``step_N``."""
    folder = Path(folder)
    removed = []
    if folder.is_dir():
        for p in sorted(folder.iterdir()):
            match = _TMP_RE.match(p.name)
            if not match:
                continue
            final = folder / p.name[1:].split(".")[0]
            if match.group(1) != "tmp" and not final.exists() and (p / MANIFEST).is_file():
                os.replace(p, final)
                fsync_dir(folder)
                log.warning("restored %s from %s: a save of the same step was interrupted before "
                            "replacing it", final, p)
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def dcp_write_error(e: BaseException, folder: Path) -> str:
    """What a failed DCP write tells the user: each rank's error and the free space where it wrote
    (a full disk shows only as a torch zip-writer position error: the OS error is lost on the way)."""
    if isinstance(e, CheckpointException):  # a BaseException, the same on every rank
        what = "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in sorted(e.failures.items()))
    else:
        what = f"rank {rank_world()[0]}: {type(e).__name__}: {e}"
    try:
        free = f"{shutil.disk_usage(folder).free / 2**20:.0f} MiB free"
    except OSError:
        free = "free space unknown"
    return f"DCP's write failed ({free} on the filesystem of {folder}): {what}"



# --- the folder a run saves into -------------------------------------------------------------------


def checkpoint_dir_error(folder: str | os.PathLike) -> str | None:
    """Why the run cannot save into ``folder`` (created if missing, then a probe file written and
    removed there), as the ``checkpoint.dir`` error; None when it can. A folder created here is
    removed again (its parents stay): a run that never saves leaves no empty checkpoint folder, which
    `moetrain export` would take for one whose saves were interrupted."""
    folder = Path(folder)
    probe = folder / f".write-probe-{os.getpid()}"
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"probe")
        probe.unlink()
        if created:
            folder.rmdir()
    except OSError as e:
        return f"checkpoint.dir ({str(folder)!r}) cannot be written: {e}"
    return None


def prepare_checkpoint_folder(run_dir: str | Path, checkpoint_dir: str | None) -> Path:
    """The run's checkpoint folder (``checkpoint_folder``), written once by rank 0 before step 1: an
    unusable ``checkpoint.dir`` would otherwise be found by the first save, after ``checkpoint.every``
    steps that are then lost. Collective: every rank raises the same ValueError."""
    folder = checkpoint_folder(run_dir, checkpoint_dir)
    error = runtime.broadcast_from_main(checkpoint_dir_error(folder) if rank_world()[0] == 0 else None)
    if error is not None:
        raise ValueError(error)
    return folder


# --- committing a save -----------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def commit_checkpoint(tmp: Path, final: Path, *, step: int, world_size: int, layout: dict,
                      files: dict[str, dict], keep_last: int) -> None:
    """Rank 0's end of a save: write the manifest of ``files`` into ``tmp``, rename ``tmp`` to
    ``final``, point ``latest`` at it and prune to the newest ``keep_last`` (0 = all)."""
    folder = final.parent
    manifest = {"format": FORMAT, "step": step, "world_size": world_size, "layout": layout,
                "torch": torch.__version__, "time": time.time(), "files": files}
    atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True), durable=True)
    # A checkpoint of the same step (saved again after a resume) is moved aside first and deleted
    # only once the new one is in place.
    old = None
    if final.exists():
        old = folder / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(folder)
    atomic_write_text(folder / LATEST, final.name + "\n", durable=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _prune(folder, keep_last=keep_last, step=step)


def _prune(folder: Path, *, keep_last: int, step: int) -> None:
    """Keep the newest ``keep_last`` checkpoints up to ``step``, the one just saved. A higher step is
    not this run's (it started over, or resumed from an older checkpoint): ranking by step number
    would keep that one and delete this run's own (``warn_of_higher_steps``)."""
    if keep_last <= 0:
        return
    for _, path in [c for c in list_checkpoints(folder) if c[0] <= step][:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


def warn_of_higher_steps(folder: Path, step: int) -> list[Path]:
    """Warn of (and return) the checkpoints in ``folder`` past ``step``, where a run starts: saved by
    a run that went further, which this one's rotation leaves alone and nothing deletes unasked."""
    higher = [path for s, path in list_checkpoints(folder) if s > step]
    if higher:
        log.warning("%s holds checkpoints past step %d, where this run starts: %s, saved by a run that "
                    "went further (before checkpoint.resume=never, a resume from an older checkpoint, or a "
                    "halt on non-finite steps, which resumes from the last good one): checkpoint.keep_last "
                    "leaves them, a save of the same step replaces one, and a resume without `latest` would "
                    "pick the newest. Delete them, or give each run its own log.run_dir", folder, step,
                    ", ".join(p.name for p in higher))
    return higher


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
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is not a {FORMAT} manifest")
    if data.get("format") in _PICKLED_FORMATS:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format {data['format']}, which stores its RNG state, trainer "
            "state and optimizer settings as Python pickles: loading it could run code from the file, "
            f"so it cannot be loaded safely. Resume from a {FORMAT} checkpoint, or start over "
            "(--checkpoint.resume=never)")
    if data.get("format") != FORMAT or not isinstance(data.get("files"), dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is not a {FORMAT} manifest "
                              f"(format {data.get('format')!r})")
    for name in data["files"]:
        require_file_name(name, named_by=f"checkpoint {str(path)!r}: {MANIFEST}")
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
        elif sha256_file(f) != want["sha256"]:
            problems.append(f"file {name} does not match its sha256 in the manifest (corrupted)")
    return problems


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check every file of checkpoint ``path`` against its manifest (size and sha256); returns the
    manifest. Collective when a process group exists: rank r checks every world-th file, and the
    problems of all ranks are reported together. Raises ``CheckpointError`` naming each problem."""
    path = Path(path)
    manifest = read_manifest(path)
    rank, world = rank_world()
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


def verify_local(path: Path) -> dict:
    """``verify_checkpoint`` in this process alone, even where a process group exists."""
    manifest = read_manifest(path)
    problems = _check_files(path, manifest["files"])
    if problems:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt or partial: " + "; ".join(problems))
    return manifest
