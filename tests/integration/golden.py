"""The golden-loss run: a small deterministic job on one process, one thread.

    python -m tests.integration.golden --write     # regenerate tests/integration/golden_losses.json

Regenerate only for a change that is *meant* to change numerics, and say so in the commit.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from moetrain.config.loader import load_config
from tests.integration.conftest import job_overrides, read_losses

GOLDEN = Path(__file__).with_name("golden_losses.json")
STEPS = 8


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


if __name__ == "__main__":
    losses = golden_run()
    if "--write" in sys.argv:
        GOLDEN.write_text(json.dumps({"steps": STEPS, "losses_hex": losses,
                                      "losses": [float.fromhex(h) for h in losses]}, indent=1) + "\n")
        print(f"wrote {GOLDEN}")
    else:
        print(json.dumps(losses))
