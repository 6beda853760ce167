"""Datasheet peak FLOP/s of the GPUs moetrain knows, by the exact name CUDA reports, and the
precision a run's matmuls execute at: the MFU denominator of the trainer (``train.flops``) and
of the step-time model (``plan.step_time``), one table for both.

A matmul runs at the rate of the precision it executes in: bf16/fp16 autocast at the half-precision
tensor-core rate; fp32 at the TF32 tensor-core rate only where TF32 is enabled (``train.tf32``,
:func:`set_tf32`), else at the plain fp32 (CUDA-core) rate.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

# Dense peak TFLOP/s by matmul precision. Where a datasheet prints only rates "with sparsity" (*,
# 2:4 structured) and states that dense rates are one half, the halves are used, rounded down to
# whole TFLOP/s; where it prints the dense rate, that figure. "fp32" is the CUDA-core rate of an
# fp32 matmul with TF32 off.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: FP32 67; TF32 989*, BF16 1,979*, FP16 1,979*.
    "h100-sxm": {"fp32": 67.0, "tf32": 494.0, "bf16": 989.0, "fp16": 989.0},
    # Same datasheet, H100 PCIe: FP32 51; TF32 756*, BF16 1,513*, FP16 1,513*.
    "h100-pcie": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0},
    # Same datasheet, H100 NVL (per GPU): FP32 60; TF32 835*, BF16 1,671*, FP16 1,671*.
    "h100-nvl": {"fp32": 60.0, "tf32": 417.0, "bf16": 835.0, "fp16": 835.0},
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: FP32 67; TF32 989*, BF16 1,979*, FP16 1,979*.
    "h200-sxm": {"fp32": 67.0, "tf32": 494.0, "bf16": 989.0, "fp16": 989.0},
    # Same datasheet, H200 NVL: FP32 60; TF32 835*, BF16 1,671*, FP16 1,671*.
    "h200-nvl": {"fp32": 60.0, "tf32": 417.0, "bf16": 835.0, "fp16": 835.0},
    # NVIDIA A100 datasheet (40 and 80 GB, SXM and PCIe alike), dense as printed: FP32 19.5;
    # TF32 156, BF16 312, FP16 312.
    "a100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    # NVIDIA L40S datasheet, dense as printed: FP32 91.6; TF32 183, BF16 362.05, FP16 362.05.
    "l40s": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05},
    # NVIDIA A10 datasheet, dense as printed: FP32 31.2; TF32 62.5, BF16 125, FP16 125.
    "a10": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    # NVIDIA V100 datasheet, SXM2 / PCIe: FP32 15.7 / 14, Tensor (fp16) 125 / 112. Volta has no TF32
    # units (an fp32 matmul stays at the fp32 rate whatever the flag says) and no bf16 rate at all.
    "v100-sxm2": {"fp32": 15.7, "tf32": 15.7, "fp16": 125.0},
    "v100-pcie": {"fp32": 14.0, "tf32": 14.0, "fp16": 112.0},
}

# torch.cuda.get_device_name -> PEAK_TFLOPS key. Exact names only: a substring match would give
# an H100 PCIe or NVL the SXM's rates, and a name not listed gets no MFU rather than a wrong one.
DEVICE_NAMES: dict[str, str] = {
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA H200": "h200-sxm",
    "NVIDIA H200 NVL": "h200-nvl",
    "NVIDIA A100-SXM4-40GB": "a100",
    "NVIDIA A100-SXM4-80GB": "a100",
    "NVIDIA A100-PCIE-40GB": "a100",
    "NVIDIA A100 80GB PCIe": "a100",
    "NVIDIA L40S": "l40s",
    "NVIDIA A10": "a10",
    "Tesla V100-SXM2-16GB": "v100-sxm2",
    "Tesla V100-SXM2-32GB": "v100-sxm2",
    "Tesla V100-PCIE-16GB": "v100-pcie",
    "Tesla V100-PCIE-32GB": "v100-pcie",
}


def peak_flops_by_precision(device: str) -> dict[str, float]:
    """FLOP/s by precision of a ``PEAK_TFLOPS`` entry ("h100-sxm", ...)."""
    return {precision: tflops * 1e12 for precision, tflops in PEAK_TFLOPS[device].items()}


def matmul_precision(dtype: str, *, tf32: bool) -> str:
    """The precision the model's matmuls execute in under ``train.dtype``: "tf32" for fp32 with
    TF32 enabled, else the dtype itself (bf16/fp16 autocast runs them in half precision)."""
    return "tf32" if dtype == "fp32" and tf32 else dtype


def gpu_peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of the GPU CUDA names ``device_name`` at ``precision``; None for a name
    not in ``DEVICE_NAMES`` or a precision its datasheet gives no rate for."""
    device = DEVICE_NAMES.get(device_name)
    if device is None or precision not in PEAK_TFLOPS[device]:
        return None
    return PEAK_TFLOPS[device][precision] * 1e12


def set_tf32(enabled: bool, *, device: torch.device) -> None:
    """``train.tf32``: fp32 matmuls (cuBLAS) and convolutions (cuDNN) on TF32 tensor cores (inputs
    rounded to a 10-bit mantissa, fp32 accumulation), or in full fp32. Process-wide; CUDA kernels
    only. Set through ``allow_tf32``, which torch's newer ``fp32_precision`` settings also read."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    if enabled and device.type != "cuda":
        log.warning("train.tf32 (True) acts only on CUDA devices: fp32 matmuls on %s run in full fp32",
                    device.type)


def tf32_enabled() -> bool:
    """Whether cuBLAS runs fp32 matmuls in TF32 now (``set_tf32``, torch's own settings, or the
    TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 environment variable, which overrides them)."""
    if os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1":
        return True
    # Read through the newer setting: it reflects either API, the legacy getter raises after a mix.
    precision = torch.backends.cuda.matmul.fp32_precision
    if precision == "none":  # inherits the setting of every backend (missing from torch's type stubs)
        precision = getattr(torch.backends, "fp32_precision", "none")
    return precision == "tf32"
