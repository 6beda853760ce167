"""Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025): momentum orthogonalised by a Newton-Schulz
iteration for the hidden matrices, AdamW for everything else, in one optimizer.

For a hidden matrix W [A, B] with gradient G, each step (Moonlight's ``Muon.step``):

    m = mu * m + G                        momentum, one buffer (no second moment)
    u = G + mu * m   (nesterov)  or  m
    O = NewtonSchulz5(u)                  ~ U V^T of u's SVD: every singular value near 1
    W = W * (1 - lr * wd) - lr * 0.2 * sqrt(max(A, B)) * O

The 0.2 * sqrt(max(A, B)) factor makes O's RMS about AdamW's update RMS (0.2-0.4), so AdamW's
learning rate and weight decay carry over unchanged (Moonlight, section 2.2). Stacked expert
weights ``[E, I, O]`` are E independent matrices, orthogonalised as one batch; so are the
experts' LoRA adapters ``[E, I, R]``, ``[E, R, O]``. Embeddings, the output head, routers (and
the shared-expert gate), norms and biases take AdamW steps (``muon_param_ids``): their rows are
looked up or compared one by one, where whitening across rows has no meaning.

The Newton-Schulz iteration runs in fp32 (the published code uses bf16 on GPUs, for speed; here
the master weights are fp32 and the same numbers come out on any device). It needs the whole
matrix, so under sharding each matrix is formed where it is orthogonalised:

* expert parallelism: nothing is gathered. Each rank holds whole experts (``Shard(0)`` over ep,
  the expert dim) and orthogonalises its own; the mesh axis named "ep" is never gathered.
* ZeRO-1 (``ZeroShardedOptimizer``): each rank keeps its element slice of the momentum (1/G of
  it); ``u``'s slices are all-gathered over the slice group (dp, or edp for experts) into the
  whole local matrix, every rank orthogonalises it, and keeps its own slice of O (Moonlight's
  "Distributed Muon"). The slice layout comes from the wrapper (``FlatSlice``).
* FSDP2 (ZeRO-2/3): parameters, gradients and the momentum are DTensors ``Shard(0)`` over dp
  (experts over edp); ``u`` is redistributed to ``Replicate`` on every mesh axis but "ep" (an
  all-gather: the whole matrix, fp32, on every rank of the unit), orthogonalised, and this rank's
  shard taken back out of O (a local slice, no communication).

``moetrain.plan.model_states`` counts the momentum and the gathered matrix. Tensor parallelism
(and expert tensor parallelism) is refused by the config (``optim.name``): a tp-sharded weight
would need a gather over tp that no test covers here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from moetrain.distributed.comm.collectives import all_gather_single
from moetrain.distributed.local_adamw import adamw_local_step
from moetrain.models.moe.layer import MoELayer
from moetrain.models.moe.router import TopKRouter
from moetrain.models.transformer import Transformer
from moetrain.utils.tensors import local_tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of the quintic ``X <- a X + b (X X^T) X + c (X X^T)^2 X`` (Keller Jordan's Muon): the
steepest slope at 0 that still keeps every singular value in about [0.7, 1.2] after 5 steps."""

UPDATE_RMS = 0.2
"""Moonlight's target update RMS: ``0.2 * sqrt(max(A, B)) * O`` has about AdamW's RMS."""


def orthogonalize(u: torch.Tensor, *, steps: int) -> torch.Tensor:
    """Newton-Schulz orthogonalisation of every matrix in ``u [..., A, B]`` (a batch over the
    leading dims), in fp32: about ``U V^T`` of each matrix's SVD."""
    a, b, c = NS_COEFFICIENTS
    x = u.float()
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the wide form: X X^T is then min(A, B) square
        x = x.mT
    # Frobenius norm >= spectral norm: after this every singular value is <= 1, where the
    # iteration converges.
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * gram @ gram
        x = a * x + poly @ x
    return x.mT if tall else x


def update_scale(shape: Iterable[int]) -> float:
    """Moonlight's factor for a matrix of the last two dims of ``shape``: ``0.2 * sqrt(max(A, B))``."""
    *_, rows, cols = shape
    return UPDATE_RMS * math.sqrt(max(rows, cols))


