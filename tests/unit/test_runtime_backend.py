"""The process group's backend (``runtime.resolve_backend``): NCCL on CUDA, gloo on the CPU, and
under ZeRO offload gloo beside NCCL, since FSDP2 then keeps the gradients on the host and the
global norm's and the overflow check's all-reduces take host tensors, which NCCL refuses. (The
NCCL side runs on GPU machines only; what a job asks for is checked here.)"""

import pytest

from moetrain.config.loader import load_config
from moetrain.distributed import runtime
from moetrain.distributed.runtime import resolve_backend


@pytest.mark.parametrize(("backend", "device", "host", "want"), [
    ("auto", "cuda", False, "nccl"),
    ("auto", "cuda", True, "cuda:nccl,cpu:gloo"),
    ("nccl", "cuda", True, "cuda:nccl,cpu:gloo"),
    ("auto", "cpu", True, "gloo"),
    ("gloo", "cuda", True, "gloo"),
])
def test_the_backend_follows_the_device_and_the_offload(backend, device, host, want):
    assert resolve_backend(backend, device_type=device, host_collectives=host) == want


@pytest.mark.parametrize(("overrides", "host"), [
    ([], False),
    (["--parallel.zero_stage=2", "--zero.offload_optimizer=cpu"], True),
    (["--parallel.zero_stage=3", "--zero.offload_param=cpu"], True),
])
def test_a_job_asks_for_host_collectives_exactly_when_it_offloads(monkeypatch, overrides, host):
    asked = {}
    monkeypatch.setattr(runtime, "init_runtime", lambda **kwargs: asked.update(kwargs))
    cfg = load_config(None, ["--train.device=cpu", "--parallel.backend=gloo", "--train.tf32=true", *overrides])
    runtime.init_job_runtime(cfg)
    assert asked == {"device": "cpu", "backend": "gloo", "deterministic": cfg.train.deterministic, "tf32": True,
                     "host_collectives": host}


def test_nccl_on_a_cpu_device_is_one_clear_error():
    # Before, torch raised "Distributed package doesn't have NCCL built in" from deep in its setup.
    with pytest.raises(ValueError, match=r"parallel.backend \('nccl'\) needs a CUDA device \(this process "
                                         r"trains on 'cpu'\)"):
        resolve_backend("nccl", device_type="cpu")
