"""The MFU denominator: datasheet peaks matched by exact CUDA device name, the precision the
matmuls run at (TF32 only where ``train.tf32`` enabled it), and the flag reaching torch."""

import logging

import pytest
import torch
import torch.distributed as dist

from moetrain.config import TrainConfig, load_config
from moetrain.distributed.runtime import init_runtime
from moetrain.plan.step_time import H100_SXM, H200, DeviceProfile, Link, estimate_for_config
from moetrain.train import flops
from moetrain.train.metrics import MetricsWindow
from moetrain.utils.devices import (
    DEVICE_NAMES,
    PEAK_TFLOPS,
    gpu_peak_flops,
    matmul_precision,
    peak_flops_by_precision,
    set_tf32,
    tf32_enabled,
)

CUDA = torch.device("cuda")  # a device object only: nothing here runs on CUDA


@pytest.fixture
def tf32_flags():
    """Restore torch's TF32 flags after a test that sets them."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def gpu_named(monkeypatch):
    """Make ``torch.cuda.get_device_name`` report a given name; forget earlier warnings."""
    flops._warn_no_peak.cache_clear()

    def name(value: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: value)

    return name


@pytest.mark.parametrize("name, bf16, tf32, fp32", [
    ("NVIDIA H100 80GB HBM3", 989, 494, 67),   # SXM5
    ("NVIDIA H100 PCIe", 756, 378, 51),
    ("NVIDIA H100 NVL", 835, 417, 60),
    ("NVIDIA H200", 989, 494, 67),
    ("NVIDIA A100-SXM4-80GB", 312, 156, 19.5),
    ("NVIDIA A100 80GB PCIe", 312, 156, 19.5),
])
def test_exact_names_pick_their_own_datasheet_rates(name, bf16, tf32, fp32):
    assert gpu_peak_flops(name, "bf16") == bf16 * 1e12
    assert gpu_peak_flops(name, "tf32") == tf32 * 1e12
    assert gpu_peak_flops(name, "fp32") == fp32 * 1e12


@pytest.mark.parametrize("name", ["NVIDIA H100", "H100", "NVIDIA H100 80GB HBM3 ", "nvidia h100 pcie",
                                  "NVIDIA A10G", "NVIDIA GH200 480GB", "NVIDIA B200"])
def test_names_not_in_the_table_get_no_peak(name):
    assert gpu_peak_flops(name, "bf16") is None


def test_the_table_holds_dense_rates():
    """Every name maps to an entry; on each entry with tensor-core TF32 the half-precision rate is
    twice it (dense against dense: a sparse figure in one column would double it), and both are
    above the plain fp32 rate."""
    assert set(DEVICE_NAMES.values()) <= set(PEAK_TFLOPS)
    for device, rates in PEAK_TFLOPS.items():
        assert rates["tf32"] >= rates["fp32"], device
        if "bf16" in rates:
            assert rates["bf16"] == pytest.approx(2 * rates["tf32"], rel=0.02), device
            assert rates["tf32"] > rates["fp32"], device
    assert gpu_peak_flops("Tesla V100-SXM2-32GB", "bf16") is None  # Volta has no bf16 rate


@pytest.mark.parametrize("dtype, tf32, precision", [
    ("fp32", False, "fp32"), ("fp32", True, "tf32"), ("bf16", False, "bf16"), ("bf16", True, "bf16"),
    ("fp16", True, "fp16"),
])
def test_matmul_precision(dtype, tf32, precision):
    assert matmul_precision(dtype, tf32=tf32) == precision


@pytest.mark.parametrize("dtype, tf32, tflops", [
    ("fp32", False, 67), ("fp32", True, 494), ("bf16", False, 989), ("bf16", True, 989), ("fp16", False, 989),
])
def test_trainer_denominator_follows_what_torch_has_enabled(gpu_named, tf32_flags, dtype, tf32, tflops):
    gpu_named("NVIDIA H100 80GB HBM3")
    set_tf32(tf32, device=CUDA)
    assert flops.peak_flops(CUDA, dtype) == tflops * 1e12


def test_unknown_gpu_gives_no_mfu_and_one_warning(gpu_named, caplog):
    gpu_named("NVIDIA Imaginary X1")
    with caplog.at_level(logging.WARNING, logger="moetrain.train.flops"):
        assert flops.peak_flops(CUDA, "bf16") is None
        assert flops.peak_flops(CUDA, "bf16") is None
    warnings = [r for r in caplog.records if r.name == "moetrain.train.flops"]
    assert len(warnings) == 1 and "'NVIDIA Imaginary X1'" in warnings[0].getMessage()
    window = MetricsWindow()
    window.add_step(None, tokens=64)
    assert window.throughput(seq_len=8, num_ranks=1, flops_per_token=10.0, peak_flops=None)["mfu"] is None
    assert window.throughput(seq_len=8, num_ranks=1, flops_per_token=10.0, peak_flops=1e3)["mfu"] > 0


def test_tf32_flag_reaches_torch_backends(tf32_flags):
    set_tf32(True, device=CUDA)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.backends.cuda.matmul.fp32_precision == "tf32" and tf32_enabled()
    set_tf32(False, device=CUDA)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.backends.cuda.matmul.fp32_precision == "ieee" and not tf32_enabled()


def test_tf32_override_variable_counts_as_enabled(tf32_flags, monkeypatch):
    set_tf32(False, device=CUDA)
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")
    assert tf32_enabled()


def test_tf32_on_cpu_warns_and_changes_no_cpu_result(tf32_flags, caplog):
    a, b = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)), torch.randn(48, 32)
    set_tf32(False, device=torch.device("cpu"))
    full = a @ b
    with caplog.at_level(logging.WARNING, logger="moetrain.utils.devices"):
        set_tf32(True, device=torch.device("cpu"))
    assert "acts only on CUDA" in caplog.text
    assert torch.equal(a @ b, full)


def test_runtime_start_applies_train_tf32(tf32_flags):
    """``train.tf32`` acts where every job starts: the trainer and eval pass it to init_runtime."""
    created = not dist.is_initialized()
    try:
        init_runtime(device="cpu", backend="gloo", deterministic=False, tf32=True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        init_runtime(device="cpu", backend="gloo", deterministic=False, tf32=False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not tf32_enabled()
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def test_tf32_field_is_validated_and_loads():
    with pytest.raises(ValueError, match=r"^train\.tf32 \(1\) must be true or false"):
        TrainConfig(tf32=1)
    assert TrainConfig().tf32 is False
    assert load_config("tiny", ["--train.tf32=true"]).train.tf32 is True


def test_planner_uses_the_same_table_and_the_same_rule():
    assert H100_SXM.peak_flops == peak_flops_by_precision("h100-sxm")
    assert H200.peak_flops == peak_flops_by_precision("h200-sxm")
    assert H100_SXM.peak("fp32") == 67e12 and H100_SXM.peak("fp32", tf32=True) == 494e12
    assert H100_SXM.peak("bf16", tf32=True) == 989e12
    link = Link(bandwidth=1e9, latency=0.0)
    cpu = DeviceProfile(name="cpu", peak_flops={"fp32": 5e10}, gemm_efficiency=1.0, expert_gemm_efficiency=1.0,
                        attention_efficiency=1.0, memory_bandwidth=1e10, optimizer_bandwidth=1e10,
                        intra_node=link, inter_node=link)
    assert cpu.peak("fp32", tf32=True) == 5e10  # TF32 does not act on CPUs
    plain = estimate_for_config(load_config("tiny", []), world=2, profile=H200)
    tf32 = estimate_for_config(load_config("tiny", ["--train.tf32=true"]), world=2, profile=H200)
    assert (plain.peak_flops, tf32.peak_flops) == (67e12, 494e12)
    assert tf32.compute_s < plain.compute_s and tf32.mfu < plain.mfu
