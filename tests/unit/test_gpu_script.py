"""benchmarks/gpu.sh without a GPU: on a machine without CUDA it stops before importing or
installing anything; with a stand-in ``nvidia-smi`` and a stand-in interpreter that records its
calls, it runs the CUDA tests first, then the layer benchmark, then the training run, and its
gpu.json holds the tests' outcomes next to the measurements, even when a test fails."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.sh"


def _bin_dir(tmp_path: Path, nvidia_smi: str | None) -> Path:
    """A PATH with the few tools the script needs before its check, python deliberately absent."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "tee", "mkdir"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    if nvidia_smi is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!{shutil.which('bash')}\n{nvidia_smi}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("nvidia_smi", [None, "echo 'NVIDIA-SMI has failed' >&2; exit 9"],
                         ids=["no-nvidia-smi", "nvidia-smi-finds-no-gpu"])
def test_stops_at_once_with_a_clear_message(tmp_path, nvidia_smi):
    env = {"PATH": str(_bin_dir(tmp_path, nvidia_smi)), "OUT": str(tmp_path / "out")}
    proc = subprocess.run([shutil.which("bash"), str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2
    assert "no CUDA device here" in proc.stderr and "benchmarks/moe_layer.py" in proc.stderr
    assert proc.stdout == "" and not (tmp_path / "out").exists()  # nothing ran, nothing written


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="2">
<testcase classname="tests.gpu.test_experts_cuda" name="test_a" time="1.5"/>
<testcase classname="tests.gpu.test_dispatch_cuda" name="test_b" time="0.25">
<failure message="AssertionError: bytes differ">trace</failure></testcase>
</testsuite></testsuites>"""

# Stands in for the GPU machine's python: logs each call, answers the script's steps with made-up
# outputs (a JUnit report with one failure and pytest's exit code 1, a layer row, two logged
# training steps) and runs anything else (the report writer) with the real interpreter.
FAKE_PYTHON = """#!{bash}
echo "$*" >> "$CALLS"
case "$1" in
  -c) echo "device: Fake GPU | torch 0" ;;
  benchmarks/moe_layer.py) echo '{{"shape": "A", "speedup": 1.5}}' ;;
  -m)
    for arg in "$@"; do
      case "$arg" in
        --junitxml=*) printf '%s' "$JUNIT" > "${{arg#--junitxml=}}"; echo "1 failed, 1 passed"; exit 1 ;;
        --log.run_dir=*) run="${{arg#--log.run_dir=}}"; mkdir -p "$run"
          printf '%s\\n' '{{"step": 10, "loss": 6.0, "tokens_per_s": 10.0}}' \\
            '{{"step": 20, "loss": 5.0, "tokens_per_s": 20.0, "mfu": 0.3, "mem/peak_gib": 7.0}}' \\
            > "$run/metrics.jsonl" ;;
      esac
    done ;;
  *) exec {python} "$@" ;;
esac
"""


def test_runs_the_cuda_tests_first_and_reports_them_with_the_measurements(tmp_path):
    bin_dir = _bin_dir(tmp_path, "echo 'GPU 0: Fake GPU (UUID: GPU-0)'")
    fake = bin_dir / "fake-python"
    fake.write_text(FAKE_PYTHON.format(bash=shutil.which("bash"), python=sys.executable))
    fake.chmod(0o755)
    out, calls = tmp_path / "out", tmp_path / "calls.log"
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(fake), "OUT": str(out),
           "TRAIN_RUN": str(tmp_path / "run"), "CALLS": str(calls), "JUNIT": JUNIT}
    proc = subprocess.run([shutil.which("bash"), str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    # A failed CUDA test fails the call, after the measurements ran.
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the CUDA tests failed (pytest exit code 1" in proc.stderr

    steps = [line.split()[0] if not line.startswith("-m") else " ".join(line.split()[:2])
             for line in calls.read_text().splitlines()]
    assert steps == ["-c", "-c", "-m pytest", "benchmarks/moe_layer.py", "-m moetrain.cli",
                     "benchmarks/gpu_report.py"], steps
    pytest_call = next(line for line in calls.read_text().splitlines() if line.startswith("-m pytest"))
    assert " -m cuda tests/gpu " in f" {pytest_call} " and f"--junitxml={out / 'tests.xml'}" in pytest_call

    report = json.loads((out / "gpu.json").read_text())
    assert report["device"] == "device: Fake GPU | torch 0"
    tests = report["tests"]
    assert tests["exit_code"] == 1 and tests["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 0}
    assert tests["cases"][0] == {"name": "tests.gpu.test_experts_cuda::test_a", "outcome": "passed", "time_s": 1.5}
    assert tests["cases"][1]["outcome"] == "failed" and "bytes differ" in tests["cases"][1]["message"]
    assert report["layer"] == [{"shape": "A", "speedup": 1.5}]
    # The first logged window (warm-up) is left out.
    assert report["train"] == [{"step": 20, "loss": 5.0, "tokens_per_s": 20.0, "mfu": 0.3}]
    assert report["train_peak_memory"] == {"mem/peak_gib": 7.0}
