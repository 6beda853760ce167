"""The golden-loss run: a small deterministic job on one process, one thread.

    python -m tests.helpers.golden            # print this machine's losses (float.hex)
    python -m tests.helpers.golden --write    # regenerate tests/fixtures/golden_losses.json

What the goldens pin, and so what must match for the test to pass bit for bit:

* the job: ``job_overrides`` of ``tests/integration/conftest.py`` (2 blocks of dim 64, 4 experts
  top-2 of hidden 64, byte tokenizer on Shakespeare, 64-token sequences, global batch 8 in micro-
  batches of 4, AdamW lr 3e-3 with 2 warm-up steps and a constant schedule, fp32 on CPU) for
  ``STEPS`` steps, with ``--train.seed=1234 --train.deterministic=true``;
* one process (ep = 1) and ``torch.set_num_threads(1)``: the reduction order of a matmul depends on
  the thread count;
* the environment: the torch version, its BLAS (MKL, whose kernels differ per CPU instruction set)
  and the CPU. Another torch, BLAS or instruction set may change the last bits of a matmul, and
  every loss after it. ``environment()`` describes this machine; ``--write`` records it next to the
  losses.

Regenerate only for a change that is *meant* to change numerics (or for a new reference
environment), and say so in the commit.
"""

from __future__ import annotations

import json
import platform
import re
import sys
import tempfile
from pathlib import Path

import torch

from moetrain.config.loader import load_config
from tests.integration.conftest import job_overrides, read_losses

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden_losses.json"
STEPS = 8
REGENERATE = "python -m tests.helpers.golden --write"

COMMITTED_ENVIRONMENT = {"torch": "2.13.0+cpu", "blas": "mkl (oneAPI MKL 2024.2)",
                         "cpu": "x86_64, AVX512 (AMD EPYC, Zen 5)", "threads": 1}
"""Where the committed goldens were written, for a golden file that records no environment."""


def environment() -> dict:
    """torch version, BLAS and CPU of this process: what decides the last bits of the losses."""
    build = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", build)
    mkl = re.search(r"Math Kernel Library Version ([\w.]+)", torch.__config__.parallel_info())
    return {"torch": torch.__version__,
            "blas": (blas.group(1) if blas else "unknown") + (f" (oneAPI MKL {mkl.group(1)})" if mkl else ""),
            "cpu": f"{platform.machine()}, {torch.backends.cpu.get_cpu_capability()}", "threads": 1}


def golden_run() -> list[str]:
    """Losses of the golden run, as float.hex strings (exact, unlike decimal text)."""
    from moetrain.train.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reduction order of the matmuls depends on the thread count
    with tempfile.TemporaryDirectory() as tmp:
        overrides = job_overrides(Path(tmp) / "run", steps=STEPS,
                                  extra=("--train.deterministic=true", "--train.seed=1234"))
        trainer = Trainer(load_config(None, overrides))
        try:
            trainer.fit()
        finally:
            trainer.close()
            torch.set_num_threads(threads)
        return [float(v).hex() for v in read_losses(Path(tmp) / "run")]


def mismatch_report(golden: dict, got_hex: list[str]) -> str | None:
    """None when ``got_hex`` equals the golden losses bit for bit; else what differs (in decimal),
    the two environments and how to regenerate."""
    want_hex = golden["losses_hex"]
    if got_hex == want_hex:
        return None
    lines = [f"the golden loss curve changed ({len(want_hex)} golden steps, {len(got_hex)} run):"]
    for step, (want, got) in enumerate(zip(want_hex, got_hex, strict=True), start=1):
        a, b = float.fromhex(want), float.fromhex(got)
        mark = "" if want == got else f"   <- differs by {b - a:+.3e} ({abs(b - a) / abs(a):.1e} relative)"
        lines.append(f"  step {step}: golden {a:.9f}  this run {b:.9f}{mark}")
    recorded = golden.get("environment", COMMITTED_ENVIRONMENT)
    here = environment()
    lines.append(f"goldens written with: {_describe(recorded)}")
    lines.append(f"this run:             {_describe(here)}")
    if {k: recorded.get(k) for k in ("torch", "blas")} != {k: here[k] for k in ("torch", "blas")}:
        lines.append("the environments differ: the last bits of a matmul may too; compare on the goldens' "
                     "environment, or regenerate there for a new reference.")
    lines.append("A change that is not about numerics must leave these bits unchanged: find the first step "
                 "that differs. If the change is meant to alter numerics, regenerate with "
                 f"`{REGENERATE}` and say so in the commit.")
    return "\n".join(lines)


def _describe(env: dict) -> str:
    return f"torch {env.get('torch')}, BLAS {env.get('blas')}, CPU {env.get('cpu')}, {env.get('threads')} thread(s)"


if __name__ == "__main__":
    losses = golden_run()
    if "--write" in sys.argv:
        GOLDEN.write_text(json.dumps({"steps": STEPS, "losses_hex": losses,
                                      "losses": [float.fromhex(h) for h in losses],
                                      "environment": environment()}, indent=1) + "\n")
        print(f"wrote {GOLDEN}")
    else:
        print(json.dumps(losses))
