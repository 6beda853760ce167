"""Evaluation: the language model's loss and perplexity, the classifier's metrics over a whole split,
and ``evaluate_run`` (what `moetrain eval RUN` runs on every rank).

The trainer evaluates the live model; ``evaluate_run`` rebuilds the model of a saved run at this
job's process count and reads a checkpoint into it through the same DCP resharding as a training
resume, so a run trained on 2 processes with ep=2 (or tp=2, or pp=2) evaluates on 1 (or 4) to the
same numbers: the layout is folded to fit the process count (``eval_layout``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moetrain.config import JobConfig
from moetrain.config.checkpoint import checkpoint_folder
from moetrain.config.loader import load_config
from moetrain.data.classify_data import PreparedLabelled
from moetrain.distributed import runtime
from moetrain.distributed.comm.collectives import comm_device
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.distributed.parallelize import parallelize
from moetrain.models.transformer import IGNORE_INDEX
from moetrain.train.checkpoint.files import latest_checkpoint, resolve_checkpoint
from moetrain.train.checkpoint.state import load_checkpoint
from moetrain.train.classification import check_run_classes, confusion_matrix, metrics_from_confusion
from moetrain.train.optim import build_optimizer, optimizer_settings
from moetrain.train.precision import autocast_context
from moetrain.train.task import build_model, build_task_data, is_classifier
from moetrain.train.weight_average import WeightAverage
from moetrain.utils.files import atomic_write_text

log = logging.getLogger("moetrain")


@torch.no_grad()
def evaluate_lm(model: nn.Module, batches, *, dims: ParallelDims, device: torch.device, dtype: str) -> dict:
    """Mean next-token loss per scored token over ``batches`` (this rank's (input_ids, labels,
    valid rows) of a loader's ``eval_batches``), over every data-parallel rank: the rows' token
    losses and counts are summed, so a partial last batch weighs what it holds."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    num_tokens = 0
    for input_ids_BS, labels_BS, valid_B in batches:
        labels_BS = score_valid_rows(labels_BS, valid_B)
        n = int((labels_BS != IGNORE_INDEX).sum())  # host tensors: no device sync
        with autocast_context(device, dtype):
            out = model(input_ids_BS.to(device), labels_BS.to(device))
        if n:  # a rank's batch of padding rows still runs: its forward's collectives pair up
            loss_sum += out.loss.double() * n
        num_tokens += n
    return lm_metrics(loss_sum, num_tokens, dims)


def score_valid_rows(labels_BS: torch.Tensor, valid_B: torch.Tensor) -> torch.Tensor:
    """``labels_BS`` with the padding rows of a partial evaluation batch not scored."""
    return labels_BS.masked_fill(~valid_B[:, None], IGNORE_INDEX)


def lm_metrics(loss_sum: torch.Tensor, num_tokens: int, dims: ParallelDims) -> dict:
    """val_loss and val_ppl from this rank's summed token losses and token count, summed over dp."""
    totals = torch.stack([loss_sum.double(), torch.tensor(float(num_tokens), dtype=torch.float64,
                                                          device=loss_sum.device)])
    totals = totals.to(comm_device(dims))
    if dims.dp > 1:
        dist.all_reduce(totals, group=dims.group("dp"))
    val_loss = (totals[0] / totals[1].clamp(min=1)).item()
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}


@torch.no_grad()
def evaluate_classifier(model: nn.Module, data: PreparedLabelled, split: str, *, batch_size: int,
                        dims: ParallelDims, device: torch.device, dtype: str) -> dict:
    """Loss, accuracy, macro-F1, per-class F1 and the confusion matrix of every example of ``split``.

    1. Each rank runs its share of every global batch (the same number of forwards on every rank).
    2. It counts its confusion matrix and loss sum over its valid rows.
    3. One all-reduce sums them over the data-parallel ranks (fp64: counts stay exact to 2**53).
    4. The metrics come from the totals.
    """
    num_classes = len(data.classes)
    confusion_CC = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for input_ids_BS, labels_B, mask_BS, valid_B in data.eval_batches(split, batch_size=batch_size,
                                                                     dp_rank=dims.dp_rank, dp_size=dims.dp):
        labels_B, valid_B = labels_B.to(device), valid_B.to(device)
        with autocast_context(device, dtype):
            out = model(input_ids_BS.to(device), padding_mask_BS=mask_BS.to(device))
        logits_BC = out.logits.float()
        loss_sum += F.cross_entropy(logits_BC, labels_B, reduction="none")[valid_B].double().sum()
        confusion_CC += confusion_matrix(logits_BC.argmax(dim=-1), labels_B, num_classes=num_classes, valid_B=valid_B)
    sums = torch.cat([confusion_CC.flatten().double(), loss_sum[None]])
    if dims.dp > 1:
        dist.all_reduce(sums, group=dims.group("dp"))
    confusion_CC = sums[:-1].round().long().reshape(num_classes, num_classes).cpu()
    metrics = metrics_from_confusion(confusion_CC, prefix=split)
    metrics[f"{split}_loss"] = float(sums[-1]) / max(metrics[f"{split}_examples"], 1)
    return metrics


