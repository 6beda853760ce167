"""benchmarks/gpu.sh on a machine without CUDA: it stops before importing or installing anything."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.sh"


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
