"""The training loop, as a class whose steps are named and can be read top to bottom.

    trainer = Trainer(cfg)       # setup_distributed -> setup_run_dir -> build_data -> build_model
                                 #   -> build_optimizer -> build_checkpointing (resume) -> build_logging
    trainer.fit()                # train_step x N, evaluate every train.eval_every, log every log.every,
                                 #   save every checkpoint.every, at the end and on SIGTERM
    trainer.close()

One optimizer step, from data to update: ``train_step`` -> for each micro-batch ``next_batch`` and
``forward_backward`` -> ``optimizer_step`` (unscale, clip, agree with the other ranks, step) ->
``_account_step`` (counters, the metrics window, the last good state).

Runs standalone (one process) or under torchrun (one or many nodes); the parallel layout comes
from ``cfg.parallel`` through ``ParallelDims``, and the model code never knows about it. The
process group and its timeouts live in ``moetrain.distributed.runtime``; non-finite steps,
SIGTERM and failed collectives in ``moetrain.train.faults``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from pathlib import Path

import torch

from moetrain.config import JobConfig
from moetrain.config.loader import config_to_dict, save_config
from moetrain.data import prepare_data
from moetrain.distributed import data_parallel, runtime
from moetrain.distributed.data_parallel import no_sync, wrap_optimizer, zero_settings
from moetrain.distributed.expert_parallel import collect_comm_stats
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.distributed.parallelize import collect_comm_times, enable_comm_timing, parallelize
from moetrain.distributed.utils import clip_global_grad_norm_, mean_over_dp
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
from moetrain.train.faults import Phase, SkipCounter, StopRequest, agree_on_step
from moetrain.train.flops import peak_flops
from moetrain.train.generation import sample_text
from moetrain.train.metrics import MetricsLogger, MetricsWindow, ProgressBar, StepSums, run_tags
from moetrain.train.optim import build_optimizer, build_scheduler
from moetrain.train.precision import DynamicLossScaler, autocast_context
from moetrain.utils.memory import MemoryTracker

log = logging.getLogger("moetrain")


class Trainer:
    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.setup_distributed()
        self.setup_run_dir()
        self.build_data()
        self.build_model()
        self.build_optimizer()
        # The long setup (rank 0 preparing the data) is over: collectives time out from here on.
        runtime.set_collective_timeout(cfg.train.collective_timeout_s, self.dims)
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
        proc = runtime.init_runtime(device=cfg.train.device, backend=cfg.parallel.backend,
                                    deterministic=cfg.train.deterministic)
        self.world_size, self.rank, self.local_rank = proc.world_size, proc.rank, proc.local_rank
        self.device, self.is_main = proc.device, proc.is_main
        self.dims: ParallelDims = ParallelDims.from_config(
            cfg.parallel, world_size=self.world_size, num_experts=cfg.moe.num_experts if cfg.model.is_moe else None)
        self.dims.build_mesh(self.device.type)
        self.dp_size, self.dp_rank = self.dims.dp, self.dims.dp_rank
        self.grad_accum = cfg.train.grad_accum_steps(self.dp_size)
        self.phase = Phase(rank=self.rank, timeout_s=cfg.train.collective_timeout_s)
        self.stop = StopRequest(rank=self.rank)
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
        # The loader's position counts optimizer steps of the global batch, so a checkpoint
        # resumes at another data-parallel size with the same batches (the accumulation adapts).
        self.train_loader = self.data.train_loader(global_batch_size=t.global_batch_size, micro_steps=self.grad_accum,
                                                   dp_rank=self.dp_rank, dp_size=self.dp_size, seed=t.seed)
        self.val_loader = self.data.val_loader(global_batch_size=t.micro_batch_size * self.dp_size,
                                               dp_rank=self.dp_rank, dp_size=self.dp_size)

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
                                          compile=t.compile, grad_compression=cfg.dp.grad_compression,
                                          **zero_settings(cfg))

    def build_optimizer(self) -> None:
        o, t = self.cfg.optim, self.cfg.train
        # ZeRO-1 shards the optimizer state (dense over dp, experts over edp); other stages pass
        # the optimizer through (FSDP2 parameters are already shards).
        self.optimizer = wrap_optimizer(
            build_optimizer(self.model, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps,
                            data_parallel=self.parallel_model, onebit_warmup_steps=self.cfg.dp.onebit_warmup(t.steps)),
            self.dims, zero_stage=self.cfg.parallel.zero_stage,
            offload_optimizer=self.cfg.zero.offload_optimizer == "cpu", bucket_numel=self.cfg.zero.allgather_bucket_size)
        self.scheduler = build_scheduler(self.optimizer, lr=o.lr, min_lr=o.resolved_min_lr,
                                         warmup_steps=o.warmup_steps, total_steps=t.steps, schedule=o.schedule)
        self.scaler = DynamicLossScaler(enabled=t.dtype == "fp16")
        if self.cfg.log.comm_timing:
            enable_comm_timing(self.model, self.parallel_model, self.optimizer, self.device)
        # Router-bias updates, dynamic capacity, per-expert LR and the health monitor run in
        # optimizer pre/post-step hooks, so gradient accumulation and skipped steps are handled.
        self.balancer = install_balancing(self.optimizer, self.model, self.dims) if self.model_config.is_moe else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.grad_norm: torch.Tensor | None = None

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
            loaded = load_checkpoint(path, model=self.model, optimizer=self.optimizer)
        data_parallel.load_grad_compression_state(self.parallel_model, loaded.grad_compression_state)
        state = loaded.trainer_state
        self.train_loader.load_state_dict(state["data"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step = loaded.step
        self.skips.total = int(state.get("skipped_total", 0))
        if self.balancer is not None and "balancer" in state:
            self.balancer.load_state_dict(state["balancer"])
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

    def build_logging(self) -> None:
        lc = self.cfg.log
        # metrics.jsonl of a resumed run reads like that of a run that never stopped.
        self.metrics = MetricsLogger(self.run_dir, enabled=self.is_main and lc.jsonl, tensorboard=lc.tensorboard,
                                     keep_until_step=self.step if self.resumed_from is not None else None,
                                     tags=run_tags(self.cfg.moe if self.model_config.is_moe else None))
        if self.layout_change is not None:
            self.metrics.log(self.step, self.layout_change)
        self.peak_flops = peak_flops(self.device, self.cfg.train.dtype)
        self.memory_metrics: dict = {}
        self.window = MetricsWindow()
        pc = self.param_counts
        log.info("model: %.2fM parameters (%.2fM active per token, %.2fM in experts); world %d = dp %d x ep %d; "
                 "%d micro-batch(es) of %d per step; run dir %s", pc.total / 1e6, pc.active / 1e6, pc.expert / 1e6,
                 self.world_size, self.dp_size, self.dims.ep, self.grad_accum, self.cfg.train.micro_batch_size,
                 self.run_dir)

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
        if self.balancer is not None:
            # Taken now, not in the snapshot: skipped steps do not change it, and reading it is a
            # collective (the snapshot is taken after every step).
            trainer_state["balancer"] = self.balancer.state_dict()
        layout = {"world_size": self.world_size, "dp": self.dp_size, "ep": self.dims.ep,
                  "zero_stage": self.cfg.parallel.zero_stage}
        with self.phase(f"saving the checkpoint of step {snap['step']}"):
            path = save_checkpoint(self.ckpt_dir, snap["step"], model=self.model, optimizer=self.optimizer,
                                   trainer_state=trainer_state, rng_state=rng,
                                   keep_last=self.cfg.checkpoint.keep_last, layout=layout,
                                   grad_compression_state=data_parallel.grad_compression_state(self.parallel_model))
        self._last_saved_step = snap["step"]
        return path

    # --- one optimizer step -----------------------------------------------------------------------

    def train_step(self) -> None:
        self.parallel_model.train()
        self._step_sums = StepSums()
        # Memory is measured on log steps only (a dispatch-mode tracker slows the step it
        # watches), and not in the first two steps, where DDP still rebuilds its buckets.
        track = self.cfg.log.memory and self.step + 1 >= 3 and (self.step + 1) % self.cfg.log.every == 0
        tracker = MemoryTracker(self.parallel_model, self.optimizer) if track else contextlib.nullcontext()
        with tracker:
            with self.phase(f"forward/backward of step {self.step + 1}"):
                for micro in range(self.grad_accum):
                    input_ids_BS, labels_BS = self.train_loader.next_batch()
                    input_ids_BS, labels_BS = input_ids_BS.to(self.device), labels_BS.to(self.device)
                    # No gradient reduction on the non-final micro-steps: gradients accumulate locally.
                    last_micro = micro == self.grad_accum - 1
                    with contextlib.nullcontext() if last_micro else no_sync(self.parallel_model):
                        self.forward_backward(input_ids_BS, labels_BS)
            with self.phase(f"optimizer step {self.step + 1}"):
                good = self.optimizer_step()
        if track:
            self.memory_metrics = tracker.report().as_metrics()
        self._account_step(good)

    def forward_backward(self, input_ids_BS: torch.Tensor, labels_BS: torch.Tensor) -> None:
        with autocast_context(self.device, self.cfg.train.dtype):
            out = self.parallel_model(input_ids_BS, labels_BS)
        # Each micro-step's loss is a mean over its tokens; dividing by the accumulation count
        # makes the summed gradient the gradient of the mean over the whole step.
        loss = out.total_loss / self.grad_accum
        self.scaler.scale_loss(loss).backward()
        self._step_sums.add("loss", out.loss.float())
        self._step_sums.add("aux", out.aux_loss.float())

    def optimizer_step(self) -> bool:
        """Unscale, clip and step, unless the loss or a gradient is not finite on some rank; then
        every rank skips the update. Returns whether the step was taken."""
        finite = self.scaler.unscale_and_check(self.params)
        self.grad_norm = clip_global_grad_norm_(self.params, self.cfg.optim.grad_clip)
        good, stop = agree_on_step(grad_norm=self.grad_norm, loss=self._step_sums.loss, finite=finite,
                                   stop=self.stop, device=self.device)
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

    def _account_step(self, good: bool) -> None:
        self.step += 1
        self.window.add_step(self._step_sums if good else None,
                             tokens=self.cfg.train.global_batch_size * self.cfg.data.seq_len)
        self.skips.record(self.step, good=good)
        if good:
            self._last_good = self._snapshot()

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
        val_loss = mean_over_dp(total / max(num, 1), self.dims).item()
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}

    # --- logging ----------------------------------------------------------------------------------

    def collect_metrics(self) -> dict:
        """Turn the window's device sums into numbers: the one host sync per log step."""
        w = self.window
        good = w.steps - w.skipped
        if good > 0:
            loss = mean_over_dp(w.loss / (good * self.grad_accum), self.dims).item()
            aux = mean_over_dp(w.aux / (good * self.grad_accum), self.dims).item()
        else:
            loss = aux = float("nan")  # every step of the window was skipped
        m = {"loss": loss, "aux_loss": aux, "lr": self.scheduler.get_last_lr()[0],
             "grad_norm": float(self.grad_norm) if self.grad_norm is not None else None,
             **w.throughput(seq_len=self.cfg.data.seq_len, num_ranks=self.world_size,
                            flops_per_token=self.flops_per_token, peak_flops=self.peak_flops),
             "skipped_steps": w.skipped, "skipped_steps_total": self.skips.total}
        if self.cfg.train.dtype == "fp16":
            m["loss_scale"] = self.scaler.scale
        if self.balancer is not None:
            # Expert load, drops, entropy, unused experts, collapse alarms (a collective).
            m.update(self.balancer.metrics())
        m.update(data_parallel.grad_comm_metrics(self.parallel_model))  # grad_bytes, grad_bytes_ratio_vs_fp32
        m.update(self.memory_metrics)
        self.memory_metrics = {}
        if self.dims.ep_enabled:
            m.update(collect_comm_stats(self.model).as_metrics())  # over the window
            m["a2a_bytes_per_step"] = m["a2a_bytes"] / max(w.steps, 1)
        times = collect_comm_times(self.model, self.parallel_model, self.optimizer)
        m.update({k: v / max(w.steps, 1) for k, v in times.items()})  # per step
        self.window = MetricsWindow()
        return m

    # --- the loop ---------------------------------------------------------------------------------

    def fit(self) -> dict:
        """Train from ``self.step`` to ``train.steps``. Returns the last logged metrics. On SIGTERM
        (any rank) the ranks finish the current step, log it (even off the log.every cadence, so
        no step goes unreported), save a checkpoint and return with ``self.interrupted`` set."""
        t, lc, c = self.cfg.train, self.cfg.log, self.cfg.checkpoint
        bar = ProgressBar(enabled=self.is_main and lc.progress_bar, total=t.steps, initial=self.step)
        last = {}
        with self.stop.installed():
            while self.step < t.steps:
                self.train_step()
                is_last = self.step == t.steps
                if self.step % lc.every == 0 or is_last or self.interrupted or self.skips.halt:
                    last = self.log_step(evaluate=t.eval_every > 0 and (self.step % t.eval_every == 0 or is_last))
                    bar.show(last)
                bar.update()
                if self.skips.halt:
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
        bar.close()
        return last

    def log_step(self, *, evaluate: bool) -> dict:
        """Collect (and, with ``evaluate``, add the validation loss to) the metrics of the step
        just taken, and write them. Collective."""
        with self.phase(f"metrics of step {self.step}"):
            metrics = self.collect_metrics()
            if evaluate:
                metrics.update(self.evaluate())
        self.metrics.log(self.step, metrics)
        return metrics

    def _halt_nonfinite(self) -> None:
        """Stop after ``train.max_consecutive_skips`` skipped steps in a row, with the last good
        state saved: the current weights (the skipped steps left them as they were) with the
        step, data position, schedule and RNG of the last step taken."""
        good = self._last_good
        path = self.ckpt_dir / step_dir_name(good["step"])
        if self._last_saved_step != good["step"] or not path.exists():
            path = self.save_checkpoint(good)
        raise self.skips.error(self.step, last_good_step=good["step"], path=path)

    def generate(self, prompt: str, *, max_new_tokens: int = 100, temperature: float = 0.8, top_k: int = 50,
                 seed: int = 0) -> str:
        """Sample a continuation (collective: every rank runs the same computation)."""
        if self.data.tokenizer is None:
            raise ValueError("data.path holds pre-tokenised .bin files: no tokenizer to decode samples")
        self.parallel_model.eval()
        return sample_text(self.model, self.data.tokenizer, prompt, context=self.cfg.data.seq_len,
                           device=self.device, fallback_id=self.data.eos_id or 0, max_new_tokens=max_new_tokens,
                           temperature=temperature, top_k=top_k, seed=seed)

    def barrier(self) -> None:
        runtime.barrier()

    def close(self) -> None:
        self.metrics.close()
        runtime.shutdown()