def eval_layout(cfg: JobConfig, world_size: int) -> JobConfig:
    """The run's parallel layout folded to fit ``world_size`` processes for evaluation: no pipeline
    (every rank holds the whole model: nothing is trained, and a checkpoint saved by pipeline
    stages loads into one model), no ZeRO sharding, tensor parallelism kept where parallel.tp
    divides the processes, expert (tensor) parallelism where it still divides the ranks and the
    experts; whatever does not fit becomes 1."""
    par = cfg.parallel
    tp = par.tp if world_size % par.tp == 0 else 1
    etp = par.etp if world_size % (par.ep * par.etp) == 0 else 1
    experts_split = not cfg.model.is_moe or cfg.moe.num_experts % par.ep == 0
    ep = par.ep if world_size % (par.ep * etp) == 0 and experts_split else 1
    folded = replace(par, pp=1, tp=tp, ep=ep, etp=etp, dp=-1, zero_stage=0, hsdp_replicate=1, pp_virtual_stages=1,
                     pp_schedule="1f1b")
    changed = [f"parallel.{k} {getattr(par, k)} -> {getattr(folded, k)}" for k in ("pp", "tp", "ep", "etp")
               if getattr(par, k) != getattr(folded, k)]
    if changed:
        log.info("evaluating at %d process(es): %s", world_size, ", ".join(changed))
    return replace(cfg, parallel=folded)


def evaluate_run(run_dir: str | Path, *, split: str | None = None, checkpoint: str | None = None) -> dict | None:
    """Evaluate the checkpoint of a saved run (collective: every rank of this job calls it).

    ``split``: "test" or "val" for a classifier (default "test"); "val" for a language model (the whole
    validation stream). ``checkpoint``: a checkpoint folder (default: the run's newest). Rank 0 writes
    ``RUN/eval-<split>-step<N>.json`` and returns the metrics; the other ranks return None.
    """
    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    split = split or ("test" if is_classifier(cfg) else "val")
    allowed = ("test", "val") if is_classifier(cfg) else ("val",)
    if split not in allowed:
        raise ValueError(f"--split ({split!r}) must be one of {', '.join(map(repr, allowed))} for this "
                         f"{'classifier' if is_classifier(cfg) else 'language model'}")
    ckpt_dir = checkpoint_folder(run_dir, cfg.checkpoint.dir)
    path = resolve_checkpoint(checkpoint) if checkpoint is not None else latest_checkpoint(ckpt_dir)
    if path is None:
        raise ValueError(f"run {str(run_dir)!r} has no complete checkpoint in {ckpt_dir}; pass --checkpoint PATH")
    proc = runtime.init_job_runtime(cfg)
    cfg = eval_layout(cfg, proc.world_size)
    dims = ParallelDims.from_config(cfg.parallel, world_size=proc.world_size,
                                    num_experts=cfg.moe.num_experts if cfg.model.is_moe else None)
    dims.build_mesh(proc.device.type)
    data = build_task_data(cfg, is_main=proc.is_main)
    if is_classifier(cfg):  # every rank reads the file: all raise together
        check_run_classes(data.classes, run_dir, num_classes=cfg.model.num_classes)
    _, model = build_model(cfg, data)
    model.to(proc.device)
    parallelize(model, dims, zero_stage=0, mixed_precision=cfg.train.dtype)
    o = cfg.optim
    # The optimizer is read too (the checkpoint loader restores model and optimizer as one state);
    # nothing steps it.
    optimizer = build_optimizer(model, **optimizer_settings(o))
    # A run that kept a weight average evaluated it: so does this.
    ema = WeightAverage(model, decay=o.ema_decay) if o.ema_decay > 0 else None
    loaded = load_checkpoint(path, model=model, optimizer=optimizer,
                             ema_like=ema.state_dict() if ema is not None else None)
    if ema is not None and loaded.ema_state is None:
        log.warning("checkpoint %s holds no weight average (optim.ema_decay %s): evaluating its weights", path,
                    o.ema_decay)
        ema = None
    elif ema is not None and loaded.ema_state is not None:
        ema.load_state_dict(loaded.ema_state, num_updates=int(loaded.trainer_state.get("ema_updates", 0)))
    model.eval()
    t = cfg.train
    with ema.applied() if ema is not None else contextlib.nullcontext():
        if is_classifier(cfg):
            metrics = evaluate_classifier(model, data, split, batch_size=t.micro_batch_size, dims=dims,
                                          device=proc.device, dtype=t.dtype)
        else:
            loader = data.val_loader(global_batch_size=t.micro_batch_size * dims.dp, dp_rank=dims.dp_rank,
                                     dp_size=dims.dp)
            metrics = evaluate_lm(model, loader.eval_batches(), dims=dims, device=proc.device, dtype=t.dtype)
    result = {"run": str(run_dir), "checkpoint": str(path), "step": loaded.step, "split": split,
              "world_size": proc.world_size, "weights": "average" if ema is not None else "raw", **metrics}
    if not proc.is_main:
        return None
    atomic_write_text(run_dir / f"eval-{split}-step{loaded.step}.json", json.dumps(result, indent=1) + "\n")
    return result
