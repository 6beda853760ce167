"""Expert GEMMs on a multi-core CPU with whole experts per thread (``csrc/expert_gemms.cpp``).

The grouped path's GEMMs use this on the CPU with more than one thread: each thread multiplies
whole experts instead of every expert's GEMM being split over all threads by the BLAS (see the
C++ file for why and the measurements). Same products, same per-expert BLAS calls: the results
equal ``torch._grouped_mm``'s. On GPUs, with one thread, under ``torch.compile`` or where the
extension cannot be built, the grouped path keeps ``torch._grouped_mm``.

The extension is compiled on first use with ``torch.utils.cpp_extension`` (ninja and a C++
compiler; ~20 s once, then cached in ``TORCH_EXTENSIONS_DIR``). A failed build is reported once
and the grouped path falls back; ``MOETRAIN_CPU_EXPERT_KERNEL=0`` skips the build.

Shape legend: M token copies grouped by expert, I input dim, O output dim, E (local) experts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "expert_gemms.cpp"
_lock = threading.Lock()
_kernel = None
_tried = False
_off = threading.local()


def kernel():
    """The compiled extension, or None where it is disabled or cannot be built (said once)."""
    global _kernel, _tried
    if _tried:
        return _kernel
    with _lock:
        if _tried:
            return _kernel
        if os.environ.get("MOETRAIN_CPU_EXPERT_KERNEL", "1") == "0":
            log.info("MOETRAIN_CPU_EXPERT_KERNEL=0: CPU expert GEMMs use torch._grouped_mm")
        else:
            try:
                from torch.utils.cpp_extension import load

                # -fopenmp: at::parallel_for is a header template, compiled sequential without it.
                # The extension's libgomp.so.1 resolves to the one torch loaded (same soname):
                # one OpenMP runtime, one thread pool.
                _kernel = load(name="moetrain_expert_gemms", sources=[str(_SOURCE)],
                               extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
            # No ninja or compiler (RuntimeError), a failed compile (RuntimeError wrapping it), an
            # unwritable cache (OSError), a library that will not load (ImportError): the
            # slower path still works.
            except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as e:
                log.warning("could not build the CPU expert-GEMM extension (%s: %s); CPU expert GEMMs use "
                            "torch._grouped_mm, which splits each expert's GEMM over the threads instead",
                            type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        _tried = True
        return _kernel


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block (on this thread) the grouped path uses ``torch._grouped_mm``: for
    comparing the two in one process (``benchmarks/moe_layer.py --compare-cpu-kernel``)."""
    _off.depth = getattr(_off, "depth", 0) + 1
    try:
        yield
    finally:
        _off.depth -= 1


def usable(x_MI: torch.Tensor) -> bool:
    """Whether the grouped GEMMs of ``x_MI`` should run whole experts per thread."""
    # is_compiling first: dynamo must not trace into the thread count or the build.
    return (not torch.compiler.is_compiling() and x_MI.device.type == "cpu" and torch.get_num_threads() > 1
            and not getattr(_off, "depth", 0) and kernel() is not None)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MI, w_EIO, sizes):
        ctx.save_for_backward(x_MI, w_EIO)
        ctx.sizes = sizes
        return _kernel.grouped_mm(x_MI, w_EIO, sizes)

    @staticmethod
    def backward(ctx, grad_MO):
        x_MI, w_EIO = ctx.saved_tensors
        grad_MO = grad_MO.contiguous()
        grad_x = _kernel.grouped_mm(grad_MO, w_EIO.transpose(1, 2), ctx.sizes) if ctx.needs_input_grad[0] else None
        grad_w = _kernel.grouped_mm_weight_grad(x_MI, grad_MO, ctx.sizes) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def grouped_mm(x_MI: torch.Tensor, w_EIO: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Rows of expert e (``sizes[e]`` of them, in expert order) of ``x_MI`` times ``w_EIO[e]``, with
    autograd. Call only where :func:`usable` is true."""
    return _GroupedMM.apply(x_MI, w_EIO, sizes)
