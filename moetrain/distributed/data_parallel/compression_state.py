"""The 1-bit Adam side of ``MoEDataParallel`` (``moetrain.distributed.data_parallel.ddp``): the compressed
average of the momenta over each parameter's replicas, the error-feedback residuals it keeps per
rank (saved in checkpoints), and the bytes the gradient reductions moved. The attributes it reads
(``_dense_reducer``, ``_expert_reducer``, the byte counters, ...) are set up by
``MoEDataParallel._setup_compression``.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from moetrain.distributed.comm.timer import CommTimer
from moetrain.distributed.data_parallel.compression import OneBitReducer
from moetrain.distributed.expert_parallel.apply import is_expert_shard

log = logging.getLogger("moetrain")


class CompressionStateMixin:
    """Methods of ``MoEDataParallel`` about compressed reductions and their state."""

    # Set by ``DistributedDataParallel.__init__`` (process_group) and ``MoEDataParallel``.
    process_group: dist.ProcessGroup
    timer: CommTimer
    grad_compression: str
    _edp_group: dist.ProcessGroup | None
    _layout: torch.Tensor
    _expert_names: list[str]
    _expert_params: list[nn.Parameter]
    _dense_params: list[tuple[str, nn.Parameter]]  # only under "onebit"
    _dense_reducer: OneBitReducer | None  # None unless "onebit"
    _expert_reducer: OneBitReducer | None  # None unless "onebit" with edp > 1
    _fp32_bytes_per_step: int
    _bytes_sent: int
    _bytes_fp32: int
    _num_synced: int
    _onebit_bytes: int
    _num_onebit: int

    def has_replicas(self, p: torch.Tensor) -> bool:
        """Whether parameter ``p`` has copies on other ranks to average with: every replicated
        parameter (dp > 1 here), an expert shard only when edp > 1."""
        return not is_expert_shard(p) or self._edp_group is not None

    @torch.no_grad()
    def onebit_average_(self, params: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        """Replace each of ``tensors`` (this rank's local tensor belonging to ``params[i]``, shaped
        like its local shard) by its 1-bit compressed mean over the parameter's replicas.
        Collective over dp, then edp; taken in the model's parameter order whatever order the
        lists come in, so every rank runs the same exchanges with the same residuals."""
        by_id = {id(p): t for p, t in zip(params, tensors, strict=True)}
        assert len(by_id) == len(params), "a parameter was passed twice"
        moved = 0
        # 1. Replicated parameters over dp.
        dense = [(n, by_id[id(p)]) for n, p in self._dense_params if id(p) in by_id]
        if dense:
            assert self._dense_reducer is not None, "onebit_average_ outside grad_compression onebit"
            with self.timer.span("grad_reduce"):
                moved += self._dense_reducer.all_reduce_sum([t for _, t in dense], [n for n, _ in dense])
            torch._foreach_div_([t for _, t in dense], self.process_group.size())
        # 2. Expert shards over edp.
        experts = [(n, by_id[id(p)]) for n, p in zip(self._expert_names, self._expert_params, strict=True)
                   if id(p) in by_id]
        if experts and self._expert_reducer is not None:
            with self.timer.span("grad_reduce"):
                moved += self._expert_reducer.all_reduce_sum([t for _, t in experts], [n for n, _ in experts])
            torch._foreach_div_([t for _, t in experts], dist.get_world_size(self._edp_group))
        assert len(dense) + (len(experts) if self._expert_reducer is not None else 0) == len(params), \
            "onebit_average_ got a parameter without replicas"
        self._bytes_sent += moved
        self._onebit_bytes += moved
        self._num_onebit += 1

    def grad_comm_stats(self) -> dict[str, float]:
        """Bytes this rank moved per synced step since the last call to bring the replicas
        together (gradients; for "onebit", fp32 gradients in its warmup, then 1-bit momenta), and
        their ratio to fp32 gradient all-reduces of the same tensors; for "onebit" steps of the
        compression stage in the window, also their own bytes per step and ratio. Resets the
        counters. Host-only numbers."""
        steps = max(self._num_synced, 1)
        sent = self._bytes_sent if self.grad_compression != "none" else self._bytes_fp32
        out = {"grad_bytes": sent / steps,
               "grad_bytes_ratio_vs_fp32": sent / self._bytes_fp32 if self._bytes_fp32 else 1.0}
        if self._num_onebit:
            per_step = self._onebit_bytes / self._num_onebit
            out.update(grad_bytes_compressed_step=per_step,
                       grad_bytes_ratio_vs_fp32_compressed_step=per_step / self._fp32_bytes_per_step)
        self._bytes_sent, self._bytes_fp32, self._num_synced = 0, 0, 0
        self._onebit_bytes, self._num_onebit = 0, 0
        return out

    def compression_state_dict(self) -> dict[str, torch.Tensor]:
        """The 1-bit residuals of this rank (tensors only) and the layout they belong to; empty
        unless ``grad_compression`` is "onebit"."""
        if self._dense_reducer is None:
            return {}
        state = {"layout": self._layout.clone(), **self._dense_reducer.state_dict()}
        if self._expert_reducer is not None:
            state.update({f"expert.{k}": v for k, v in self._expert_reducer.state_dict().items()})
        return {k: v.clone() for k, v in state.items()}

    def load_compression_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        """Restore the residuals saved at the same layout exactly; otherwise (another world size or
        ep, or none saved) start them from zero with a warning: they are per-rank chunk state,
        which has no meaning at another layout."""
        if self._dense_reducer is None:
            return
        live = self.compression_state_dict()
        reducers = [self._dense_reducer] + ([self._expert_reducer] if self._expert_reducer is not None else [])
        problem = None
        if not state:
            problem = "the checkpoint holds none"
        elif not torch.equal(state.get("layout", torch.empty(0)).cpu(), self._layout):
            saved = state.get("layout", torch.empty(0)).tolist()
            problem = f"saved at layout [world, ep, dp, edp, rank] = {saved}, now {self._layout.tolist()}"
        elif set(state) != set(live) or any(state[k].shape != v.shape for k, v in live.items()):
            problem = "the saved residuals do not match this model's parameters"
        if problem is not None:
            log.warning("dp.grad_compression onebit: error-feedback residuals reset to zero (%s)", problem)
            for r in reducers:
                r.reset()
            return
        assert state is not None  # no problem found means residuals were saved
        for prefix, reducer in (("", self._dense_reducer), ("expert.", self._expert_reducer)):
            if reducer is None:
                continue
            for k in reducer.worker:
                reducer.worker[k].copy_(state[f"{prefix}worker.{k}"])
                reducer.server[k].copy_(state[f"{prefix}server.{k}"])
