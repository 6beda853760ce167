"""Peak FLOP/s of the device, the denominator of MFU.

On GPUs the datasheet dense peak of the compute dtype; on CPUs (no datasheet figure that means
anything for 2 shared cores) the measured rate of a large fp32 matmul with the threads this
process has, so MFU there reads as "fraction of what this process's matmul can do".
"""

from __future__ import annotations

import time

import torch

# Dense (non-sparse) peak TFLOP/s by device-name fragment: (bf16/fp16, fp32/tf32).
_GPU_PEAK_TFLOPS = {
    "H200": (989.0, 494.0), "H100": (989.0, 494.0), "A100": (312.0, 156.0), "L40S": (362.0, 183.0),
    "A10G": (70.0, 35.0), "V100": (125.0, 15.7), "4090": (165.0, 82.6),
}


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


def peak_flops(device: torch.device, dtype: str) -> float:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (half, single) in _GPU_PEAK_TFLOPS.items():
            if key in name:
                return (single if dtype == "fp32" else half) * 1e12
    return measured_matmul_flops(device)
