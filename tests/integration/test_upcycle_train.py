"""``moetrain upcycle`` end to end: a tiny random dense Llama with its own tokenizer.json becomes a
4-expert top-2 MoE export, and a run starts from it on 2 processes at ep=2 (each rank holds 2 of
the experts) through ``--config DIR/config.yaml --checkpoint.init_from=DIR`` with the tokenizer
that travelled with the export. After a few steps the loss is finite, the run really started from
the export (every weight within a few Adam steps of it), and the experts, identical at the start,
have drifted apart: the router sent them different tokens."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import read_losses

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 320
LR = 1e-3
STEPS = 3


def _dense_folder(path: Path) -> None:
    from moetrain.data.documents import Documents
    from moetrain.data.tokenizer import EOS_TOKEN, train_bpe
    from tests.helpers.hf_tiny_dense import tiny_dense

    path.mkdir(parents=True, exist_ok=True)
    (path / "text.txt").write_text("ROMEO: what light through yonder window breaks\n" * 40)
    bpe = train_bpe(Documents([path / "text.txt"], label="t"), vocab_size=280)
    (path / "text.txt").unlink()
    tiny_dense("llama", vocab_size=VOCAB, eos_token_id=0).save_pretrained(path)
    bpe.save(path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN}))


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "moetrain.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_run_starts_from_upcycled_export_at_ep2(tmp_path, shakespeare_cached, capsys):
    from moetrain.cli import main
    from moetrain.interop.export import load_source, read_export

    dense, up, run = tmp_path / "dense", tmp_path / "up", tmp_path / "run"
    _dense_folder(dense)
    # A file conversion: the command runs in this process.
    assert main(["upcycle", "--from-hf", str(dense), "--num-experts", "4", "--top-k", "2", "--to", str(up)]) == 0
    assert (up / "tokenizer.json").read_bytes() == (dense / "tokenizer.json").read_bytes()
    assert f"--data.tokenizer={up / 'tokenizer.json'}" in capsys.readouterr().out

    trained = _cli("train", "--config", str(up / "config.yaml"), f"--checkpoint.init_from={up}",
                   f"--data.tokenizer={up / 'tokenizer.json'}", "--nproc", "2", "--parallel.ep=2",
                   "--moe.expert_impl=loop", "--data.corpus=shakespeare", "--data.seq_len=32",
                   # data.vocab_size is the BPE target, unused with a tokenizer.json, but the job
                   # config compares it with model.vocab_size (320 here, below the 4096 default).
                   "--data.vocab_size=257",
                   f"--train.steps={STEPS}", "--train.global_batch_size=4", "--train.micro_batch_size=2",
                   "--train.eval_every=0", "--train.device=cpu", f"--optim.lr={LR}", "--optim.warmup_steps=0",
                   "--optim.schedule=constant", "--checkpoint.every=0", f"--log.run_dir={run}", "--log.every=1",
                   "--log.progress_bar=false", "--log.tensorboard=false")
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    losses = read_losses(run)
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses

    _, start, _ = read_export(up)
    _, end, _ = load_source(run)
    assert set(end) == set(start)
    for name, want in start.items():
        # Adam moves a weight by about LR per step; a fresh init would be ~0.02 or more away.
        assert (end[name] - want).abs().max() <= 2 * STEPS * LR, name
    for layer in range(3):
        for w in ("w1", "w2", "w3"):
            name = f"layers.{layer}.feed_forward.experts.{w}"
            assert all((start[name][e] == start[name][0]).all() for e in range(4)), name
            moved = [float((end[name][e] - end[name][0]).abs().max()) for e in range(1, 4)]
            assert min(moved) > 1e-5, (name, moved)
