"""Peak FLOP/s of the device, the denominator of MFU.

On GPUs the datasheet dense peak (``moetrain.utils.devices``) of the precision the matmuls run at:
bf16/fp16 under autocast, TF32 for fp32 where TF32 is enabled (``train.tf32``), plain fp32 where
it is not; a GPU whose exact name the table lacks gets no MFU. On CPUs (no datasheet figure that
means anything for 2 shared cores) the measured rate of a large fp32 matmul with the threads this
process has, so MFU there reads as "fraction of what this process's matmul can do".
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from moetrain.utils.devices import gpu_peak_flops, matmul_precision, tf32_enabled

log = logging.getLogger(__name__)


def measured_matmul_flops(device: torch.device, *, n: int = 1024, repeats: int = 3) -> float:
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b  # warm-up (thread pool, kernels)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """One rank's peak FLOP/s for ``train.dtype`` on ``device``; None (MFU not reported, one
    warning) for a GPU or precision the datasheet table does not hold."""
    if device.type != "cuda":
        return measured_matmul_flops(device)
    name = torch.cuda.get_device_name(device)
    precision = matmul_precision(dtype, tf32=tf32_enabled())
    peak = gpu_peak_flops(name, precision)
    if peak is None:
        _warn_no_peak(name, precision)
    return peak


@functools.cache
def _warn_no_peak(name: str, precision: str) -> None:
    log.warning("MFU is not reported: no datasheet %s peak for CUDA device %r in moetrain.utils.devices "
                "(exact device names only)", precision, name)
