"""The checkpointing component the trainer holds: where checkpoints go, which one a run resumes
from, the training objects into and out of a checkpoint saved at any layout.

    checkpointer = Checkpointer(cfg, objects=TrainingObjects(...), dims=dims, phase=phase, ...)
    resumed = checkpointer.resume()        # collective; None when the run starts from scratch
    snapshot = checkpointer.snapshot(step=step, skipped_total=skips.total)
    checkpointer.save(snapshot)            # collective; with checkpoint.async_save it returns once staged
    checkpointer.poll()                    # every step: a background save's failure raised here
    checkpointer.wait()                    # the save in flight published (before the run returns)

The loop's own state (step, skip counters, interruption) belongs to the trainer: ``resume``
returns what it read of it, and the trainer sets its counters from that.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config import JobConfig
from moetrain.config.loader import config_to_dict
from moetrain.distributed import runtime
from moetrain.distributed.data_parallel.ddp import grad_compression_state, load_grad_compression_state
from moetrain.distributed.expert_parallel.rebalance import Rebalancer
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.train.balancing import Balancer
from moetrain.train.checkpoint.background import BackgroundSaver
from moetrain.train.checkpoint.files import (
    CheckpointError,
    clean_stale_tmp,
    latest_checkpoint,
    rank_world,
    resolve_checkpoint,
    step_dir_name,
    warn_of_higher_steps,
)
from moetrain.train.checkpoint.index import read_trainer_state
from moetrain.train.checkpoint.same_model import check_same_model
from moetrain.train.checkpoint.state import begin_save, load_checkpoint, save_checkpoint
from moetrain.train.faults import Phase
from moetrain.train.optim import apply_optim_config
from moetrain.train.rng_state import capture_rng_state
from moetrain.train.weight_average import WeightAverage

log = logging.getLogger("moetrain")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> None: ...


@dataclass(frozen=True)
class TrainingObjects:
    """What a checkpoint saves and restores, besides the loop's counters."""

    model: nn.Module
    """Unwrapped: its state-dict names are moetrain's whatever the layout."""
    optimizer: torch.optim.Optimizer
    parallel_model: nn.Module
    """The data-parallel wrapper, which holds the 1-bit compression residuals (if any)."""
    scheduler: Stateful
    scaler: Stateful
    train_loader: Stateful
    """Its position in the data."""
    balancer: Balancer | None
    ema: WeightAverage | None
    rebalancer: Rebalancer | None = None
    """Expert rebalancing: its placements go with the checkpoint (replicas in logical order are not saved)."""


@dataclass(frozen=True)
class Resumed:
    """What a resume read that the trainer sets itself."""

    path: Path
    step: int
    skipped_total: int
    rng_state: dict[str, torch.Tensor] | None
    """This rank's RNG state, to restore once setup has drawn its random numbers; None when the
    saving run had no such rank."""
    saved_world_size: int | None


