"""Workers of the ``moe.dispatch_chunks`` and shared-expert overlap tests (test_dispatch_chunks.py).

``layer_worker`` runs one MoE layer (E=8, K=2, one shared expert) at ep = world, one forward and
backward per job on this rank's fixed tokens (the ranks may hold different token counts),
and returns the output, the input gradient, every parameter gradient (expert shards as local
tensors), the dropped count and the byte counters. ``RowwiseExperts`` replaces the routed
experts by a parameter-free function of each row and its global expert: it computes every row
alone, so any difference between two dispatch schedules is the dispatcher's own.
``order_worker`` records, in one forward, when the token rows are launched and waited for and
when the shared and routed experts run.

Shape legend: T tokens on this rank, D model dim, M rows grouped by local expert, L local experts.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from moetrain.config.moe import MoEConfig
from moetrain.distributed import ParallelDims, apply_expert_parallel, collect_comm_stats
from moetrain.models.moe import MoELayer
from moetrain.utils.tensors import local_tensor

DIM, NUM_EXPERTS = 16, 8


class RowwiseExperts(nn.Module):
    """``y = tanh(x) * (1 + e / 8)`` for a row of global expert e: no GEMM, no parameter, each row
    computed alone (so bitwise the same whatever rows share a call)."""

    def __init__(self, first_expert: int) -> None:
        super().__init__()
        self.first_expert = first_expert

    def forward(self, x_MD: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        L = num_tokens_per_expert.numel()
        expert_M = torch.repeat_interleave(torch.arange(L) + self.first_expert, num_tokens_per_expert,
                                           output_size=x_MD.shape[0])
        return torch.tanh(x_MD) * (1 + expert_M / NUM_EXPERTS).to(x_MD.dtype)[:, None]


def make_inputs(rank: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens and the fixed output weights of its loss, ``[T, D]`` each."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(num_tokens, DIM, generator=g), torch.randn(num_tokens, DIM, generator=g)


def build_layer(overrides: dict, *, experts: str, dims: ParallelDims | None) -> MoELayer:
    """The same global layer on every rank and in the reference (``dims`` None: one process).
    No aux losses: a rank's aux loss is not its share of the single-process one."""
    cfg = MoEConfig(num_experts=NUM_EXPERTS, top_k=2, expert_hidden_dim=32, num_shared_experts=1,
                    aux_loss_coef=0.0, z_loss_coef=0.0, **overrides)
    torch.manual_seed(0)
    layer = MoELayer(DIM, cfg)
    if dims is not None:
        apply_expert_parallel(nn.Sequential(layer), dims)
    if experts == "rowwise":
        first = 0 if dims is None else dims.ep_rank * (NUM_EXPERTS // dims.ep)
        layer.experts = RowwiseExperts(first)
    return layer


def step(layer: MoELayer, x_TD: torch.Tensor, probe_TD: torch.Tensor) -> dict:
    """One forward and backward of ``sum(out * probe)``."""
    x_TD = x_TD.clone().requires_grad_()
    out_TD, aux = layer(x_TD)
    (out_TD * probe_TD).sum().backward()
    grads = {name: local_tensor(p.grad).clone() for name, p in layer.named_parameters()}
    return {"out": out_TD.detach(), "x_grad": x_TD.grad, "grads": grads, "dropped": int(aux.num_dropped)}


def layer_worker(rank: int, world_size: int, jobs: dict[str, tuple[str, list[int], dict]]) -> dict:
    """Per job (name -> (experts "rowwise" or "grouped", tokens per rank, MoEConfig overrides)):
    ``step`` at ep = world, with the byte counters."""
    dims = ParallelDims(world_size=world_size, ep=world_size, num_experts=NUM_EXPERTS)
    dims.build_mesh("cpu")
    out = {}
    for name, (experts, tokens, overrides) in jobs.items():
        layer = build_layer(overrides, experts=experts, dims=dims)
        out[name] = {**step(layer, *make_inputs(rank, tokens[rank])), "stats": collect_comm_stats(layer)}
    return out


def reference(experts: str, tokens: list[int], overrides: dict) -> dict:
    """One process, all experts, the ranks' tokens concatenated in rank order."""
    inputs = [make_inputs(r, t) for r, t in enumerate(tokens)]
    x_TD, probe_TD = (torch.cat([pair[i] for pair in inputs]) for i in range(2))
    return step(build_layer(overrides, experts=experts, dims=None), x_TD, probe_TD)


class _OrderRecorder(TorchDispatchMode):
    """Token-row exchanges (the functional all-to-alls of 2-D tensors) as "launch" and their
    waits as "wait", in the order the ops run; forward hooks add the shared experts' start and
    end and each call of the routed experts."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []
        self._launched: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if "all_to_all_single" in name and args[0].dim() == 2:
            self._launched.add(out.data_ptr())
            self.events.append("launch")
        elif "wait_tensor" in name and args[0].data_ptr() in self._launched:
            self.events.append("wait")
        return out


def _mark(module: nn.Module, events: list[str], *, start: str, end: str | None = None) -> None:
    def on_start(*_):
        events.append(start)  # returns None: the input stays as it is

    def on_end(*_):
        events.append(end)  # returns None: a hook's return value would replace the output

    module.register_forward_pre_hook(on_start)
    if end is not None:
        module.register_forward_hook(on_end)


def order_worker(rank: int, world_size: int, settings: dict[str, dict]) -> dict:
    """Per setting: the event order of one forward at ep = world."""
    dims = ParallelDims(world_size=world_size, ep=world_size, num_experts=NUM_EXPERTS)
    dims.build_mesh("cpu")
    x_TD, _ = make_inputs(rank, 16)
    out = {}
    for name, overrides in settings.items():
        layer = build_layer(overrides, experts="grouped", dims=dims)
        recorder = _OrderRecorder()
        _mark(layer.shared_experts, recorder.events, start="shared_start", end="shared_end")
        _mark(layer.experts, recorder.events, start="experts")
        with recorder:
            layer(x_TD)
        out[name] = recorder.events
    return out
