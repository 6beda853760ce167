"""The training loop, as a class whose steps are named and can be read top to bottom.

    trainer = Trainer(cfg)       # setup_distributed -> build_data -> build_model -> build_optimizer
                                 #   -> build_checkpointing (resume) -> build_logging
    trainer.fit()                # train_step x N, evaluate every train.eval_every, log every log.every,
                                 #   save every checkpoint.every, at the end and on SIGTERM
    trainer.close()

Runs standalone (one process) or under torchrun (one or many nodes); the parallel layout comes
from ``cfg.parallel`` through ``ParallelDims``, and the model code never knows about it.

Fault tolerance: a step whose loss or gradient is not finite is skipped on every rank (and
counted); ``train.max_consecutive_skips`` of them in a row stop the run with a checkpoint of the
last good state. Collectives time out after ``train.collective_timeout_s`` with an error naming
the phase and operation, so a stalled rank fails the job (which torchrun can restart from the
latest checkpoint) instead of hanging it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import re
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from moetrain.config import JobConfig
from moetrain.config.loader import config_to_dict, save_config
from moetrain.config.train import resolve_device
from moetrain.data import prepare_data
from moetrain.distributed.data_parallel import no_sync, wrap_optimizer, zero_settings
from moetrain.distributed.expert_parallel import collect_comm_stats
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.distributed.parallelize import parallelize
from moetrain.models.transformer import Transformer
from moetrain.train.balancing import install_balancing
from moetrain.train.checkpoint import (
    CheckpointError,
    capture_rng_state,
    clean_stale_tmp,
    latest_checkpoint,
    load_checkpoint,
    resolve_checkpoint,
    restore_rng_state,
    save_checkpoint,
    step_dir_name,
)
from moetrain.train.flops import peak_flops
from moetrain.train.metrics import MetricsLogger, expert_load_summary
from moetrain.train.optim import build_optimizer, build_scheduler, clip_grad_norm_
from moetrain.train.precision import DynamicLossScaler, autocast_context
from moetrain.utils.cpu_allocator import tune_cpu_allocator
from moetrain.utils.memory import MemoryTracker

log = logging.getLogger("moetrain")


class CollectiveError(RuntimeError):
    """A collective did not complete (timed out, or a peer went away): another rank stalled or
    died. Names the training phase and the operation."""


class NonFiniteError(RuntimeError):
    """``train.max_consecutive_skips`` steps in a row had a non-finite loss or gradient."""


@dataclass
class _Sums:
    """Device-side sums of the micro-steps of one optimizer step (no host sync)."""

    loss: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    routed_LE: torch.Tensor | None = None
    dropped_L: torch.Tensor | None = None
    routed_L: list[int] = field(default_factory=list)

    def add(self, name: str, value: torch.Tensor) -> None:
        cur = getattr(self, name)
        setattr(self, name, value.detach().clone() if cur is None else cur + value.detach())


@dataclass
class _Window(_Sums):
    """Sums over the good (not skipped) steps since the last log; read once per log step (host sync)."""

    steps: int = 0
    """Steps taken, skipped ones included (for the step time and throughput)."""
    skipped: int = 0
    tokens: int = 0
    t0: float = field(default_factory=time.perf_counter)

    def merge(self, step: _Sums) -> None:
        for name in ("loss", "aux", "routed_LE", "dropped_L"):
            value = getattr(step, name)
            if value is not None:
                self.add(name, value)
        if step.routed_L:
            self.routed_L = step.routed_L


# Text of the errors torch's process groups raise when a collective cannot complete.
_TIMEOUT_RE = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER_GONE_RE = re.compile(r"connection (closed|reset) by peer|broken pipe|connection refused", re.IGNORECASE)


class Trainer:
    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.setup_distributed()
        self.setup_run_dir()
        self.build_data()
        self.build_model()
        self.build_optimizer()
        self.apply_collective_timeout()
        self.build_checkpointing()
        self.build_logging()
        # Last: setup draws random numbers (the peak-FLOPs probe), which would advance a
        # restored RNG state.
        if self._resumed_rng is not None:
            restore_rng_state(self._resumed_rng)
        self._last_good = self._snapshot()

    # --- setup ------------------------------------------------------------------------------------

    def setup_distributed(self) -> None:
        cfg = self.cfg
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = resolve_device(cfg.train.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            tune_cpu_allocator()
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        backend = cfg.parallel.backend
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            # The default (long) timeout while rank 0 prepares the data and the others wait for
            # it; apply_collective_timeout shortens it once training collectives start.
            if self.world_size > 1:
                device_id = self.device if backend == "nccl" else None
                store = _restart_safe_store(self.world_size)
                if store is None:
                    dist.init_process_group(backend=backend, device_id=device_id)
                else:
                    dist.init_process_group(backend=backend, device_id=device_id, store=store, rank=self.rank,
                                            world_size=self.world_size)
            else:
                # One process: an in-memory store, no port; the mesh and collectives still work.
                dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        self.dims = ParallelDims.from_config(cfg.parallel, world_size=self.world_size,
                                             num_experts=cfg.moe.num_experts if cfg.model.is_moe else None)
        self.dims.build_mesh(self.device.type)
        self.dp_size, self.dp_rank = self.dims.dp, self.dims.dp_rank
        self.grad_accum = cfg.train.grad_accum_steps(self.dp_size)
        self.is_main = self.rank == 0
        self.phase = "setup"
        logging.basicConfig(level=getattr(logging, cfg.log.level.upper()) if self.is_main else logging.WARNING,
                            format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")

    def setup_run_dir(self) -> None:
        self.run_dir = Path(self.cfg.log.run_dir)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.cfg, self.run_dir / "config.yaml")
        self.barrier()

    def build_data(self) -> None:
        # Rank 0 fetches and tokenises (once, then cached); the others wait and read the cache.
        if self.is_main:
            self.data = prepare_data(self.cfg.data)
        self.barrier()
        if not self.is_main:
            self.data = prepare_data(self.cfg.data, download=False)
        t = self.cfg.train
        micro_global = t.micro_batch_size * self.dp_size
        self.train_loader = self.data.train_loader(global_batch_size=micro_global, dp_rank=self.dp_rank,
                                                   dp_size=self.dp_size, seed=t.seed)
        self.val_loader = self.data.val_loader(global_batch_size=micro_global, dp_rank=self.dp_rank,
                                               dp_size=self.dp_size)

    def build_model(self) -> None:
        cfg = self.cfg
        self.model_config = cfg.model.with_vocab_size(self.data.vocab_size)
        # Every rank builds the full model from the same seed; parallelize then shards it, so
        # the global weights are the same for every layout.
        self.model = Transformer(self.model_config, moe=cfg.moe if self.model_config.is_moe else None,
                                 seed=cfg.train.seed)
        self.model.to(self.device)
        self.param_counts = self.model.param_counts()
        self.flops_per_token = self.model.flops_per_token(cfg.data.seq_len)
        t = cfg.train
        self.parallel_model = parallelize(self.model, self.dims, activation_checkpointing=t.activation_checkpointing,
                                          activation_checkpointing_every=t.activation_checkpointing_every,
                                          compile=t.compile, **zero_settings(cfg))
        self.moe_layers = [blk.feed_forward for blk in self.model.layers if blk.is_moe]

    def build_optimizer(self) -> None:
        o, t = self.cfg.optim, self.cfg.train
        # ZeRO-1 shards the optimizer state (dense over dp, experts over edp); other stages pass
        # the optimizer through (FSDP2 parameters are already shards).
        self.optimizer = wrap_optimizer(
            build_optimizer(self.model, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps),
            self.dims, zero_stage=self.cfg.parallel.zero_stage,
            offload_optimizer=self.cfg.zero.offload_optimizer == "cpu", bucket_numel=self.cfg.zero.allgather_bucket_size)
        self.scheduler = build_scheduler(self.optimizer, lr=o.lr, min_lr=o.resolved_min_lr,
                                         warmup_steps=o.warmup_steps, total_steps=t.steps, schedule=o.schedule)
        self.scaler = DynamicLossScaler(enabled=t.dtype == "fp16")
        # Router-bias updates, dynamic capacity, per-expert LR and the health monitor run in
        # optimizer pre/post-step hooks, so gradient accumulation and skipped steps are handled.
        self.balancer = install_balancing(self.optimizer, self.model, self.dims) if self.model_config.is_moe else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def apply_collective_timeout(self) -> None:
        """``train.collective_timeout_s`` on every process group the training uses: the world and
        the mesh's ep, edp and dp groups (the mesh creates its groups with torch's default of
        30 minutes, whatever the world group's timeout is)."""
        timeout = timedelta(seconds=self.cfg.train.collective_timeout_s)
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if set_timeout is None:  # not in every torch release
            log.warning("this torch cannot change a process group's timeout: train.collective_timeout_s "
                        "is ignored")
            return
        groups = {id(g): g for g in (dist.group.WORLD, self.dims.ep_group, self.dims.edp_group,
                                     self.dims.dp_group)}
        for group in groups.values():
            set_timeout(timeout, group)

    def build_checkpointing(self) -> None:
        """Where checkpoints go, and the resume: ``checkpoint.resume`` "auto" continues from the
        newest complete checkpoint of ``checkpoint.dir``, a path loads that checkpoint."""
        c = self.cfg.checkpoint
        self.ckpt_dir = Path(c.dir) if c.dir is not None else self.run_dir / "checkpoints"
        self.step = 0
        self.skipped_total = 0
        self.consecutive_skips = 0
        self.interrupted = False
        self.resumed_from: Path | None = None
        self._last_saved_step: int | None = None
        self._stop_signal: int | None = None
        # Rank 0 removes what killed saves left behind, then decides what to resume from and
        # tells the others (they must all load the same checkpoint).
        choice: list = [None]
        if self.is_main:
            for p in clean_stale_tmp(self.ckpt_dir):
                log.warning("removed %s, left by a checkpoint save that did not finish", p)
            try:
                if c.resume == "auto":
                    found = latest_checkpoint(self.ckpt_dir)
                    choice = [str(found) if found is not None else None]
                elif c.resume != "never":
                    choice = [str(resolve_checkpoint(c.resume))]
            except CheckpointError as e:
                choice = [e]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(choice, src=0)
        if isinstance(choice[0], Exception):
            raise choice[0]
        self._resumed_rng = None
        if choice[0] is not None:
            self.resume(Path(choice[0]))

    def resume(self, path: Path) -> None:
        """Load checkpoint ``path`` (saved at any layout) and continue exactly where it stopped."""
        with self._phase(f"loading checkpoint {path}"):
            loaded = load_checkpoint(path, model=self.model, optimizer=self.optimizer)
        state = loaded.trainer_state
        try:
            self.train_loader.load_state_dict(state["data"])
        except ValueError as e:
            saved = state["data"].get("global_batch_size")
            if not isinstance(saved, int) or saved == self.train_loader.global_batch_size:
                raise
            fix = (f"set train.micro_batch_size={saved // self.dp_size} to resume at this layout"
                   if saved % self.dp_size == 0 else
                   f"no train.micro_batch_size fits {self.dp_size} data-parallel ranks")
            raise ValueError(
                f"{e}. The data position is counted in batches of train.micro_batch_size * data-parallel "
                f"size sequences ({saved} when saved, {self.train_loader.global_batch_size} now): {fix}") from e
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step = loaded.step
        self.skipped_total = int(state.get("skipped_total", 0))
        if self.balancer is not None and "balancer" in state:
            self.balancer.load_state_dict(state["balancer"])
        if loaded.rng_state is not None:
            self._resumed_rng = loaded.rng_state  # restored at the end of __init__
        else:  # a rank the saving run did not have
            log.warning("checkpoint %s has no RNG state for rank %d (saved by %s ranks): RNG not restored",
                        path, self.rank, loaded.manifest.get("world_size"))
        self.resumed_from = path
        self._last_saved_step = self.step
        log.info("resumed from %s at step %d (saved at world %s, layout %s)", path, self.step,
                 loaded.manifest.get("world_size"), loaded.manifest.get("layout"))
        if self.step >= self.cfg.train.steps:
            log.info("step %d >= train.steps (%d): nothing left to train (raise train.steps to continue, "
                     "or --checkpoint.resume=never to start over)", self.step, self.cfg.train.steps)

    def build_logging(self) -> None:
        lc = self.cfg.log
        # metrics.jsonl of a resumed run reads like that of a run that never stopped: the lines
        # up to the resumed step stay, those the stopped run wrote after it go.
        kept = self._metrics_lines_to_keep() if self.resumed_from is not None and self.is_main else []
        self.metrics = MetricsLogger(self.run_dir, enabled=self.is_main and lc.jsonl, tensorboard=lc.tensorboard)
        if kept and self.metrics._file is not None:
            self.metrics._file.write("".join(kept))
        self.peak_flops = peak_flops(self.device, self.cfg.train.dtype)
        self.memory_metrics: dict = {}
        self.window = _Window()
        pc = self.param_counts
        log.info("model: %.2fM parameters (%.2fM active per token, %.2fM in experts); world %d = dp %d x ep %d; "
                 "%d micro-batch(es) of %d per step; run dir %s", pc.total / 1e6, pc.active / 1e6, pc.expert / 1e6,
                 self.world_size, self.dp_size, self.dims.ep, self.grad_accum, self.cfg.train.micro_batch_size,
                 self.run_dir)

    def _metrics_lines_to_keep(self) -> list[str]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        kept = []
        with open(path) as f:
            for line in f:
                try:
                    if json.loads(line)["step"] <= self.step:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by the kill that stopped the previous run
        return kept

    # --- checkpoint state -------------------------------------------------------------------------

    def _snapshot(self) -> dict:
        """The small, non-tensor part of the training state after the current step; the model
        and optimizer are saved from the live objects (a skipped step does not change them)."""
        return {"step": self.step, "scheduler": copy.deepcopy(self.scheduler.state_dict()),
                "scaler": self.scaler.state_dict(), "data": self.train_loader.state_dict(),
                "skipped_total": self.skipped_total, "rng": capture_rng_state()}

    def save_checkpoint(self, snapshot: dict | None = None) -> Path:
        """Save the current state (or ``snapshot``'s step, data position, schedule and RNG with the
        current weights: the last good state after skipped steps). Collective."""
        snap = dict(snapshot if snapshot is not None else self._snapshot())
        rng = snap.pop("rng")
        config = config_to_dict(self.cfg)
        config["model"]["vocab_size"] = self.model_config.vocab_size  # a checkpoint alone can be exported
        trainer_state = {**snap, "config": config, "time": time.time()}
        if self.balancer is not None:
            # Taken now, not in the snapshot: skipped steps do not change it, and reading it is a
            # collective (the snapshot is taken after every step).
            trainer_state["balancer"] = self.balancer.state_dict()
        layout = {"world_size": self.world_size, "dp": self.dp_size, "ep": self.dims.ep,
                  "zero_stage": self.cfg.parallel.zero_stage}
        with self._phase(f"saving the checkpoint of step {snap['step']}"):
            path = save_checkpoint(self.ckpt_dir, snap["step"], model=self.model, optimizer=self.optimizer,
                                   trainer_state=trainer_state, rng_state=rng,
                                   keep_last=self.cfg.checkpoint.keep_last, layout=layout)
        self._last_saved_step = snap["step"]
        return path

    # --- one optimizer step -----------------------------------------------------------------------

    def forward_backward(self, input_ids_BS: torch.Tensor, labels_BS: torch.Tensor) -> None:
        with autocast_context(self.device, self.cfg.train.dtype):
            out = self.parallel_model(input_ids_BS, labels_BS)
        # Each micro-step's loss is a mean over its tokens; dividing by the accumulation count
        # makes the summed gradient the gradient of the mean over the whole step.
        loss = out.total_loss / self.grad_accum
        self.scaler.scale_loss(loss).backward()
        s = self._step_sums
        s.add("loss", out.loss.float())
        s.add("aux", out.aux_loss.float())
        if out.moe_aux:
            s.add("routed_LE", torch.stack([a.num_routed_per_expert for a in out.moe_aux]))
            s.add("dropped_L", torch.stack([a.num_dropped for a in out.moe_aux]))
            s.routed_L = [a.num_routed for a in out.moe_aux]

    def train_step(self) -> None:
        self.parallel_model.train()
        self._step_sums = _Sums()
        # Memory is measured on log steps only (a dispatch-mode tracker slows the step it
        # watches), and not in the first two steps, where DDP still rebuilds its buckets.
        track = self.cfg.log.memory and self.step + 1 >= 3 and (self.step + 1) % self.cfg.log.every == 0
        tracker = MemoryTracker(self.parallel_model, self.optimizer) if track else _null()
        with tracker:
            good = self._train_step_inner()
        if track:
            self.memory_metrics = tracker.report().as_metrics()
        self._account_step(good)

    def _train_step_inner(self) -> bool:
        with self._phase(f"forward/backward of step {self.step + 1}"):
            for micro in range(self.grad_accum):
                input_ids_BS, labels_BS = self.train_loader.next_batch()
                input_ids_BS, labels_BS = input_ids_BS.to(self.device), labels_BS.to(self.device)
                # No gradient reduction on the non-final micro-steps: gradients accumulate locally.
                sync = micro == self.grad_accum - 1
                with (no_sync(self.parallel_model) if not sync else _null()):
                    self.forward_backward(input_ids_BS, labels_BS)
        with self._phase(f"optimizer step {self.step + 1}"):
            return self.optimizer_step()

    def _account_step(self, good: bool) -> None:
        w = self.window
        w.steps += 1
        w.tokens += self.cfg.train.global_batch_size * self.cfg.data.seq_len
        self.step += 1
        if good:
            w.merge(self._step_sums)
            self.consecutive_skips = 0
            self._last_good = self._snapshot()
        else:
            w.skipped += 1
            self.skipped_total += 1
            self.consecutive_skips += 1
            log.warning("step %d skipped: non-finite loss or gradient (%d in a row, %d in all)", self.step,
                        self.consecutive_skips, self.skipped_total)

    def optimizer_step(self) -> bool:
        """Unscale, clip and step, unless the loss or a gradient is not finite on some rank; then
        every rank skips the update. Returns whether the step was taken."""
        finite = self.scaler.unscale_and_check(self.params)
        self.grad_norm = clip_grad_norm_(self.params, self.cfg.optim.grad_clip)
        good, stop = self._agree(finite)
        if good:
            self.optimizer.step()
        elif self.balancer is not None:
            self.balancer.discard_step()  # a skipped step's routing counts must not move the bias
        self.scaler.update(good)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if stop:
            self.interrupted = True
        return good

    def _agree(self, finite: bool) -> tuple[bool, bool]:
        """(take this step, stop after it): the same answers on every rank. One pair of flags is
        all-reduced per step for both the non-finite check and a SIGTERM received by any rank
        (ranks that saw the signal at different steps would otherwise stop at different steps)."""
        bad = ~torch.isfinite(self.grad_norm.float())
        if self._step_sums.loss is not None:
            bad = bad | ~torch.isfinite(self._step_sums.loss)
        if not finite:  # fp16 overflow (the scaler already agreed on it over the ranks)
            bad = torch.ones_like(bad)
        stop = torch.tensor(self._stop_signal is not None, device=bad.device)
        flags = torch.stack([bad, stop]).float().to(self.device)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad_any, stop_any = flags.tolist()  # host sync: skipping and stopping are decided on the host
        return bad_any == 0, stop_any > 0

    # --- evaluation -------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.parallel_model.eval()
        total = torch.zeros((), device=self.device)
        num = 0
        for input_ids_BS, labels_BS in self.val_loader.epoch_batches(self.cfg.train.eval_steps):
            with autocast_context(self.device, self.cfg.train.dtype):
                out = self.model(input_ids_BS.to(self.device), labels_BS.to(self.device))
            total += out.loss.float()
            num += 1
        total = self.all_reduce_mean(total / max(num, 1))
        val_loss = total.item()
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}

    # --- logging ----------------------------------------------------------------------------------

    def collect_metrics(self) -> dict:
        """Turn the window's device sums into numbers: the one host sync per log step."""
        w = self.window
        dt = time.perf_counter() - w.t0
        good = w.steps - w.skipped
        if good > 0:
            loss = self.all_reduce_mean(w.loss / (good * self.grad_accum)).item()
            aux = self.all_reduce_mean(w.aux / (good * self.grad_accum)).item()
        else:
            loss = aux = float("nan")  # every step of the window was skipped
        tokens_per_s = w.tokens / dt
        m = {
            "loss": loss, "aux_loss": aux, "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(self.grad_norm) if hasattr(self, "grad_norm") else None,
            "tokens_per_s": tokens_per_s, "samples_per_s": tokens_per_s / self.cfg.data.seq_len,
            "step_time_s": dt / w.steps,
            "mfu": tokens_per_s / self.world_size * self.flops_per_token / self.peak_flops,
            "skipped_steps": w.skipped,
            "skipped_steps_total": self.skipped_total,
        }
        if self.cfg.train.dtype == "fp16":
            m["loss_scale"] = self.scaler.scale
        if w.routed_LE is not None:
            # The layers' counts are already summed over the data-parallel ranks (balance_group).
            routed_LE = w.routed_LE.cpu()
            m.update(expert_load_summary(routed_LE))
            dropped_L = self.all_reduce_sum(w.dropped_L.float()).cpu()
            m["dropped_fraction"] = (dropped_L / routed_LE.sum(dim=1).clamp(min=1).double()).tolist()
        if self.balancer is not None:
            m.update(self.balancer.metrics())  # health: entropy, unused experts, alarms (collective)
        m.update(self.memory_metrics)
        self.memory_metrics = {}
        if self.dims.ep_enabled:
            stats = collect_comm_stats(self.model)
            m["a2a_bytes"] = stats.bytes_sent + stats.bytes_received
            m["a2a_bytes_ratio"] = stats.ratio
        self.window = _Window()
        return m

    # --- the loop ---------------------------------------------------------------------------------

    def fit(self) -> dict:
        """Train from ``self.step`` to ``train.steps``. Returns the last logged metrics. On SIGTERM
        (any rank) the ranks finish the current step, log it (even off the log.every cadence, so
        no step goes unreported), save a checkpoint and return with ``self.interrupted`` set."""
        t, lc, c = self.cfg.train, self.cfg.log, self.cfg.checkpoint
        bar = None
        if self.is_main and lc.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=t.steps, initial=self.step, desc="train", dynamic_ncols=True)
        last = {}
        with self._sigterm_handler():
            while self.step < t.steps:
                self.train_step()
                is_last = self.step == t.steps
                halt = t.max_consecutive_skips > 0 and self.consecutive_skips >= t.max_consecutive_skips
                if self.step % lc.every == 0 or is_last or self.interrupted or halt:
                    with self._phase(f"metrics of step {self.step}"):
                        last = self.collect_metrics()
                        if t.eval_every and (self.step % t.eval_every == 0 or is_last):
                            last.update(self.evaluate())
                    self.metrics.log(self.step, last)
                    if bar is not None:
                        bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}",
                                        **({"val": f"{last['val_loss']:.3f}"} if "val_loss" in last else {}))
                if bar is not None:
                    bar.update(1)
                if halt:
                    self._halt_nonfinite()
                if (c.every and self.step % c.every == 0) or (is_last and c.save_final) or self.interrupted:
                    self.save_checkpoint()
                if self.window.steps == 0:
                    # Evaluation and checkpointing ran after the window was closed: start the
                    # next throughput window now, so tokens/s measures training alone.
                    self.window.t0 = time.perf_counter()
                if self.interrupted:
                    if self.step < t.steps:
                        log.warning("stopped by signal at step %d; checkpoint saved in %s", self.step,
                                    self.ckpt_dir / step_dir_name(self.step))
                        break
                    self.interrupted = False  # the signal came with the last step: the run is complete
        if bar is not None:
            bar.close()
        return last

    def _halt_nonfinite(self) -> None:
        good = self._last_good
        first_bad = good["step"] + 1
        path = self.ckpt_dir / step_dir_name(good["step"])
        if self._last_saved_step != good["step"] or not path.exists():
            path = self.save_checkpoint(good)
        raise NonFiniteError(
            f"steps {first_bad}-{self.step} all had a non-finite loss or gradient and were skipped "
            f"(train.max_consecutive_skips={self.cfg.train.max_consecutive_skips}); stopped. The last good "
            f"state (after step {good['step']}) is in {path}; resume from it with "
            f"--checkpoint.resume={path} after lowering optim.lr or fixing the data")

    @contextlib.contextmanager
    def _sigterm_handler(self):
        """SIGTERM (a scheduler's preemption, torchrun stopping the job) asks for a clean stop at
        the end of the current step; a second SIGTERM kills at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.getsignal(signal.SIGTERM)

        def handler(signum, frame):
            if self._stop_signal is not None:  # the second one: die now, as without this handler
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            self._stop_signal = signum
            log.warning("rank %d: SIGTERM received; will save a checkpoint and stop after this step",
                        self.rank)

        signal.signal(signal.SIGTERM, handler)
        try:
            yield
        finally:
            # getsignal gives None for a handler installed outside Python: fall back to the default.
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    @contextlib.contextmanager
    def _phase(self, what: str):
        """Names what the ranks are doing, so that a collective that fails (a rank stalled past
        train.collective_timeout_s, or died) reports the phase and the operation."""
        previous, self.phase = self.phase, what
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, (CollectiveError, NonFiniteError)):
                raise
            text = str(e)
            timed_out = _TIMEOUT_RE.search(text) is not None
            if not timed_out and _PEER_GONE_RE.search(text) is None:
                raise
            limit = self.cfg.train.collective_timeout_s
            cause = (f"did not complete within train.collective_timeout_s={limit:g} s" if timed_out
                     else "failed because a peer rank went away")
            raise CollectiveError(
                f"rank {self.rank}: a collective ({_collective_site(e)}) {cause} during {what}: another rank "
                f"stalled or died. Original error: {text.strip().splitlines()[-1] if text.strip() else text}"
            ) from e
        finally:
            self.phase = previous

    @torch.no_grad()
    def generate(self, prompt: str, *, max_new_tokens: int = 100, temperature: float = 0.8, top_k: int = 50,
                 seed: int = 0) -> str:
        """Sample a continuation. Every rank runs the same computation (the experts of an
        expert-parallel model need all ranks), with the same seeded generator."""
        tok = self.data.tokenizer
        if tok is None:
            raise ValueError("data.path holds pre-tokenised .bin files: no tokenizer to decode samples")
        self.parallel_model.eval()
        gen = torch.Generator().manual_seed(seed)
        ids = tok.encode(prompt) or [self.data.eos_id or 0]
        ctx = self.cfg.data.seq_len
        for _ in range(max_new_tokens):
            x = torch.tensor([ids[-ctx:]], device=self.device)
            logits = self.model(x).logits[0, -1].float().cpu() / max(temperature, 1e-5)
            v, i = torch.topk(logits, min(top_k, logits.numel()))
            nxt = i[torch.multinomial(torch.softmax(v, -1), 1, generator=gen)].item()
            ids.append(nxt)
        return tok.decode(ids)

    # --- collectives ------------------------------------------------------------------------------

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def all_reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and self.dp_size > 1:
            t = t.clone()
            dist.all_reduce(t, group=self.dims.dp_group)
            t /= self.dp_size
        return t

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and self.dp_size > 1:
            t = t.clone()
            dist.all_reduce(t, group=self.dims.dp_group)
        return t

    def close(self) -> None:
        self.metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _restart_safe_store(world_size: int):
    """None (torch's default rendezvous), except in a worker that torchrun restarted while
    sharing its rendezvous store with the workers: that store still holds the previous attempt's
    keys, and the new ranks would read the dead ranks' addresses and hang connecting to them
    (pytorch#135712; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on torchrun avoids it too). A key
    prefix per restart attempt keeps the attempts apart."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == 0:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False)
    return dist.PrefixStore(f"moetrain/attempt_{attempt}", store)


def _collective_site(exc: BaseException) -> str:
    """The operation that failed, from the traceback: the torch.distributed call (or, for
    collectives torch issues itself, the innermost torch function) with its source line, and
    the moetrain line that led there. E.g. ``torch.distributed.all_to_all_single: `work.wait()`
    from moetrain/distributed/expert_parallel.py:412 (_exchange_counts)``."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "unknown operation"
    paths = [f.filename.replace(os.sep, "/") for f in frames]
    op = where = None
    for f, path in zip(reversed(frames), reversed(paths)):
        public = not f.name.startswith("_") and f.name != "wrapper"  # skip torch's logging decorators
        if op is None and "/torch/distributed/" in path and public:
            op = f"torch.distributed.{f.name}"
        if where is None and "/moetrain/" in path and not path.endswith("/train/trainer.py"):
            where = f"moetrain/{path.rsplit('/moetrain/', 1)[1]}:{f.lineno} ({f.name})"
    inner, inner_path = frames[-1], paths[-1]
    if op is None:
        if inner_path.endswith("/nn/parallel/distributed.py"):
            op = f"DistributedDataParallel.{inner.name}"
        elif "/torch/autograd/" in inner_path:
            op = "a gradient collective in backward (DDP all-reduce or expert all-to-all)"
        else:
            op = inner.name
    text = f"{op}: `{inner.line.strip()}`" if inner.line else op
    return f"{text} from {where}" if where else text


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