def muon_param_ids(model: nn.Module) -> set[int]:
    """Ids of the parameters Muon updates: trainable ones of two or more dims, except embeddings,
    the output head, routers and the shared-expert gate (AdamW's, with norms and biases). The
    head is the whole model's, or under pipeline parallelism the last stage's."""
    from moetrain.distributed.pipeline.stages import PipelineModel

    adamw: set[int] = set()
    for module in model.modules():
        if isinstance(module, (nn.Embedding, TopKRouter)):
            adamw |= {id(p) for p in module.parameters()}
        elif isinstance(module, MoELayer) and module.shared_gate is not None:
            adamw |= {id(p) for p in module.shared_gate.parameters()}
        elif isinstance(module, (Transformer, PipelineModel)) and module.output is not None:
            adamw |= {id(p) for p in module.output.parameters()}
    return {id(p) for p in model.parameters() if p.requires_grad and p.ndim >= 2 and id(p) not in adamw}


@dataclass(frozen=True)
class FlatSlice:
    """A ZeRO-1 master: elements ``[lo, hi)`` of the flattened local parameter of ``shape``,
    rank-major slices of ``chunk`` elements (padded) over ``group`` of ``world`` ranks."""

    shape: torch.Size
    lo: int
    hi: int
    chunk: int
    group: dist.ProcessGroup | None
    world: int
    device: torch.device
    """Where the parameter lives (the slice may be a host copy, zero.offload_optimizer)."""


class Muon(torch.optim.Optimizer):
    """Muon for the groups with ``"muon": True``, AdamW (torch's, decoupled weight decay) for the
    others (module docstring). State: ``momentum_buffer`` like the parameter for a Muon parameter;
    ``step``, ``exp_avg``, ``exp_avg_sq`` (torch.optim.AdamW's) for the rest."""

    def __init__(self, params, *, lr: float, weight_decay: float, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        betas=betas, eps=eps, muon=False)
        super().__init__(params, defaults)
        self.slices: dict[int, FlatSlice] = {}
        """ZeRO-1's slice of each master, by ``id`` (set by ``ZeroShardedOptimizer``)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
            else:
                adamw_local_step(self, group)
        return loss

    def _muon_step(self, group: dict) -> None:
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        # The same parameters in the same order on every rank: the gathers below pair up.
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            g, buf = local_tensor(p.grad), local_tensor(state["momentum_buffer"])
            buf.mul_(mu).add_(g)
            u = g.add(buf, alpha=mu) if group["nesterov"] else buf
            whole = self._whole(p, u)
            o = orthogonalize(whole, steps=group["ns_steps"])
            mine = self._own_part(p, o)
            w = local_tensor(p)
            w.mul_(1 - lr * wd)
            w.add_(mine.to(w.dtype), alpha=-lr * update_scale(whole.shape))

    def _whole(self, p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The whole (ep-local) matrix of which ``u`` is this rank's part (module docstring)."""
        s = self.slices.get(id(p))
        if s is not None:
            if s.group is None:
                return u.to(s.device).view(s.shape)
            send = u.new_zeros(s.chunk, device=s.device)
            send[:s.hi - s.lo].copy_(u)
            recv = send.new_empty(s.world * s.chunk)
            all_gather_single(recv, send, group=s.group)
            return recv[:math.prod(s.shape)].view(s.shape)
        if isinstance(p, DTensor):
            target = _whole_placements(p)
            if target != list(p.placements):
                shared = DTensor.from_local(u, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                            stride=p.stride())
                return shared.redistribute(p.device_mesh, target).to_local()
        return u

    def _own_part(self, p: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """This rank's part of the orthogonalised whole matrix ``o``, shaped like its local ``p``."""
        s = self.slices.get(id(p))
        if s is not None:
            return o.reshape(-1)[s.lo:s.hi].to(p.device)
        if isinstance(p, DTensor):
            target = _whole_placements(p)
            if target != list(p.placements):
                whole = DTensor.from_local(o, p.device_mesh, target, run_check=False, shape=p.shape,
                                           stride=p.stride())
                return whole.redistribute(p.device_mesh, p.placements).to_local()  # a local slice
        return o


def _whole_placements(p: DTensor) -> list:
    """``p``'s placements with every mesh axis but "ep" replicated: the ep-local whole tensor."""
    names = p.device_mesh.mesh_dim_names or ()
    return [pl if i < len(names) and names[i] == "ep" else Replicate() for i, pl in enumerate(p.placements)]
