"""The ``torch.distributed.pipelining`` schedule over a rank's stages, and the stage-after-stage
forward that evaluation runs without one (``moetrain.distributed.pipeline.stages`` builds the
stages)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config.pipeline import check_microbatches
from moetrain.distributed.pipeline.stages import PipelineChunk, PipelineModel

if TYPE_CHECKING:
    from torch.distributed.pipelining.stage import _PipelineStageBase


def build_schedule(pm: PipelineModel, *, schedule: str, num_microbatches: int, pp_group: dist.ProcessGroup,
                   device: torch.device, loss_fn, stage_modules: list[nn.Module] | None = None):
    """The ``torch.distributed.pipelining`` schedule running ``pm``'s chunks (or their wrapped
    ``stage_modules``) over ``pp_group``; gradients are not divided by the micro-batch count
    (the loss function and the aux-loss scale do it, see the module docstring)."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    class MutedInferenceStage(PipelineStage):
        """A stage whose shape-inference forward and backward (the only callers of these two
        methods) run with its chunk ``muted``."""

        def __init__(self, module: nn.Module, chunk: PipelineChunk, *args, **kwargs) -> None:
            super().__init__(module, *args, **kwargs)
            self._chunk = chunk

        def _compute_outputs(self, *args, **kwargs):
            with self._chunk.muted():
                return super()._compute_outputs(*args, **kwargs)

        def _compute_input_grads(self, *args, **kwargs):
            with self._chunk.muted():
                return super()._compute_input_grads(*args, **kwargs)

    pp = dist.get_world_size(pp_group)
    check_microbatches(schedule, num_microbatches=num_microbatches, pp=pp)
    modules = stage_modules if stage_modules is not None else pm.chunks
    # Annotated with the base class: the schedules take an (invariant) list of it.
    stages: list[_PipelineStageBase] = [MutedInferenceStage(m, c, s, pm.num_stages, device, group=pp_group)
                                        for m, c, s in zip(modules, pm.chunks, pm.stage_ids, strict=True)]
    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)
    if len(stages) != 1:
        raise ValueError(f"parallel.pp_schedule ({schedule!r}) runs one stage per rank, this rank holds {len(stages)}")
    single = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return single(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)


@torch.no_grad()
def forward_only(pm: PipelineModel, input_ids_BS: torch.Tensor, pp_group: dist.ProcessGroup,
                 tokens_BS: torch.Tensor | None = None) -> torch.Tensor | None:
    """The last stage's logits of one batch, stage after stage (for evaluation: no schedule, no
    backward). Returns the logits on the rank holding the last stage, None elsewhere. Every rank
    of ``pp_group`` calls it with a batch of the same shape."""
    pp = dist.get_world_size(pp_group)
    held = dict(zip(pm.stage_ids, pm.chunks, strict=True))
    out = None
    for s in range(pm.num_stages):
        if s not in held:
            continue
        x = input_ids_BS
        if s > 0:
            # 1. header (dtype code, then the shape: B, this rank's S / tp positions, D), 2. the
            #    hidden state of the previous stage.
            header = torch.empty(4, dtype=torch.int64, device=input_ids_BS.device)
            dist.recv(header, group=pp_group, group_src=(s - 1) % pp)
            dtype = _DTYPES[int(header[0])]
            x = torch.empty(*header[1:].tolist(), dtype=dtype, device=input_ids_BS.device)
            dist.recv(x, group=pp_group, group_src=(s - 1) % pp)
        y = held[s](x, tokens_BS)
        if s == pm.num_stages - 1:
            out = y
            continue
        header = torch.tensor([_DTYPES.index(y.dtype), *y.shape], dtype=torch.int64, device=y.device)
        dist.send(header, group=pp_group, group_dst=(s + 1) % pp)
        dist.send(y.contiguous(), group=pp_group, group_dst=(s + 1) % pp)
    return out


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
