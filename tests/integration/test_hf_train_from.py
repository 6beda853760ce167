"""``moetrain train --init-from-hf`` end to end on 2 processes at ep=2: a tiny random DeepSeek-V3
(MLA, sigmoid routing with an fp32 selection bias, group-limited routing, shared experts, a dense
first block) with its own tokenizer.json starts a run, which resumes and converts back to a folder
``transformers`` loads. The run really started from the checkpoint: after a few steps at a small
learning rate its weights are far closer to the Hugging Face weights than a fresh init is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import read_losses

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 320


def _hf_folder(path: Path) -> None:
    from moetrain.data.documents import Documents
    from moetrain.data.tokenizer import EOS_TOKEN, train_bpe
    from tests.helpers.hf_tiny_models import tiny_model

    (path / "text.txt").parent.mkdir(parents=True, exist_ok=True)
    (path / "text.txt").write_text("ROMEO: what light through yonder window breaks\n" * 40)
    bpe = train_bpe(Documents([path / "text.txt"], label="t"), vocab_size=280)
    (path / "text.txt").unlink()
    model = tiny_model("deepseek_v3", vocab_size=VOCAB, eos_token_id=0, bos_token_id=None)
    model.save_pretrained(path)
    bpe.save(path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN}))


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "moetrain.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def _train(hf: Path, run: Path, steps: int) -> subprocess.CompletedProcess:
    return _cli("train", "--init-from-hf", str(hf), "--nproc", "2", "--parallel.ep=2",
                "--moe.expert_impl=loop", "--data.corpus=shakespeare", "--data.vocab_size=257", "--data.seq_len=32",
                f"--train.steps={steps}", "--train.global_batch_size=4", "--train.micro_batch_size=2",
                "--train.eval_every=0", "--train.device=cpu", "--optim.lr=1e-4", "--optim.warmup_steps=0",
                "--optim.schedule=constant", "--checkpoint.every=0", f"--log.run_dir={run}", "--log.every=1",
                "--log.progress_bar=false", "--log.tensorboard=false")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_init_from_hf_trains_resumes_and_converts_back(tmp_path, shakespeare_cached):
    from transformers import AutoModelForCausalLM

    from moetrain.cli import main

    hf_dir, run = tmp_path / "hf", tmp_path / "run"
    _hf_folder(hf_dir)
    first = _train(hf_dir, run, steps=2)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    saved = (run / "config.yaml").read_text()
    assert "attention: mla" in saved and f"init_from: {run / 'hf_init'}" in saved
    assert f"tokenizer: {hf_dir / 'tokenizer.json'}" in saved

    resumed = _train(hf_dir, run, steps=4)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert len(read_losses(run)) == 4

    assert main(["convert", str(run), "--to-hf", str(tmp_path / "back")]) == 0  # a file conversion: in-process
    # The tokenizer and the special ids of the model it came from travel back with it.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "back" / name).read_bytes() == (hf_dir / name).read_bytes(), name
    assert json.loads((tmp_path / "back" / "config.json").read_text())["eos_token_id"] == 0
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info.values()), info
    original = AutoModelForCausalLM.from_pretrained(hf_dir)
    fresh = AutoModelForCausalLM.from_config(original.config)
    for name, want in original.state_dict().items():
        got = back.state_dict()[name]
        assert got.dtype == want.dtype, name
        if name.endswith("e_score_correction_bias"):
            assert torch.equal(got, want), name  # selection only: no gradient, rate 0, stays fixed
        elif want.numel() > 64 and not name.endswith("norm.weight"):
            # 4 Adam steps at lr 1e-4 move a weight by <= 4e-4; a fresh init is ~0.02 away.
            assert (got - want).abs().max() <= 5e-4, name
            assert (fresh.state_dict()[name] - want).abs().max() > 1e-2, name
