"""What a user installs: the wheel built from this tree, installed into a fresh virtual environment,
runs `moetrain` from an empty folder, with the shipped configs coming from the installed package.

The fresh environment has no pip and no dependencies of its own: a .pth file puts this
interpreter's site-packages (torch, numpy, yaml ...) after its own, so nothing is downloaded. That
folder's own .pth files are not run from there, so the checkout's editable install stays out: the
test checks that ``moetrain`` is imported from the wheel.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], *, cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin/ folder of a fresh venv holding the wheel of this tree."""
    tmp = tmp_path_factory.mktemp("wheel")
    # Build from a copy: the build leaves build/ and *.egg-info next to the sources.
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "moetrain", src / "moetrain", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(dist), str(src)], cwd=tmp)
    (wheel,) = dist.glob("moetrain-*.whl")

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
          str(wheel)], cwd=tmp)
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   cwd=tmp).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "_moetrain_test_deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    return venv / "bin"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORLD_SIZE", "LOCAL_RANK")}
    return dict(env, OMP_NUM_THREADS="1")


@pytest.mark.slow
def test_wheel_runs_config_show_by_name_from_an_empty_folder(installed, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    code = "import moetrain.config.loader as m; print(m.__file__); print(m.SHIPPED_CONFIGS)"
    where = _run([str(installed / "python"), "-c", code], cwd=empty, env=_env()).stdout.split()
    assert all(Path(p).is_relative_to(installed.parent) for p in where), where  # the wheel, not the checkout

    out = _run([str(installed / "moetrain"), "config", "show", "--config", "tiny"], cwd=empty, env=_env()).stdout
    # The values of moetrain/configs/tiny.yaml and its preset ("*": differs from the defaults).
    for line in (r"\* model\.preset\s+= 'tiny'", r"\* model\.tie_embeddings\s+= True", r"  moe\.num_experts\s+= 8",
                 r"\* parallel\.ep\s+= 2", r"  data\.corpus\s+= 'shakespeare'", r"\* train\.steps\s+= 300"):
        assert re.search(rf"^{line}$", out, re.MULTILINE), (line, out)
    assert list(empty.iterdir()) == []  # nothing written into the user's folder

    r = subprocess.run([str(installed / "moetrain"), "config", "show", "--config", "nope"], cwd=empty, env=_env(),
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and r.stderr.strip() == (
        "moetrain: error: --config ('nope') is neither a file nor a shipped config; shipped configs: "
        + ", ".join(sorted(p.stem for p in (ROOT / "moetrain" / "configs").glob("*.yaml")))), r.stderr  # all packaged
