"""The trainer's checkpoint side: where checkpoints go, what to resume from, loading one saved at
any layout, and saving the current (or last good) state. A mixin of ``Trainer``: it reads the
objects the trainer built (model, optimizer, loaders, scheduler, scaler, balancer, dims)."""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

import torch.distributed as dist

from moetrain.config.loader import config_to_dict
from moetrain.distributed import runtime
from moetrain.distributed.data_parallel import ddp as data_parallel
from moetrain.train.checkpoint import (
    CheckpointError,
    capture_rng_state,
    clean_stale_tmp,
    latest_checkpoint,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from moetrain.train.faults import SkipCounter

log = logging.getLogger("moetrain")


class CheckpointingMixin:
    def build_checkpointing(self) -> None:
        """Where checkpoints go, and the resume: ``checkpoint.resume`` "auto" continues from the
        newest complete checkpoint of ``checkpoint.dir``, a path loads that checkpoint."""
        c = self.cfg.checkpoint
        self.ckpt_dir = Path(c.dir) if c.dir is not None else self.run_dir / "checkpoints"
        self.step = 0
        self.skips = SkipCounter(max_consecutive=self.cfg.train.max_consecutive_skips)
        self.interrupted = False
        self.resumed_from: Path | None = None
        self._last_saved_step: int | None = None
        self._resumed_rng = None
        self.layout_change: dict | None = None
        # Rank 0 decides what to resume from and tells the others (they must all load the same one).
        choice = runtime.broadcast_from_main(self._resume_choice() if self.is_main else None)
        if isinstance(choice, Exception):
            raise choice
        if choice is not None:
            self.resume(Path(choice))

    def _resume_choice(self) -> str | CheckpointError | None:
        """Rank 0: remove what killed saves left behind, then pick the checkpoint to resume from."""
        for p in clean_stale_tmp(self.ckpt_dir):
            log.warning("removed %s, left by a checkpoint save that did not finish", p)
        resume = self.cfg.checkpoint.resume
        try:
            found = latest_checkpoint(self.ckpt_dir) if resume == "auto" else (
                None if resume == "never" else resolve_checkpoint(resume))
        except CheckpointError as e:
            return e
        return str(found) if found is not None else None

    def resume(self, path: Path) -> None:
        """Load checkpoint ``path`` (saved at any layout) and continue exactly where it stopped."""
        with self.phase(f"loading checkpoint {path}"):
            loaded = load_checkpoint(path, model=self.model, optimizer=self.optimizer,
                                     pipeline_group=self.dims.pp_group if self.dims.pp > 1 else None,
                                     ema_like=self.ema.state_dict() if self.ema is not None else None)
        data_parallel.load_grad_compression_state(self.parallel_model, loaded.grad_compression_state)
        state = loaded.trainer_state
        self.train_loader.load_state_dict(state["data"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step = loaded.step
        self.skips.total = int(state.get("skipped_total", 0))
        if self.balancer is not None and "balancer" in state:
            self._load_balancer_state(state["balancer"])
        if self.ema is not None:
            if loaded.ema_state is not None:
                self.ema.load_state_dict(loaded.ema_state, num_updates=int(state.get("ema_updates", 0)))
            else:
                self.ema.restart()
                log.warning("checkpoint %s holds no weight average: optim.ema_decay starts one from its weights", path)
        if loaded.rng_state is not None:
            self._resumed_rng = loaded.rng_state  # restored at the end of __init__
        else:  # a rank the saving run did not have
            log.warning("checkpoint %s has no RNG state for rank %d (saved by %s ranks): RNG not restored",
                        path, self.rank, loaded.manifest.get("world_size"))
        self.resumed_from = path
        self._last_saved_step = self.step
        saved_world = loaded.manifest.get("world_size")
        if saved_world != self.world_size:
            # An elastic restart (or a reshard by hand): same global batch, another accumulation.
            self.layout_change = {"event": "world_size_changed", "world_size_before": saved_world,
                                  "world_size": self.world_size, "grad_accum": self.grad_accum}
        log.info("resumed from %s at step %d (saved at world %s, layout %s)", path, self.step,
                 loaded.manifest.get("world_size"), loaded.manifest.get("layout"))
        if self.step >= self.cfg.train.steps:
            log.info("step %d >= train.steps (%d): nothing left to train (raise train.steps to continue, "
                     "or --checkpoint.resume=never to start over)", self.step, self.cfg.train.steps)

    # --- checkpoint state -------------------------------------------------------------------------

    def _snapshot(self) -> dict:
        """The small, non-tensor part of the training state after the current step; the model
        and optimizer are saved from the live objects (a skipped step does not change them)."""
        return {"step": self.step, "scheduler": copy.deepcopy(self.scheduler.state_dict()),
                "scaler": self.scaler.state_dict(), "data": self.train_loader.state_dict(),
                "skipped_total": self.skips.total, "rng": capture_rng_state()}

    def save_checkpoint(self, snapshot: dict | None = None) -> Path:
        """Save the current state (or ``snapshot``'s step, data position, schedule and RNG with the
        current weights: the last good state after skipped steps). Collective."""
        snap = dict(snapshot if snapshot is not None else self._snapshot())
        rng = snap.pop("rng")
        config = config_to_dict(self.cfg)
        config["model"]["vocab_size"] = self.model_config.vocab_size  # a checkpoint alone can be exported
        trainer_state = {**snap, "config": config, "time": time.time()}
        if self.ema is not None:
            trainer_state["ema_updates"] = self.ema.num_updates  # skipped steps do not change it
        if self.balancer is not None:
            # Taken now, not in the snapshot: skipped steps do not change it, and reading it is a
            # collective (the snapshot is taken after every step).
            trainer_state["balancer"] = self._balancer_state()
        layout = {"world_size": self.world_size, "dp": self.dp_size, "ep": self.dims.ep, "etp": self.dims.etp,
                  "tp": self.dims.tp, "pp": self.dims.pp, "zero_stage": self.cfg.parallel.zero_stage}
        with self.phase(f"saving the checkpoint of step {snap['step']}"):
            path = save_checkpoint(self.ckpt_dir, snap["step"], model=self.model, optimizer=self.optimizer,
                                   trainer_state=trainer_state, rng_state=rng,
                                   keep_last=self.cfg.checkpoint.keep_last, layout=layout,
                                   grad_compression_state=data_parallel.grad_compression_state(self.parallel_model),
                                   ema_state=self.ema.state_dict() if self.ema is not None else None)
        self._last_saved_step = snap["step"]
        return path

    def _balancer_state(self) -> dict:
        """The balancer's counters; under pipeline parallelism every stage's, by its layers' names
        (rank 0 writes the trainer state, and each pp rank holds other MoE layers). Collective."""
        state = self.balancer.state_dict()
        if self.dims.pp == 1:
            return state
        per_stage: list = [None] * self.dims.pp
        names = [name for name, _ in self.balancer.named_layers]
        dist.all_gather_object(per_stage, (names, state), group=self.dims.pp_group)
        return {"per_stage": per_stage}

    def _load_balancer_state(self, saved: dict) -> None:
        """The counters of this rank's MoE layers. Saved under another pipeline split they cannot
        be matched layer for layer: the counters then restart (the router bias, capacity factor and
        per-expert learning-rate scales are model buffers, restored with the model)."""
        if "per_stage" not in saved and self.dims.pp == 1:
            self.balancer.load_state_dict(saved)
            return
        names = [name for name, _ in self.balancer.named_layers]
        match = [state for stage_names, state in saved.get("per_stage", []) if stage_names == names]
        if match:
            self.balancer.load_state_dict(match[0])
        else:
            log.warning("the balancer counters of the checkpoint belong to another pipeline split: they restart "
                        "(interval load, idle-expert and collapse counters)")
