"""`data.sources` through the trainer and its checkpoints: a run mixing two text sources resumes
with bit-equal losses and the same per-source data position as the run that never stopped, and a
checkpoint saved by one process resumes on two with the same global batches."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from moetrain.config.loader import load_config
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import read_losses


def _write_sources(root: Path) -> list[Path]:
    words = {"web": ["click", "page", "link", "home", "search", "login", "mail", "news"],
             "books": ["thou", "art", "king", "queen", "night", "love", "sword", "lord"]}
    folders = []
    for seed, (name, vocab) in enumerate(words.items()):
        rng = random.Random(seed)
        folder = root / name
        folder.mkdir(parents=True)
        for i in range(30):
            (folder / f"{i:02d}.txt").write_text(" ".join(rng.choice(vocab) for _ in range(rng.randint(30, 90))))
        folders.append(folder)
    return folders


def _overrides(run_dir: Path, sources: list[Path], *, steps: int, extra: tuple[str, ...] = ()) -> list[str]:
    listed = ", ".join(f"{{path: {p}, weight: {w}}}" for p, w in zip(sources, (3, 1), strict=True))
    return [
        "--model.dim=32", "--model.num_layers=2", "--model.num_heads=2", "--model.max_seq_len=32",
        "--moe.num_experts=4", "--moe.top_k=1", "--moe.expert_hidden_dim=32",
        "--data.corpus=path", f"--data.sources=[{listed}]", "--data.vocab_size=300", "--data.seq_len=32",
        "--data.val_fraction=0.1", "--data.document_mask=true", f"--data.cache_dir={run_dir.parent / 'cache'}",
        f"--train.steps={steps}", "--train.global_batch_size=8", "--train.micro_batch_size=4",
        "--train.eval_every=3", "--train.eval_steps=2", "--train.device=cpu", "--train.deterministic=true",
        "--optim.lr=3e-3", "--checkpoint.every=3", f"--log.run_dir={run_dir}", "--log.every=1",
        "--log.progress_bar=false", "--log.tensorboard=false", *extra,
    ]


def _call(rank: int, world_size: int, body, *args):
    return body(*args)


def _exact_resume(tmp_path: Path) -> None:
    from moetrain.train.trainer import Trainer

    torch.use_deterministic_algorithms(True)  # this child process only
    sources = _write_sources(tmp_path / "data")
    ref = Trainer(load_config(None, _overrides(tmp_path / "ref", sources, steps=6)))
    ref.fit()
    final_position = ref.train_loader.state_dict()
    ckpt = ref.checkpointer.step_path(3)
    ref.close()
    want = read_losses(tmp_path / "ref")
    assert len(want) == 6

    resumed = Trainer(load_config(None, _overrides(tmp_path / "res", sources, steps=6,
                                                   extra=(f"--checkpoint.resume={ckpt}",))))
    # The checkpoint held every source's position: 3 steps of 8 sequences, 3:1.
    position = resumed.train_loader.state_dict()
    assert resumed.step == 3 and position["consumed"] == [18, 6]
    assert [s["name"] for s in position["sources"]] == [str(p) for p in sources]
    resumed.fit()
    assert resumed.train_loader.state_dict() == final_position
    resumed.close()
    assert read_losses(tmp_path / "res") == want[3:]  # bit for bit


@pytest.mark.slow
def test_a_mixed_run_resumes_bit_for_bit(tmp_path):
    run_ranks(_call, 1, _exact_resume, tmp_path, timeout_s=240)


def _first_batch_after_resume(rank: int, world_size: int, run_dir: Path, sources: list[Path],
                              ckpt: Path) -> torch.Tensor:
    from moetrain.train.trainer import Trainer

    t = Trainer(load_config(None, _overrides(run_dir, sources, steps=6, extra=(f"--checkpoint.resume={ckpt}",))))
    batch = t.train_loader.next_batch()[0]
    t.close()
    return batch


def _one_process_source(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    """Train 3 steps on one process; return the step-3 checkpoint and the global batch of step 4."""
    from moetrain.train.trainer import Trainer

    sources = _write_sources(tmp_path / "data")
    t = Trainer(load_config(None, _overrides(tmp_path / "one", sources, steps=3)))
    t.fit()
    step4 = torch.cat([t.train_loader.next_batch()[0] for _ in range(t.grad_accum)])
    t.close()
    return t.checkpointer.step_path(3), step4


@pytest.mark.slow
def test_a_checkpoint_of_one_process_resumes_on_two_with_the_same_global_batch(tmp_path):
    ckpt, step4 = run_ranks(_call, 1, _one_process_source, tmp_path, timeout_s=180)[0]
    sources = [tmp_path / "data" / "web", tmp_path / "data" / "books"]
    halves = run_ranks(_first_batch_after_resume, 2, tmp_path / "two", sources, ckpt, timeout_s=180)
    assert torch.equal(torch.cat(halves), step4)