@dataclass(eq=False)
class Checkpointer:
    """Checkpoints of the run into ``folder``; the job's ``checkpoint.*`` settings say when to
    resume and how many to keep. ``vocab_size``: the resolved one, saved with the config so that
    a checkpoint alone can be exported."""

    cfg: JobConfig
    _: KW_ONLY
    folder: Path
    objects: TrainingObjects
    dims: ParallelDims
    phase: Phase
    vocab_size: int | None
    is_main: bool
    last_saved_step: int | None = field(default=None, init=False)
    background: BackgroundSaver | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.cfg.checkpoint.async_save:
            # Collective: every rank builds its Checkpointer.
            self.background = BackgroundSaver(timeout_s=self.cfg.train.collective_timeout_s)

    def step_path(self, step: int) -> Path:
        return self.folder / step_dir_name(step)

    def saved(self, step: int) -> Path | None:
        """The checkpoint of ``step`` when this run saved (or resumed from) it and it is still there
        (a save in flight is waited for)."""
        self.wait()
        path = self.step_path(step)
        return path if self.last_saved_step == step and path.exists() else None

    # --- resuming ---------------------------------------------------------------------------------

    def resume(self) -> Resumed | None:
        """Load what ``checkpoint.resume`` picks: "auto" the newest complete checkpoint of the folder,
        a path that checkpoint, "never" nothing. Rank 0 picks and tells the others (they must all
        load the same one). Collective."""
        choice = runtime.broadcast_from_main(self._resume_choice() if self.is_main else None)
        if isinstance(choice, Exception):
            raise choice
        if choice is None:
            return None
        assert isinstance(choice, str), choice
        return self.load(Path(choice))

    def _resume_choice(self) -> str | CheckpointError | None:
        """Rank 0: remove what killed saves left behind, then pick the checkpoint to resume from and
        check that it holds this job's model (``same_model``): a refusal reaches every rank before
        any of them loads, and before the run folder's record is rewritten."""
        for p in clean_stale_tmp(self.folder):
            log.warning("removed %s, left by a checkpoint save that did not finish", p)
        resume = self.cfg.checkpoint.resume
        start = 0
        try:
            found = latest_checkpoint(self.folder) if resume == "auto" else (
                None if resume == "never" else resolve_checkpoint(resume))
            if found is not None:
                saved = read_trainer_state(found)
                check_same_model(found, saved.get("config") if isinstance(saved, dict) else None,
                                 self._config(), moe=self.cfg.model.is_moe)
                step = saved.get("step") if isinstance(saved, dict) else None
                start = step if isinstance(step, int) else 0  # the load refuses a malformed one
        except CheckpointError as e:
            return e
        warn_of_higher_steps(self.folder, start)  # a fresh start or a rollback leaves them
        return str(found) if found is not None else None

    def load(self, path: Path) -> Resumed:
        """Load checkpoint ``path`` (saved at any layout) into the training objects. Collective."""
        o = self.objects
        with self.phase(f"loading checkpoint {path}"):
            loaded = load_checkpoint(path, model=o.model, optimizer=o.optimizer,
                                     pipeline_group=self.dims.group("pp") if self.dims.pp > 1 else None,
                                     ema_like=o.ema.state_dict() if o.ema is not None else None)
        load_grad_compression_state(o.parallel_model, loaded.grad_compression_state)
        state = loaded.trainer_state
        o.train_loader.load_state_dict(state["data"])
        o.scheduler.load_state_dict(state["scheduler"])
        if isinstance(o.scheduler, torch.optim.lr_scheduler.LambdaLR):
            # The loads restored the saved hyper-parameters; a resume runs with the config's.
            for change in apply_optim_config(o.optimizer, o.scheduler, self.cfg.optim):
                log.info("%s", change)
        o.scaler.load_state_dict(state["scaler"])
        if o.balancer is not None and "balancer" in state:
            self._load_balancer_state(o.balancer, state["balancer"])
        if o.rebalancer is not None:
            o.rebalancer.load_state_dict(state.get("rebalance"), step=loaded.step)
        if o.ema is not None:
            if loaded.ema_state is not None:
                o.ema.load_state_dict(loaded.ema_state, num_updates=int(state.get("ema_updates", 0)))
            else:
                o.ema.restart()
                log.warning("checkpoint %s holds no weight average: optim.ema_decay starts one from its weights", path)
        if loaded.rng_state is None:  # a rank the saving run did not have
            log.warning("checkpoint %s has no RNG state for rank %d (saved by %s ranks): RNG not restored",
                        path, rank_world()[0], loaded.manifest.get("world_size"))
        self.last_saved_step = loaded.step
        log.info("resumed from %s at step %d (saved at world %s, layout %s)", path, loaded.step,
                 loaded.manifest.get("world_size"), loaded.manifest.get("layout"))
        return Resumed(path=path, step=loaded.step, skipped_total=int(state.get("skipped_total", 0)),
                       rng_state=loaded.rng_state, saved_world_size=loaded.manifest.get("world_size"))

    # --- saving -----------------------------------------------------------------------------------

    def _config(self) -> dict:
        """The job's config as a checkpoint holds it: resolved, with the vocabulary the model was built with."""
        config = config_to_dict(self.cfg)
        config["model"]["vocab_size"] = self.vocab_size
        return config

    def snapshot(self, *, step: int, skipped_total: int) -> dict:
        """The small, non-tensor part of the training state after step ``step``; the model and
        optimizer are saved from the live objects (a skipped step does not change them)."""
        o = self.objects
        return {"step": step, "scheduler": copy.deepcopy(o.scheduler.state_dict()),
                "scaler": o.scaler.state_dict(), "data": o.train_loader.state_dict(),
                "skipped_total": skipped_total, "rng": capture_rng_state()}

    def save(self, snapshot: dict, *, wait: bool = False) -> Path:
        """Save ``snapshot``'s step, data position, schedule and RNG with the current weights (after
        skipped steps, the last good state); returns the checkpoint's path. Collective. With
        ``checkpoint.async_save`` it returns once the state is staged, and the checkpoint is at its
        path only after a later ``wait`` (or ``wait=True``)."""
        o, dims = self.objects, self.dims
        snap = dict(snapshot)
        rng = snap.pop("rng")
        trainer_state = {**snap, "config": self._config(), "time": time.time()}
        if o.ema is not None:
            trainer_state["ema_updates"] = o.ema.num_updates  # skipped steps do not change it
        if o.balancer is not None:
            # Taken now, not in the snapshot: skipped steps do not change it, and reading it is a
            # collective (the snapshot is taken after every step).
            trainer_state["balancer"] = self._balancer_state(o.balancer)
        if o.rebalancer is not None:
            # Likewise (a skipped step restores the load history and never re-plans).
            trainer_state["rebalance"] = o.rebalancer.state_dict()
        layout = {"world_size": dims.world_size, "dp": dims.dp, "ep": dims.ep, "etp": dims.etp,
                  "tp": dims.tp, "pp": dims.pp, "zero_stage": self.cfg.parallel.zero_stage}
        args = dict(model=o.model, optimizer=o.optimizer, trainer_state=trainer_state, rng_state=rng,
                    keep_last=self.cfg.checkpoint.keep_last, layout=layout,
                    grad_compression_state=grad_compression_state(o.parallel_model),
                    ema_state=o.ema.state_dict() if o.ema is not None else None)
        with self.phase(f"saving the checkpoint of step {snap['step']}"):
            if self.background is None:
                path = save_checkpoint(self.folder, snap["step"], **args)
            else:
                self.background.wait()  # the previous save first: at most one in flight
                self.background.start(begin_save(self.folder, snap["step"], **args))
                path = self.step_path(snap["step"])
        self.last_saved_step = snap["step"]
        if wait:
            self.wait()
        return path

    def poll(self) -> None:
        """Raise the error of a background save that failed (on every rank at the same step).
        Collective while a save is in flight; a no-op without ``checkpoint.async_save``."""
        if self.background is not None:
            with self.phase("checking the checkpoint written in the background"):
                self.background.poll()

    def wait(self) -> None:
        """Block until the background save in flight (if any) is published; raise its error."""
        if self.background is not None and self.background.in_flight_step is not None:
            with self.phase(f"finishing the checkpoint of step {self.background.in_flight_step}"):
                self.background.wait()

    # --- the balancer's counters ------------------------------------------------------------------

    def _balancer_state(self, balancer: Balancer) -> dict:
        """The balancer's counters; under pipeline parallelism every stage's, by its layers' names
        (rank 0 writes the trainer state, and each pp rank holds other MoE layers). Collective."""
        state = balancer.state_dict()
        if self.dims.pp == 1:
            return state
        per_stage: list = [None] * self.dims.pp
        names = [name for name, _ in balancer.named_layers]
        dist.all_gather_object(per_stage, (names, state), group=self.dims.group("pp"))
        return {"per_stage": per_stage}

    def _load_balancer_state(self, balancer: Balancer, saved: dict) -> None:
        """The counters of this rank's MoE layers. Saved under another pipeline split they cannot
        be matched layer for layer: the counters then restart (the router bias, capacity factor and
        per-expert learning-rate scales are model buffers, restored with the model)."""
        if "per_stage" not in saved and self.dims.pp == 1:
            balancer.load_state_dict(saved)
            return
        names = [name for name, _ in balancer.named_layers]
        match = [state for stage_names, state in saved.get("per_stage", []) if stage_names == names]
        if match:
            balancer.load_state_dict(match[0])
        else:
            log.warning("the balancer counters of the checkpoint belong to another pipeline split: they restart "
                        "(interval load, idle-expert and collapse counters)")
