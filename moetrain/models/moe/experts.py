"""Routed experts stored as stacked ``[E, D, F]`` weights, optionally with low-rank adapters.

LoRA (``add_lora``): each projection ``w [E, I, O]`` gains ``lora_a [E, I, R]`` and ``lora_b
[E, R, O]``, stored per expert in the same grouped form, and computes ``x w + scale * (x a) b``
with the same grouped matmul as the base weight (no loop over experts on the grouped path).

Shape legend: M token copies grouped by expert, D model dim, F expert hidden dim, E (local) experts,
R adapter rank, I/O a projection's input/output dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.utils.tensors import local_tensor

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _aligned(*tensors: torch.Tensor) -> bool:
    # torch._grouped_mm needs 16-byte aligned strides (rows of D and F elements).
    return all((t.shape[-1] * t.element_size()) % 16 == 0 for t in tensors)


# torch._grouped_mm wrapped as custom ops, for torch.compile only: the built-in op's fake-tensor
# rule accepts bf16 only, so a compiled fp32 model failed to trace; with these, compile treats the
# GEMMs as opaque kernels with known output shapes. Eager calls the built-in op directly: the
# custom op's Python dispatch and autograd cost ~1 ms per layer step on the benchmark shapes.
@torch.library.custom_op("moetrain::grouped_mm", mutates_args=())
def _grouped_mm(x_MI: torch.Tensor, w_EIO: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x_MI, w_EIO, offs=offsets_E)


@_grouped_mm.register_fake
def _(x_MI, w_EIO, offsets_E):
    return x_MI.new_empty(x_MI.shape[0], w_EIO.shape[-1])


@torch.library.custom_op("moetrain::grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(x_MI: torch.Tensor, grad_MO: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """``x[rows of e].T @ grad[rows of e]`` for every expert e: the gradient of ``w[e]``."""
    return torch._grouped_mm(x_MI.t(), grad_MO, offs=offsets_E)


@_grouped_mm_weight_grad.register_fake
def _(x_MI, grad_MO, offsets_E):
    return x_MI.new_empty(offsets_E.shape[0], x_MI.shape[1], grad_MO.shape[1])


def _grouped_mm_setup(ctx, inputs, output):
    x_MI, w_EIO, offsets_E = inputs
    ctx.save_for_backward(x_MI, w_EIO, offsets_E)


def _grouped_mm_backward(ctx, grad_MO):
    x_MI, w_EIO, offsets_E = ctx.saved_tensors
    grad_x = _grouped_mm(grad_MO, w_EIO.transpose(-2, -1), offsets_E) if ctx.needs_input_grad[0] else None
    grad_w = _grouped_mm_weight_grad(x_MI, grad_MO, offsets_E) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


_grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def to_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype the active autocast of its device computes in, as autocast casts the
    input of an ``nn.Linear``; unchanged without autocast (and fp64, which autocast leaves alone).

    Needed for the ops autocast does not know: ``torch._grouped_mm``, the all-to-all and the row
    gathers keep the dtype they are given, so without this cast an fp32 residual stream (what
    autocast over fp32 parameters leaves) would be sent and multiplied in fp32. Over bf16
    parameters (FSDP's gathered ones) the stream is bf16 already and this is a no-op.
    """
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type) or not x.is_floating_point() or x.dtype == torch.float64:
        return x
    return x.to(torch.get_autocast_dtype(device_type))


