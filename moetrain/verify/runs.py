"""The training runs ``moetrain verify`` compares, each a real ``moetrain train`` in its own
processes (forked by ``launcher.Launcher`` with the environment torchrun gives a rank; gloo on
CPU), and what they leave: per-step records and checkpoints read back in one process at full size.

    reference   world 1, steps 1..S+1, a checkpoint after each
    layout L    L's processes, steps 1..S+1, a checkpoint after each
    resharded   world 1 resumed from L's checkpoint after S, step S+1, a checkpoint after it
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moetrain.train.checkpoint.files import step_dir_name
from moetrain.train.checkpoint.index import SafeReader, saved_like
from moetrain.train.metrics import read_metrics
from moetrain.verify.launcher import Launcher


class RunFailed(RuntimeError):
    """A verification run exited non-zero; the message holds the end of its output."""


@dataclass(frozen=True)
class Run:
    name: str
    run_dir: Path
    log: Path

    def checkpoint(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / step_dir_name(step)

    def records(self) -> dict[int, dict]:
        """metrics.jsonl's training records by step (event lines left out)."""
        return {r["step"]: r for r in read_metrics(self.run_dir) if "loss" in r and isinstance(r.get("step"), int)}


def train(name: str, config: Path, work: Path, *, nproc: int, overrides: list[str], launcher: Launcher,
          timeout_s: float = 900.0) -> Run:
    """``moetrain train --config CONFIG OVERRIDES`` in ``nproc`` ranks into ``work/name``; its
    output goes to ``work/name.log``. Raises ``RunFailed`` with the log's end when it fails."""
    run_dir, log = work / name, work / f"{name}.log"
    argv = ["train", "--config", str(config), f"--log.run_dir={run_dir}", *overrides]
    log.write_text("", encoding="utf-8")
    code = launcher.run(argv, nproc=nproc, log=log, timeout_s=timeout_s)
    if code != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RunFailed(f"run {name!r} (nproc {nproc}: {' '.join(argv[3:])}) exited with {code}; end of {log}:\n{tail}")
    return Run(name, run_dir, log)


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint ``path`` (model, optimizer, router state) at its full global
    shape, read in this one process whatever layout wrote it; the trainer's JSON entry left out."""
    reader = SafeReader(path)
    metadata = reader.read_metadata()
    state = {key: saved_like(metadata, key) for key, md in metadata.state_dict_metadata.items()
             if isinstance(md, TensorStorageMetadata) and key != "trainer"}
    with warnings.catch_warnings():
        # "torch.distributed is ... uninitialized, assuming ... a single process": intended.
        warnings.filterwarnings("ignore", message="torch.distributed is", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def export_digest(path: str | Path) -> dict[str, object]:
    """What identifies an init_from export for the reference's reuse: its path and each file's
    name, size and modification time (the cut export in WORK/init_from has the same path whatever
    export it was cut from, so the job's text alone cannot tell two exports apart)."""
    root = Path(path).resolve()
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    return {"path": str(root),
            "files": [[str(p.relative_to(root) if root.is_dir() else p.name), p.stat().st_size, p.stat().st_mtime_ns]
                      for p in files]}


def reference_run(work: Path, config: Path, steps: int, overrides: list[str], say: Callable[[str], None],
                  launcher: Launcher, *, source: dict[str, object] | None = None) -> Run:
    """The world-1 run, or the one a previous verification left in ``work`` for the same job, steps
    and init_from export (``source``: ``export_digest``; ``reference.json`` records them):
    re-verifying other layouts does not run it again."""
    marker = work / "reference.json"
    key = {"job": config.read_text(encoding="utf-8"), "steps": steps, "overrides": overrides, "init_from": source}
    ref = Run("reference", work / "reference", work / "reference.log")
    if marker.is_file() and json.loads(marker.read_text(encoding="utf-8")) == key:
        say(f"reference: world 1, reused from {ref.run_dir}")
        return ref
    marker.unlink(missing_ok=True)
    if ref.run_dir.exists():
        shutil.rmtree(ref.run_dir)  # a stale reference would resume instead of training
    say(f"reference: world 1, {steps + 1} steps ({ref.run_dir})")
    ref = train("reference", config, work, nproc=1, overrides=overrides, launcher=launcher)
    marker.write_text(json.dumps(key), encoding="utf-8")
    return ref
