"""The training loop, as a class whose steps are named and can be read top to bottom.

    trainer = Trainer(cfg)       # setup_distributed -> setup_run_dir -> build_data -> build_model
                                 #   -> build_optimizer -> build_checkpointing (resume) -> build_logging
    trainer.fit()                # train_step x N, evaluate every train.eval_every, log every log.every,
                                 #   save every checkpoint.every, at the end and on SIGTERM
    trainer.close()

One optimizer step, from data to update: ``train_step`` -> for each micro-batch ``next_batch`` and
``forward_backward`` -> ``optimizer_step`` (unscale, clip, agree with the other ranks, step) ->
``_account_step`` (counters, the metrics window, the last good state).

Runs standalone or under torchrun (one or many nodes); the layout comes from ``cfg.parallel`` through
``ParallelDims`` (the model code never knows it); the process group lives in ``distributed.runtime``,
non-finite steps, SIGTERM and failed collectives in ``.faults``, the task's data, loss and evaluation in ``.task``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch
from torch import nn

from moetrain.config import JobConfig
from moetrain.config.convert import config_to_dict
from moetrain.distributed import runtime
from moetrain.distributed.comm.collectives import mean_over_dp
from moetrain.distributed.data_parallel import ddp as data_parallel
from moetrain.distributed.data_parallel.ddp import no_sync, wrap_optimizer, zero_settings
from moetrain.distributed.data_parallel.finalize import finalize_grads
from moetrain.distributed.data_parallel.grads import clip_global_grad_norm_
from moetrain.distributed.expert_parallel.apply import collect_comm_stats
from moetrain.distributed.expert_parallel.rebalance import Rebalancer, rebalance_settings
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.distributed.parallelize import collect_comm_times, enable_comm_timing, parallelize
from moetrain.train.balancing import install_balancing
from moetrain.train.checkpoint.checkpointer import Checkpointer, Resumed, TrainingObjects
from moetrain.train.checkpoint.files import prepare_checkpoint_folder
from moetrain.train.classification import classification_loss, describe_classes
from moetrain.train.evaluate import evaluate_classifier, evaluate_lm
from moetrain.train.faults import Phase, SkipCounter, StopRequest, agree_on_step
from moetrain.train.flops import peak_flops
from moetrain.train.init_from import load_initial_weights
from moetrain.train.metrics import MetricsLogger, MetricsWindow, ProgressBar, StepSums, run_tags
from moetrain.train.optim import build_optimizer, build_scheduler, optimizer_settings
from moetrain.train.pipeline_step import PipelineStep, build_pipeline, next_step_batch
from moetrain.train.precision import DynamicLossScaler, autocast_context
from moetrain.train.rng_state import restore_rng_state, seed_rng_state
from moetrain.train.routing_trace import RoutingHooks, build_routing_hooks
from moetrain.train.task import build_loaders, build_model, build_task_data, is_classifier, write_run_record
from moetrain.train.trackers import build_trackers
from moetrain.train.weight_average import WeightAverage
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
        resumed = self.build_checkpointing()
        self.build_logging(resumed)
        # Last: setup draws random numbers (the peak-FLOPs probe), which would advance a
        # restored or freshly seeded RNG state.
        if resumed is not None and resumed.rng_state is not None:
            restore_rng_state(resumed.rng_state, seed=cfg.train.seed, rank=self.rank)
        else:
            seed_rng_state(cfg.train.seed, self.rank)
        self._last_good = self.snapshot()

    # --- setup ------------------------------------------------------------------------------------

    def setup_distributed(self) -> None:
        cfg = self.cfg
        proc = runtime.init_job_runtime(cfg)
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
        if self.is_main:  # its record is written once the run has started (write_run_record)
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.barrier()

    def build_data(self) -> None:
        self.classifier = is_classifier(self.cfg)
        self.data = build_task_data(self.cfg, is_main=self.is_main)
        self.train_loader, self.val_loader = build_loaders(self.cfg, self.data, grad_accum=self.grad_accum,
                                                           dp_rank=self.dp_rank, dp_size=self.dp_size)
        if self.classifier:
            num_classes = self.cfg.model.num_classes
            assert num_classes is not None  # ModelConfig requires it of a classifier head
            describe_classes(self.data, num_classes=num_classes, run_dir=None)

    def build_model(self) -> None:
        cfg = self.cfg
        # The full model on every rank (same seed, same global weights); parallelize shards it.
        self.model_config, full = build_model(cfg, self.data)
        full.to(self.device)
        self.param_counts = full.param_counts()
        self.flops_per_token = full.flops_per_token(cfg.data.seq_len)
        # This rank's model, unwrapped: the whole of it, or its pipeline stages.
        self.model: nn.Module = full
        self.parallel_model: nn.Module
        t = cfg.train
        self.pipeline: PipelineStep | None = None
        init_from = cfg.checkpoint.init_from
        if self.dims.pp > 1:  # this rank's stages, under a schedule (train/pipeline_step.py)
            if init_from is not None:
                # Into the whole model, whose names the export's are; the stages keep theirs.
                load_initial_weights(full, init_from, new_head=cfg.checkpoint.init_from_new_head)
            self.model, self.pipeline = build_pipeline(full, self.dims, cfg, grad_accum=self.grad_accum,
                                                       device=self.device)
            self.parallel_model = self.model
        else:
            self.parallel_model = parallelize(self.model, self.dims,
                                              activation_checkpointing=t.activation_checkpointing,
                                              activation_checkpointing_every=t.activation_checkpointing_every,
                                              compile=t.compile, grad_compression=cfg.dp.grad_compression,
                                              **zero_settings(cfg))
        if init_from is not None and self.dims.pp == 1:
            # A fresh run starts from an export's weights; a resume replaces them afterwards.
            load_initial_weights(self.model, init_from, new_head=cfg.checkpoint.init_from_new_head)

    def build_optimizer(self) -> None:
        o, t = self.cfg.optim, self.cfg.train
        # ZeRO-1 shards the optimizer state (dense over dp, experts over edp); other stages pass
        # the optimizer through (FSDP2 parameters are already shards).
        self.optimizer = wrap_optimizer(
            build_optimizer(self.model, **optimizer_settings(o), data_parallel=self.parallel_model,
                            onebit_warmup_steps=self.cfg.dp.onebit_warmup(t.steps)),
            self.dims, zero_stage=self.cfg.parallel.zero_stage,
            offload_optimizer=self.cfg.zero.offload_optimizer == "cpu", pin_memory=self.cfg.zero.pin_memory,
            bucket_numel=self.cfg.zero.allgather_bucket_size)
        self.scheduler = build_scheduler(self.optimizer, lr=o.lr, min_lr=o.resolved_min_lr,
                                         warmup_steps=o.warmup_steps, total_steps=t.steps, schedule=o.schedule)
        self.scaler = DynamicLossScaler(enabled=t.dtype == "fp16")
        if self.cfg.log.comm_timing:
            enable_comm_timing(self.model, self.parallel_model, self.optimizer, self.device)
        # Router-bias updates, dynamic capacity, per-expert LR and the health monitor run in
        # optimizer pre/post-step hooks, so gradient accumulation and skipped steps are handled.
        self.balancer = install_balancing(self.optimizer, self.model, self.dims) if self.model_config.is_moe else None
        self.params: list[torch.Tensor] = [p for p in self.model.parameters() if p.requires_grad]
        self.grad_norm: torch.Tensor | None = None
        # From the weights as they start (an init_from export's included); a resume replaces it.
        self.ema = WeightAverage(self.model, decay=o.ema_decay) if o.ema_decay > 0 else None

    def build_checkpointing(self) -> Resumed | None:
        """The checkpointer, and the loop's state: from the start, or from where the checkpoint
        ``checkpoint.resume`` picks stopped (the checkpointer has loaded the rest of the state)."""
        c = self.cfg.checkpoint
        self.rebalancer = Rebalancer(self.model, self.dims, run_dir=self.run_dir, **rebalance_settings(self.cfg))
        objects = TrainingObjects(model=self.model, optimizer=self.optimizer, parallel_model=self.parallel_model,
                                  scheduler=self.scheduler, scaler=self.scaler, train_loader=self.train_loader,
                                  balancer=self.balancer, ema=self.ema, rebalancer=self.rebalancer)
        folder = prepare_checkpoint_folder(self.run_dir, c.dir)  # an unusable one stops the run before step 1
        self.checkpointer = Checkpointer(self.cfg, folder=folder, objects=objects, dims=self.dims, phase=self.phase,
                                         vocab_size=self.model_config.vocab_size, is_main=self.is_main)
        self.step = 0
        self.skips = SkipCounter(max_consecutive=self.cfg.train.max_consecutive_skips)
        self.interrupted = False
        resumed = self.checkpointer.resume()
        write_run_record(self.cfg, self.data, self.run_dir, resumed=resumed is not None, is_main=self.is_main)
        self.resumed_from = resumed.path if resumed is not None else None
        if resumed is not None:
            self.step = resumed.step
            self.skips.total = resumed.skipped_total
            if self.step >= self.cfg.train.steps:
                log.info("step %d >= train.steps (%d): nothing left to train (raise train.steps to continue, "
                         "or --checkpoint.resume=never to start over)", self.step, self.cfg.train.steps)
        return resumed

    def build_logging(self, resumed: Resumed | None) -> None:
        lc = self.cfg.log
        # metrics.jsonl of a resumed run reads like that of a run that never stopped.
        trackers = build_trackers(lc, run_dir=self.run_dir, config=config_to_dict(self.cfg)) if self.is_main else []
        self.metrics = MetricsLogger(self.run_dir, enabled=self.is_main and lc.jsonl, tensorboard=lc.tensorboard,
                                     keep_until_step=self.step if resumed is not None else None,
                                     tags=run_tags(self.cfg.moe if self.model_config.is_moe else None),
                                     trackers=trackers, report=lc.report)
        if resumed is not None and resumed.saved_world_size != self.world_size:
            # An elastic restart (or a reshard by hand): same global batch, another accumulation.
            self.metrics.log(self.step, {"event": "world_size_changed", "world_size_before": resumed.saved_world_size,
                                         "world_size": self.world_size, "grad_accum": self.grad_accum})
        # Routing trace and replay (log.routing_trace, moe.routing_replay): a trace that does not fit raises here.
        self.routing = RoutingHooks([]) if not self.model_config.is_moe else build_routing_hooks(
            self.cfg, self.model, run_dir=self.run_dir, rank=self.rank, world_size=self.world_size,
            dp_rank=self.dp_rank, dp_size=self.dp_size, ep=self.dims.ep, grad_accum=self.grad_accum,
            is_main=self.is_main, start_step=self.step, tp=self.dims.tp,
            tp_rank=self.dims.tp_rank if self.dims.tp > 1 else 0)
        self.peak_flops = peak_flops(self.device, self.cfg.train.dtype)
        # Dynamo runs no compiled frame under the tracker (a dispatch mode): a tracked step would be eager.
        self.track_memory = lc.memory and not self.cfg.train.compile
        if lc.memory and not self.track_memory:
            log.info("log.memory: no mem/* peaks under train.compile (compiled code runs no step under the tracker)")
        self.memory_metrics: dict = {}
        self.window = MetricsWindow()
        pc = self.param_counts
        log.info("model: %.2fM parameters (%.2fM active per token, %.2fM in experts); world %d = pp %d x dp %d "
                 "x tp %d, ep %d x etp %d; %d micro-batch(es) of %d per step; run dir %s", pc.total / 1e6,
                 pc.active / 1e6, pc.expert / 1e6, self.world_size, self.dims.pp, self.dp_size, self.dims.tp,
                 self.dims.ep, self.dims.etp, self.grad_accum, self.cfg.train.micro_batch_size, self.run_dir)

    # --- one optimizer step -----------------------------------------------------------------------

    def train_step(self) -> None:
        self.parallel_model.train()
        self._step_sums = StepSums()
        # Memory is measured on log steps only (a dispatch-mode tracker slows the step it
        # watches), and not in the first two steps, where DDP still rebuilds its buckets.
        tracker = None
        if self.track_memory and self.step + 1 >= 3 and (self.step + 1) % self.cfg.log.every == 0:
            averages = self.ema.tensors() if self.ema is not None else ()
            tracker = MemoryTracker(self.parallel_model, self.optimizer, averages)
        self.routing.start_step(self.step + 1)
        with tracker if tracker is not None else contextlib.nullcontext():
            with self.phase(f"forward/backward of step {self.step + 1}"):
                if self.pipeline is not None:  # the schedule runs the step's micro-batches
                    input_ids, labels = next_step_batch(self.train_loader, self.grad_accum, self.device)
                    loss, aux = self.pipeline.forward_backward(input_ids, labels, loss_scale=self.scaler.scale)
                    self._step_sums.add("loss", loss)
                    self._step_sums.add("aux", aux)
                    if self.model_config.mtp_depth > 0:  # each depth's loss summed over the micro-batches
                        self._step_sums.add("mtp", self.pipeline.mtp_sums.float())
                else:
                    for micro in range(self.grad_accum):
                        # (input_ids, labels) of a language model; a classifier's batch adds the padding mask.
                        batch = [x.to(self.device) for x in self.train_loader.next_batch()]
                        # No gradient reduction on the non-final micro-steps: gradients accumulate locally.
                        last_micro = micro == self.grad_accum - 1
                        self.routing.before_micro(micro)
                        with contextlib.nullcontext() if last_micro else no_sync(self.parallel_model):
                            self.forward_backward(*batch)
                    finalize_grads(self.parallel_model, self.dims)
                    self.rebalancer.sum_replica_grads()
            with self.phase(f"optimizer step {self.step + 1}"):
                good = self.optimizer_step()
                self.rebalancer.after_step(self.step + 1, taken=good)
        self.routing.finish_step()
        if tracker is not None:
            self.memory_metrics = tracker.report().as_metrics()
        self._account_step(good)

    def forward_backward(self, input_ids_BS: torch.Tensor, labels: torch.Tensor,
                         padding_mask_BS: torch.Tensor | None = None) -> None:
        """``labels``: next-token ids [B, S] (language model) or class ids [B] (classifier, with the
        right-padding mask [B, S])."""
        with autocast_context(self.device, self.cfg.train.dtype):
            if self.classifier:
                out = self.parallel_model(input_ids_BS, padding_mask_BS=padding_mask_BS)
                task_loss = classification_loss(out.logits, labels, label_smoothing=self.cfg.classify.label_smoothing)
            else:
                out = self.parallel_model(input_ids_BS, labels)
                task_loss = out.loss
        # Each micro-step's loss is a mean over its tokens (examples); dividing by the accumulation
        # count makes the summed gradient the gradient of the mean over the whole step.
        objective = task_loss + out.aux_loss
        if not self.classifier and out.mtp_loss is not None:  # model.mtp_depth > 0
            objective = objective + out.mtp_loss
            self._step_sums.add("mtp", out.mtp_losses.float())
        loss = objective / self.grad_accum
        self.scaler.scale_loss(loss).backward()
        self._step_sums.add("loss", task_loss.float())
        self._step_sums.add("aux", out.aux_loss.float())

    def optimizer_step(self) -> bool:
        """Unscale, clip and step, unless the loss or a gradient is not finite on some rank; then
        every rank skips the update. Returns whether the step was taken."""
        finite = self.scaler.unscale_and_check(self.params)
        clip = clip_global_grad_norm_ if self.pipeline is None else self.pipeline.clip_grad_norm_
        self.grad_norm = clip(self.params, self.cfg.optim.grad_clip)
        good, stop = agree_on_step(grad_norm=self.grad_norm, loss=self._step_sums.loss, finite=finite,
                                   stop=self.stop, device=self.device)
        if good:
            self.optimizer.step()
            if self.ema is not None:
                self.ema.update()
        elif self.balancer is not None:
            self.balancer.discard_step()  # a skipped step's routing counts must not move the bias
        self.scaler.update(good)
        self.step_lr = self.scheduler.get_last_lr()[0]  # this step's, logged with it (Megatron's)
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
            self._last_good = self.snapshot()

    def snapshot(self) -> dict:
        """What a checkpoint of the current step holds besides weights and optimizer (``Checkpointer.snapshot``)."""
        return self.checkpointer.snapshot(step=self.step, skipped_total=self.skips.total)

    # --- evaluation -------------------------------------------------------------------------------

    def evaluate(self, split: str = "val") -> dict:
        """Language model: the loss of ``train.eval_steps`` validation global batches (the same windows
        at every layout). Classifier: every example of ``split`` ("val", or "test" at the end). Collective."""
        self.parallel_model.eval()
        t = self.cfg.train
        num_windows = t.eval_steps * t.global_batch_size
        with self.averaged_weights():
            if self.pipeline is not None:
                return self.pipeline.evaluate(self.val_loader.eval_batches(num_windows))
            if self.classifier:
                return evaluate_classifier(self.model, self.data, split, batch_size=t.micro_batch_size,
                                           dims=self.dims, device=self.device, dtype=t.dtype)
            return evaluate_lm(self.model, self.val_loader.eval_batches(num_windows), dims=self.dims,
                               device=self.device, dtype=t.dtype)

    def averaged_weights(self):
        """With optim.ema_decay, the weight average in the model (replicas included) for the block."""
        return self.rebalancer.around(self.ema.applied()) if self.ema is not None else contextlib.nullcontext()

    # --- logging ----------------------------------------------------------------------------------

    def collect_metrics(self) -> dict:
        """Turn the window's device sums into numbers: one all-reduce and host sync for the losses."""
        w = self.window
        good = w.steps - w.skipped
        loss, aux, per_depth = float("nan"), float("nan"), []  # nan: every step of the window was skipped
        if good > 0:
            assert w.loss is not None and w.aux is not None  # every good step added both
            # The loss, the aux loss and each multi-token depth's loss (mtp_loss_1 ... mtp_loss_D).
            sums = torch.cat([w.loss.reshape(1), w.aux.reshape(1), *([] if w.mtp is None else [w.mtp.reshape(-1)])])
            loss, aux, *per_depth = mean_over_dp(sums / (good * self.grad_accum), self.dims).tolist()
        m = {"loss": loss, "aux_loss": aux, "lr": self.step_lr,
             "grad_norm": float(self.grad_norm) if self.grad_norm is not None else None,
             **w.throughput(seq_len=self.cfg.data.seq_len, num_ranks=self.world_size,
                            flops_per_token=self.flops_per_token, peak_flops=self.peak_flops),
             "skipped_steps": w.skipped, "skipped_steps_total": self.skips.total}
        m.update({f"mtp_loss_{k}": v for k, v in enumerate(per_depth, start=1)})
        if self.cfg.train.dtype == "fp16":
            m["loss_scale"] = self.scaler.scale
        if self.pipeline is not None:  # every stage's layers, and the per-stage timings
            m.update(self.pipeline.metrics(self.balancer))
        elif self.balancer is not None:
            # Expert load, drops, entropy, unused experts, collapse alarms (a collective).
            m.update(self.balancer.metrics())
        m.update(data_parallel.grad_comm_metrics(self.parallel_model))  # grad_bytes, grad_bytes_ratio_vs_fp32
        m.update(self.memory_metrics)
        self.memory_metrics = {}
        m.update(self._comm_since_last_read(w.steps))
        self.window = MetricsWindow()
        return m

    def _comm_since_last_read(self, steps: int) -> dict:
        """The exchanges' bytes and the timed communication since the last read, per step (reading resets them)."""
        m = collect_comm_stats(self.model).as_metrics() if self.dims.ep_enabled or self.dims.etp > 1 else {}
        if m:
            m["a2a_bytes_per_step"] = m["a2a_bytes"] / max(steps, 1)
        times = collect_comm_times(self.model, self.parallel_model, self.optimizer)
        return m | {k: v / max(steps, 1) for k, v in times.items()}

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
                self.checkpointer.poll()  # a checkpoint that failed in the background stops the run here
                self.train_step()
                is_last, saves = self.step == t.steps, c.every > 0 and self.step % c.every == 0
                evals = t.eval_every > 0 and (self.step % t.eval_every == 0 or is_last)
                # A checkpoint step closes the metrics window too (a resume never starts mid-window),
                # and an evaluation step writes its record whatever log.every.
                if self.step % lc.every == 0 or saves or evals or is_last or self.interrupted or self.skips.halt:
                    last = self.log_step(evaluate=evals, test=is_last and self.classifier and t.eval_every > 0)
                    bar.show(last)
                bar.update()
                if self.skips.halt:
                    self._halt_nonfinite()
                if saves or (is_last and c.save_final) or self.interrupted:
                    self.checkpointer.save(self.snapshot())
                if self.window.steps == 0:
                    # Evaluation and checkpointing ran after the window was closed: start the
                    # next throughput window now, so tokens/s measures training alone.
                    self.window.t0 = time.perf_counter()
                if self.interrupted:
                    if self.step < t.steps:
                        log.warning("stopped by signal at step %d; checkpoint saved in %s", self.step,
                                    self.checkpointer.step_path(self.step))
                        break
                    self.interrupted = False  # the signal came with the last step: the run is complete
            self.rebalancer.finish()  # the last replica refresh and rebalance.jsonl records
            self.checkpointer.wait()  # the last save, if written in the background, is published
        bar.close()
        return last

    def log_step(self, *, evaluate: bool, test: bool = False) -> dict:
        """Collect (and, with ``evaluate``, add the validation metrics to; with ``test``, the test
        split's) the metrics of the step just taken, and write them. Collective."""
        with self.phase(f"metrics of step {self.step}"):
            metrics = self.collect_metrics()
            if evaluate:
                metrics.update(self.evaluate())
            if test:
                metrics.update(self.evaluate("test"))
            if evaluate or test:  # evaluation's exchanges are no window's: the next counts its training alone
                self._comm_since_last_read(1)
                if self.pipeline is not None:  # and its stages' forward spans
                    self.pipeline.discard_timings()
        self.metrics.log(self.step, metrics)
        return metrics

    def _halt_nonfinite(self) -> None:
        """Stop after ``train.max_consecutive_skips`` skipped steps in a row, with the last good
        state saved: the current weights (the skipped steps left them as they were) with the
        step, data position, schedule and RNG of the last step taken."""
        good = self._last_good
        path = self.checkpointer.saved(good["step"]) or self.checkpointer.save(good, wait=True)
        raise self.skips.error(self.step, last_good_step=good["step"], path=path)

    def barrier(self) -> None:
        runtime.barrier()

    def close(self) -> None:
        self.metrics.close()
        runtime.shutdown()
