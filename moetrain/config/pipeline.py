"""The rules of pipeline parallelism (``parallel.pp`` > 1) that the config decides: what a model
cut into stages can hold, how the stages' gradients can be reduced, and the micro-batch counts
each schedule accepts.

``JobConfig`` checks the first two when it is built and the micro-batches once the world size is
known (``JobConfig.grad_accum_steps``), so `moetrain train --nproc N` refuses a bad job in one line
before any process starts; ``moetrain.distributed.pipeline.stages`` calls the same functions where
it builds the stages and the schedule.
"""

from __future__ import annotations

from moetrain.config.base import require
from moetrain.config.model import ModelConfig

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def check_pipeline_model(model: ModelConfig, *, pp: int, virtual_stages: int = 1) -> None:
    """Stages hold contiguous runs of blocks, the first stage also the embedding and the last the
    final norm and a language-model head: every stage needs a block. (A tied head and the
    multi-token modules use the embedding on the last stage: it holds a copy kept in step with the
    first stage's, ``moetrain.distributed.pipeline.stages``.)"""
    if pp == 1:
        return
    # Before the head's rule (n-gram features imply a classifier), so that the refusal names them.
    require(model.ngram_buckets == 0, "model.ngram_buckets", model.ngram_buckets,
            f"must be 0 with parallel.pp ({pp}) > 1: the stages carry no n-gram table")
    require(model.head == "lm", "model.head", model.head, f"must be 'lm' with parallel.pp ({pp}) > 1")
    num_stages = pp * virtual_stages
    require(num_stages <= model.num_layers, "parallel.pp * parallel.pp_virtual_stages", num_stages,
            f"must be <= model.num_layers ({model.num_layers}): every stage holds at least one block")


def shares_embedding(model: ModelConfig) -> bool:
    """Whether the last stage needs the token embedding too: for the multi-token modules' inputs,
    or as the tied head's weight."""
    return model.mtp_depth > 0 or (model.head == "lm" and model.tie_embeddings)


def check_pipeline_reduction(*, pp: int, grad_compression: str) -> None:
    """Under pp the stage gradients are reduced once, after the schedule's last backward (ZeRO
    stages 0/1), or by FSDP2 per stage (2/3): nothing compresses them. (What pipeline stages can
    offload is ``config.zero.check_offload``'s rule.)"""
    if pp == 1:
        return
    require(grad_compression == "none", "dp.grad_compression", grad_compression,
            f"must be 'none' with parallel.pp ({pp}) > 1: the stage gradients are reduced once, after the "
            "schedule's last backward")


def check_microbatches(schedule: str, *, num_microbatches: int, pp: int) -> None:
    """The micro-batch counts the schedules accept, named by the fields that set them."""
    where = ("train.global_batch_size / (train.micro_batch_size * data-parallel size) "
             f"= {num_microbatches} micro-batches per step")
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"parallel.pp_schedule ({schedule!r}) must be one of {', '.join(map(repr, PP_SCHEDULES))}")
    if schedule == "1f1b" and num_microbatches < pp:
        raise ValueError(f"parallel.pp_schedule ('1f1b') needs at least parallel.pp ({pp}) micro-batches: {where}")
    rounds = max(1, num_microbatches // pp)
    if schedule == "interleaved_1f1b" and num_microbatches % rounds != 0:
        raise ValueError(f"parallel.pp_schedule ('interleaved_1f1b') needs the micro-batches to be a multiple of "
                         f"max(1, micro-batches // parallel.pp) = {rounds}: {where}")