def grouped_matmul(x_MI: torch.Tensor, w_EIO: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Rows ``offsets[e-1]:offsets[e]`` of x times ``w[e]``, all experts in one kernel."""
    if torch.compiler.is_compiling():
        return _grouped_mm(x_MI, w_EIO, offsets_E)
    return torch._grouped_mm(x_MI, w_EIO, offs=offsets_E)


PROJECTIONS = ("w1", "w3", "w2")
"""The stacked weights: w1 ``[E, D, F]`` (up), w3 ``[E, D, F]`` (SwiGLU gate), w2 ``[E, F, D]`` (down)."""


class GroupedExperts(nn.Module):
    """E independent FFNs evaluated together.

    ``activation="gelu"``: ``gelu(x @ w1) @ w2``; ``"swiglu"``: ``(silu(x @ w1) * (x @ w3)) @ w2``.
    ``impl="grouped"`` runs each projection as one ``torch._grouped_mm``; ``impl="loop"`` runs one
    matmul per expert and is the oracle the grouped path is tested against. Every direct
    parameter is stacked ``[E, ...]`` in expert order (expert parallelism shards them all on dim 0).
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, *, activation: str = "gelu",
                 impl: str = "grouped", init_std: float = 0.02) -> None:
        super().__init__()
        self.dim, self.hidden_dim, self.num_experts = dim, hidden_dim, num_experts
        self.activation, self.impl, self.init_std = activation, impl, init_std
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim)) if activation == "swiglu" else None
        self.lora_rank, self.lora_scale = 0, 0.0
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        # Each expert is drawn from the generator in global expert order, so the same seed
        # gives the same global experts whatever the expert-parallel layout.
        for w in (self.w1, self.w2, self.w3):
            if w is not None:
                with torch.no_grad():
                    w.normal_(0.0, self.init_std, generator=generator)

    # ----- LoRA --------------------------------------------------------------------------------------

    def add_lora(self, *, rank: int, scale: float,
                 generator_for: Callable[[str], torch.Generator | None] = lambda name: None) -> None:
        """Give each projection ``w [E, I, O]`` adapters ``lora_a_<w> [E, I, R]`` and ``lora_b_<w>
        [E, R, O]``: A uniform in ``+-1/sqrt(I)`` (nn.Linear's and PEFT's default init), B zero, so
        the output is unchanged until B trains. ``generator_for(attribute name)`` draws each A
        whole, in global expert order: the same adapters whatever the expert-parallel layout
        (call this on the full, single-device model, before ``shard_experts``)."""
        assert self.lora_rank == 0, "adapters added twice"
        for name in self.projection_names():
            w = getattr(self, name)
            assert not _is_dtensor(w), "add_lora runs before expert parallelism"
            E, in_dim, out_dim = w.shape
            a = torch.empty(E, in_dim, rank, device=w.device, dtype=w.dtype)
            with torch.no_grad():
                bound = 1.0 / math.sqrt(in_dim)
                a.copy_(torch.empty(E, in_dim, rank).uniform_(-bound, bound, generator=generator_for(f"lora_a_{name}")))
            setattr(self, f"lora_a_{name}", nn.Parameter(a))
            setattr(self, f"lora_b_{name}",
                    nn.Parameter(torch.zeros(E, rank, out_dim, device=w.device, dtype=w.dtype)))
        self.lora_rank, self.lora_scale = rank, scale

    def projection_names(self) -> list[str]:
        return [n for n in PROJECTIONS if getattr(self, n) is not None]

    # ----- forward -----------------------------------------------------------------------------------

    def _weights(self, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        # Compute in the activation dtype (bf16 under mixed precision) while the master weights
        # stay fp32: the cast's backward brings the gradients back to them in fp32. Under expert
        # parallelism the weights are DTensors sharded over ep: the math runs on this rank's
        # experts only. Projection name -> (w, lora_a or None, lora_b or None).
        def local(name: str) -> torch.Tensor | None:
            t = getattr(self, name, None)
            return local_tensor(t).to(dtype) if t is not None else None

        return {n: (local_tensor(getattr(self, n)).to(dtype), local(f"lora_a_{n}"), local(f"lora_b_{n}"))
                for n in self.projection_names()}

    def forward(self, x_MD: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # Under autocast, inputs and weights in the autocast dtype, as autocast treats nn.Linear:
        # torch._grouped_mm is not an autocast op, and the loop path's matmuls are, so without
        # this the grouped path and its oracle would differ.
        x_MD = to_autocast_dtype(x_MD)
        weights = self._weights(x_MD.dtype)
        aligned = _aligned(x_MD, *(t for ws in weights.values() for t in ws if t is not None))
        if self.impl == "grouped" and _HAS_GROUPED_MM and aligned:
            return self._forward_grouped(x_MD, num_tokens_per_expert, weights)
        return self._forward_loop(x_MD, num_tokens_per_expert, weights)

    def _act(self, h_MF: torch.Tensor, gate_MF: torch.Tensor | None) -> torch.Tensor:
        if self.activation == "swiglu":
            assert gate_MF is not None, "swiglu experts have a gate projection (w3)"
            return F.silu(h_MF) * gate_MF
        return F.gelu(h_MF)

    def _forward_grouped(self, x_MD, num_tokens_per_expert, weights) -> torch.Tensor:
        offsets_E = torch.cumsum(num_tokens_per_expert, dim=0).to(torch.int32)

        def project(x_MI: torch.Tensor, name: str) -> torch.Tensor:
            w, a, b = weights[name]
            y_MO = grouped_matmul(x_MI, w, offsets_E)
            if a is None:
                return y_MO
            # Two thin grouped GEMMs, [M, I] x [E, I, R] then [M, R] x [E, R, O]: never the
            # E x I x O product A B, which would cost a full expert weight per step.
            return y_MO + self.lora_scale * grouped_matmul(grouped_matmul(x_MI, a, offsets_E), b, offsets_E)

        h_MF = project(x_MD, "w1")
        gate_MF = project(x_MD, "w3") if "w3" in weights else None
        return project(self._act(h_MF, gate_MF), "w2")

    def _forward_loop(self, x_MD, num_tokens_per_expert, weights) -> torch.Tensor:
        # Host sync: the per-expert split sizes must be Python ints. Fine for the oracle.
        sizes = num_tokens_per_expert.tolist()

        def project(x_mi: torch.Tensor, name: str, e: int) -> torch.Tensor:
            w, a, b = weights[name]
            y_mo = x_mi @ w[e]
            if a is None:
                return y_mo
            return y_mo + self.lora_scale * ((x_mi @ a[e]) @ b[e])

        outs = []
        for e, x_md in enumerate(x_MD.split(sizes)):
            gate = project(x_md, "w3", e) if "w3" in weights else None
            outs.append(project(self._act(project(x_md, "w1", e), gate), "w2", e))
        return torch.cat(outs) if outs else x_MD.new_zeros(0, self.dim)


def _is_dtensor(t: torch.Tensor) -> bool:
    return local_tensor(t) is not t
