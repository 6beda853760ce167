"""Atomic file writes: a reader sees the old file or the complete new one, never a torn write.

Every writer of a file that another process (a resumed run, a second rank, a user copying an
export) may read while it is being written goes through here: cache entries, token files,
checkpoint manifests, exports.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` (file or folder); rename it onto ``path`` if the block
    succeeds, remove it if the block raises.

    ``durable=True`` also fsyncs the new file and its folder, so the rename survives a power loss
    (checkpoints, exports); caches that can be rebuilt skip that cost.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # pid + random suffix: ranks of one job and concurrent jobs never share a temporary name.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        if durable and tmp.is_file():
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike, text: str, *, durable: bool = False) -> None:
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_text(text, encoding="utf-8")


def atomic_write_with(path: str | os.PathLike, write: Callable[[Path], None], *, durable: bool = True,
                      shared: bool = False) -> None:
    """``write(tmp)`` creates the file at ``tmp`` (e.g. safetensors' ``save_file``); it then
    replaces ``path`` atomically. ``shared=True`` gives it the mode a plain ``open`` would
    (0666 less the umask): some writers create 0600 files, and exports are meant to be shared."""
    with atomic_path(path, durable=durable) as tmp:
        write(tmp)
        if shared:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename inside ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        # Some filesystems (network mounts) cannot fsync a directory; the rename stays atomic.
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def jsonl_records_until(path: str | os.PathLike, step: int) -> list[str]:
    """The lines of the JSON-lines file ``path`` whose record's step is <= ``step``, newline-terminated:
    what a log of a run resumed at ``step`` keeps of the stopped run's (nothing if there is no file)."""
    path = Path(path)
    if not path.exists():
        return []
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by the kill that stopped the previous run
    return kept
