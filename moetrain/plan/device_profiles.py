"""Device profiles for the step-time model (``moetrain.plan.step_time``): one rank's rates and links,
datasheet GPUs with stated assumptions or a CPU measured by ``moetrain.plan.calibrate``."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from moetrain.utils.devices import matmul_precision, peak_flops_by_precision


@dataclass(frozen=True)
class Link:
    """One interconnect, as a rank sees it: bytes per second this rank sends (the ring volumes of
    ``plan.comm``) and seconds per call (the cost of the smallest message)."""

    bandwidth: float
    latency: float
    by_collective: dict | None = None
    """Collective name -> ``[bandwidth, latency]`` where it differs (gloo's all-to-all is pairwise
    sends, its all-reduce also sums on the CPU); None: ``bandwidth`` and ``latency`` for all."""

    def seconds(self, collective: str, num_bytes: float, num_calls: int) -> float:
        bw, lat = (self.by_collective or {}).get(collective, (self.bandwidth, self.latency))
        return num_bytes / bw + num_calls * lat


@dataclass(frozen=True)
class DeviceProfile:
    """One rank's device and links: datasheet GPUs (``H100_SXM``, ``H200``) or a measured "cpu" one."""

    name: str
    peak_flops: dict
    """Dense peak FLOP/s of one rank by matmul precision ("fp32", "tf32", "bf16"): the MFU denominator."""
    gemm_efficiency: float
    """Achieved fraction of the peak on the model's dense GEMMs."""
    expert_gemm_efficiency: float
    """Achieved fraction of the peak on the grouped expert GEMMs."""
    attention_efficiency: float
    """Achieved fraction of the peak in the attention kernel."""
    memory_bandwidth: float
    """Bytes/s (read + written) of the elementwise kernels."""
    optimizer_bandwidth: float
    """Bytes/s (read + written) of the optimizer step and gradient clipping."""
    intra_node: Link
    inter_node: Link
    comm_overlap: float = 1.0
    """Fraction of overlappable communication that does hide behind compute."""
    host_sync_s: float = 0.0
    """Seconds a host sync costs beyond the work it waits for (draining the launch queue)."""
    threads_per_rank: float = 0.0
    """CPU profiles: threads each rank ran with when measured (0: not a CPU profile)."""
    op_overhead_s: float = 0.0
    """Host seconds per tensor operation of the step beside the work the operation does (Python, autograd
    and the dispatcher; on a GPU the kernel launch); ``plan.host_ops`` counts the operations."""
    host_async: bool = False
    """True: the host dispatches ahead of the device (GPUs), so only host time beyond the device's compute
    shows; False: in series with it (CPUs: the same cores do both)."""
    ep_layer_host_s: float = 0.0
    """At ep > 1: host seconds of one MoE layer's all-to-all dispatch per micro-batch (forward and
    backward) beyond its collectives' latency: the dispatcher's index work and host reads of the split
    sizes, the functional collectives' autograd. Exposed on every device: it sits between the host sync
    of the split sizes and the all-to-all the device waits for."""
    core_share: float = 1.0
    """Cores per thread when every rank computes: cores / (processes x threads), at most 1 (CPU profiles
    of more threads than cores; 1 for one device per rank). A rank that computes while its peers wait
    in a collective gets the cores they leave, 1 / core_share times its calibrated rate."""
    dtensor_param_host_s: float = 0.0
    """At ep > 1: host seconds per ep-sharded expert parameter tensor (a DTensor) per optimizer step
    beyond a plain tensor's: its local views and placement check in the fused AdamW step and in the
    multi-tensor clipping (no DTensor operation runs there). Host time like ``op_overhead_s``."""

    def peak(self, dtype: str, *, tf32: bool = False) -> float:
        """The rate of train.dtype's matmuls: TF32's for fp32 under train.tf32 where the device has it."""
        precision = matmul_precision(dtype, tf32=tf32 and "tf32" in self.peak_flops)
        if precision not in self.peak_flops:
            raise ValueError(f"train.dtype ({dtype!r}) has no peak rate in the {self.name!r} device profile "
                             f"(measured: {', '.join(self.peak_flops)})")
        return self.peak_flops[precision]

    @staticmethod
    def from_dict(d: dict) -> DeviceProfile:
        d = dict(d)
        d["intra_node"], d["inter_node"] = Link(**d["intra_node"]), Link(**d["inter_node"])
        return DeviceProfile(**d)

    @staticmethod
    def from_json(path: str | Path) -> CalibratedProfiles:
        """A calibration file (``python -m moetrain.plan.calibrate``): its profiles by process count."""
        return CalibratedProfiles.from_dict(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class CalibratedProfiles:
    """CPU profiles measured with 1, 2, 4 ... processes sharing the cores at once: a rank's rates
    depend on how many ranks run beside it (oversubscription is measured, not assumed)."""

    by_procs: dict
    """Processes per node -> ``DeviceProfile``."""

    def for_procs(self, procs_per_node: int) -> DeviceProfile:
        if procs_per_node not in self.by_procs:
            raise ValueError(f"--nproc per node ({procs_per_node}) was not calibrated (measured: "
                             f"{', '.join(map(str, sorted(self.by_procs)))}): rerun calibrate with --procs")
        return self.by_procs[procs_per_node]

    @staticmethod
    def from_dict(d: dict) -> CalibratedProfiles:
        return CalibratedProfiles({int(n): DeviceProfile.from_dict(p) for n, p in d["profiles"].items()})


_NVLINK4 = Link(bandwidth=450e9 * 0.8, latency=10e-6)
_NDR_IB = Link(bandwidth=50e9 * 0.8, latency=25e-6)
H100_SXM = DeviceProfile(
    name="h100", peak_flops=peak_flops_by_precision("h100-sxm"), gemm_efficiency=0.7, host_sync_s=20e-6,
    op_overhead_s=10e-6, host_async=True, ep_layer_host_s=1e-3, dtensor_param_host_s=2e-6,
    expert_gemm_efficiency=0.6, attention_efficiency=0.5, memory_bandwidth=3.35e12 * 0.8,
    optimizer_bandwidth=3.35e12 * 0.8, intra_node=_NVLINK4, inter_node=_NDR_IB, comm_overlap=1.0)
"""NVIDIA H100 SXM5 in an 8-GPU HGX/DGX node. Datasheet (NVIDIA H100 Tensor Core GPU datasheet, peaks from
``utils.devices``): 989 TFLOP/s dense bf16/fp16 (1,979 with sparsity), 494 dense tf32 (fp32 under
train.tf32), 67 fp32; 3.35 TB/s HBM3; NVLink 4 at 450 GB/s each way per GPU; one 400 Gb/s (50 GB/s)
ConnectX-7 InfiniBand NDR port per GPU. Assumed, not measured: links and HBM deliver 80% of nominal (as
nccl-tests bus bandwidth shows on such nodes); GEMMs reach 70% of peak (large bf16 cuBLAS GEMMs), grouped
expert GEMMs 60%, attention 50% (FlashAttention-2 reports 50-73% of peak, Dao 2023); 10 us per NVLink and 25
us per InfiniBand collective call; 20 us per host sync; 10 us of host time per dispatched operation (eager
PyTorch's Python, autograd and launch path), hidden while the GPU has queued work; at ep > 1, 1 ms of host
work per MoE layer and micro-batch in the all-to-all dispatcher and 2 us per expert DTensor per optimizer
step (about a third of what the 2-core CPU bench measures: 2.6-4.1 ms per layer by ``plan.calibrate`` at 2
processes (docs/step-time.md), and 4.8 us per expert DTensor in the fused optimizer step at world 1, for a
server core taken as 3x faster at Python; torch's per-tensor AdamW cost 0.2-0.3 ms per expert DTensor).
``benchmarks/gpu.sh`` measures the GEMM rate."""
H200 = replace(H100_SXM, name="h200", memory_bandwidth=4.8e12 * 0.8, optimizer_bandwidth=4.8e12 * 0.8)
"""NVIDIA H200 SXM: the H100's compute (the same datasheet rates), NVLink 4 and NDR networking,
4.8 TB/s HBM3e (141 GB) (NVIDIA H200 Tensor Core GPU datasheet); the H100_SXM's assumed efficiencies."""
PROFILES = {"h100": H100_SXM, "h200": H200}


def load_profile(name_or_path: str, *, procs_per_node: int) -> DeviceProfile:
    """"h100", "h200", or a calibration JSON file (``--device-profile`` of ``moetrain plan``)."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    if not Path(name_or_path).is_file():
        raise ValueError(f"--device-profile ({name_or_path!r}) must be one of {', '.join(PROFILES)} or a "
                         "calibration file written by python -m moetrain.plan.calibrate")
    return DeviceProfile.from_json(name_or_path).for_procs(procs_per_node)
