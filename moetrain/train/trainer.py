"""The training loop, as a class whose steps are named and can be read top to bottom.

    trainer = Trainer(cfg)       # setup_distributed -> build_data -> build_model -> build_optimizer
    trainer.fit()                # train_step x N, evaluate every train.eval_every, log every log.every
    trainer.close()

Runs standalone (one process) or under torchrun (one or many nodes); the parallel layout comes
from ``cfg.parallel`` through ``ParallelDims``, and the model code never knows about it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from moetrain.config import JobConfig
from moetrain.config.loader import save_config
from moetrain.config.train import resolve_device
from moetrain.data import prepare_data
from moetrain.distributed.data_parallel import no_sync
from moetrain.distributed.expert_parallel import collect_comm_stats
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.distributed.parallelize import parallelize
from moetrain.models.transformer import Transformer
from moetrain.train.flops import peak_flops
from moetrain.train.metrics import MetricsLogger, expert_load_summary
from moetrain.train.optim import build_optimizer, build_scheduler, clip_grad_norm_
from moetrain.train.precision import DynamicLossScaler, autocast_context
from moetrain.utils.cpu_allocator import tune_cpu_allocator

log = logging.getLogger("moetrain")


@dataclass
class _Window:
    """Device-side sums over the steps since the last log; read once per log step (host sync)."""

    loss: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    routed_LE: torch.Tensor | None = None
    dropped_L: torch.Tensor | None = None
    routed_L: list[int] = field(default_factory=list)
    steps: int = 0
    skipped: int = 0
    tokens: int = 0
    t0: float = field(default_factory=time.perf_counter)

    def add(self, name: str, value: torch.Tensor) -> None:
        cur = getattr(self, name)
        setattr(self, name, value.detach().clone() if cur is None else cur + value.detach())


class Trainer:
    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.setup_distributed()
        self.setup_run_dir()
        self.build_data()
        self.build_model()
        self.build_optimizer()
        self.build_logging()
        self.step = 0

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
            if self.world_size > 1:
                dist.init_process_group(backend=backend, device_id=self.device if backend == "nccl" else None)
            else:
                # One process: an in-memory store, no port; the mesh and collectives still work.
                dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        self.dims = ParallelDims.from_config(cfg.parallel, world_size=self.world_size,
                                             num_experts=cfg.moe.num_experts if cfg.model.is_moe else None)
        self.dims.build_mesh(self.device.type)
        self.dp_size, self.dp_rank = self.dims.dp, self.dims.dp_rank
        self.grad_accum = cfg.train.grad_accum_steps(self.dp_size)
        self.is_main = self.rank == 0
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
        model_cfg = cfg.model.with_vocab_size(self.data.vocab_size)
        # Every rank builds the full model from the same seed; parallelize then shards it, so
        # the global weights are the same for every layout.
        self.model = Transformer(model_cfg, moe=cfg.moe if model_cfg.is_moe else None, seed=cfg.train.seed)
        self.model.to(self.device)
        self.param_counts = self.model.param_counts()
        self.flops_per_token = self.model.flops_per_token(cfg.data.seq_len)
        ac = cfg.train.activation_checkpointing
        self.parallel_model = parallelize(self.model, self.dims, activation_checkpointing=ac != "none",
                                          compile=cfg.train.compile, blocks=self._ac_blocks)
        self.moe_layers = [blk.feed_forward for blk in self.model.layers if blk.is_moe]

    def _ac_blocks(self, model) -> list:
        ac, every = self.cfg.train.activation_checkpointing, self.cfg.train.activation_checkpointing_every
        blocks = list(model.layers)
        if ac == "moe":
            return [b.feed_forward for b in blocks if b.is_moe]
        if ac == "every_n":
            return blocks[::every]
        return blocks

    def build_optimizer(self) -> None:
        o, t = self.cfg.optim, self.cfg.train
        self.optimizer = build_optimizer(self.model, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas),
                                         eps=o.eps)
        self.scheduler = build_scheduler(self.optimizer, lr=o.lr, min_lr=o.resolved_min_lr,
                                         warmup_steps=o.warmup_steps, total_steps=t.steps, schedule=o.schedule)
        self.scaler = DynamicLossScaler(enabled=t.dtype == "fp16")
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def build_logging(self) -> None:
        lc = self.cfg.log
        self.metrics = MetricsLogger(self.run_dir, enabled=self.is_main and lc.jsonl, tensorboard=lc.tensorboard)
        self.peak_flops = peak_flops(self.device, self.cfg.train.dtype)
        self.window = _Window()
        pc = self.param_counts
        log.info("model: %.2fM parameters (%.2fM active per token, %.2fM in experts); world %d = dp %d x ep %d; "
                 "%d micro-batch(es) of %d per step; run dir %s", pc.total / 1e6, pc.active / 1e6, pc.expert / 1e6,
                 self.world_size, self.dp_size, self.dims.ep, self.grad_accum, self.cfg.train.micro_batch_size,
                 self.run_dir)

    # --- one optimizer step -----------------------------------------------------------------------

    def forward_backward(self, input_ids_BS: torch.Tensor, labels_BS: torch.Tensor) -> None:
        with autocast_context(self.device, self.cfg.train.dtype):
            out = self.parallel_model(input_ids_BS, labels_BS)
        # Each micro-step's loss is a mean over its tokens; dividing by the accumulation count
        # makes the summed gradient the gradient of the mean over the whole step.
        loss = out.total_loss / self.grad_accum
        self.scaler.scale_loss(loss).backward()
        w = self.window
        w.add("loss", out.loss.float())
        w.add("aux", out.aux_loss.float())
        if out.moe_aux:
            w.add("routed_LE", torch.stack([a.num_routed_per_expert for a in out.moe_aux]))
            w.add("dropped_L", torch.stack([a.num_dropped for a in out.moe_aux]))
            w.routed_L = [a.num_routed for a in out.moe_aux]

    def train_step(self) -> None:
        self.parallel_model.train()
        for micro in range(self.grad_accum):
            input_ids_BS, labels_BS = self.train_loader.next_batch()
            input_ids_BS, labels_BS = input_ids_BS.to(self.device), labels_BS.to(self.device)
            # No gradient reduction on the non-final micro-steps: gradients accumulate locally.
            sync = micro == self.grad_accum - 1
            with (no_sync(self.parallel_model) if not sync else _null()):
                self.forward_backward(input_ids_BS, labels_BS)
        self.optimizer_step()
        self.window.steps += 1
        self.window.tokens += self.cfg.train.global_batch_size * self.cfg.data.seq_len
        self.step += 1

    def optimizer_step(self) -> None:
        finite = self.scaler.unscale_and_check(self.params)
        if finite:
            self.grad_norm = clip_grad_norm_(self.params, self.cfg.optim.grad_clip)
            self.optimizer.step()
        else:
            self.window.skipped += 1
        self.scaler.update(finite)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

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
        loss = self.all_reduce_mean(w.loss / (w.steps * self.grad_accum)).item()
        aux = self.all_reduce_mean(w.aux / (w.steps * self.grad_accum)).item()
        tokens_per_s = w.tokens / dt
        m = {
            "loss": loss, "aux_loss": aux, "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(self.grad_norm) if hasattr(self, "grad_norm") else None,
            "tokens_per_s": tokens_per_s, "samples_per_s": tokens_per_s / self.cfg.data.seq_len,
            "step_time_s": dt / w.steps,
            "mfu": tokens_per_s / self.world_size * self.flops_per_token / self.peak_flops,
            "skipped_steps": w.skipped,
        }
        if self.cfg.train.dtype == "fp16":
            m["loss_scale"] = self.scaler.scale
        if w.routed_LE is not None:
            # The layers' counts are already summed over the data-parallel ranks (balance_group).
            routed_LE = w.routed_LE.cpu()
            m.update(expert_load_summary(routed_LE))
            dropped_L = self.all_reduce_sum(w.dropped_L.float()).cpu()
            m["dropped_fraction"] = (dropped_L / routed_LE.sum(dim=1).clamp(min=1).double()).tolist()
        if self.dims.ep_enabled:
            stats = collect_comm_stats(self.model)
            m["a2a_bytes"] = stats.bytes_sent + stats.bytes_received
            m["a2a_bytes_ratio"] = stats.ratio
        self.window = _Window()
        return m

    # --- the loop ---------------------------------------------------------------------------------

    def fit(self) -> dict:
        t, lc = self.cfg.train, self.cfg.log
        bar = None
        if self.is_main and lc.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=t.steps, initial=self.step, desc="train", dynamic_ncols=True)
        last = {}
        while self.step < t.steps:
            self.train_step()
            is_last = self.step == t.steps
            if self.step % lc.every == 0 or is_last:
                last = self.collect_metrics()
                if t.eval_every and (self.step % t.eval_every == 0 or is_last):
                    last.update(self.evaluate())
                self.metrics.log(self.step, last)
                if bar is not None:
                    bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}",
                                    **({"val": f"{last['val_loss']:.3f}"} if "val_loss" in last else {}))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return last

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


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
