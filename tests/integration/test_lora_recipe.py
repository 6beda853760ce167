"""The README's fine-tuning recipe end to end: a Hugging Face MoE in (``--init-from-hf``), LoRA on
the attention and the routed experts at ep=2 on 2 processes, a merged Hugging Face model out. Only
the adapted projections change: every other weight of the exported model is bit-identical to the
checkpoint it started from (frozen, and not in the optimizer), and each adapted one moved."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_hf_train_from import _cli, _hf_folder


def _adapted(name: str) -> bool:
    """The tiny DeepSeek-V3's attention projections (MLA: q_a/q_b, kv_a/kv_b, o) and routed experts;
    not its latent norms, shared experts, dense first block, router or embeddings."""
    return ("self_attn." in name and name.endswith(("proj.weight", "proj_with_mqa.weight"))) or "mlp.experts." in name


def _finetune(hf, run, steps: int):
    return _cli("train", "--init-from-hf", str(hf), "--nproc", "2", "--parallel.ep=2", "--data.corpus=shakespeare",
                "--data.vocab_size=257", "--data.seq_len=32", f"--train.steps={steps}",
                "--train.global_batch_size=4", "--train.micro_batch_size=2", "--train.eval_every=0",
                "--train.device=cpu", "--optim.lr=1e-2", "--optim.warmup_steps=0", "--optim.schedule=constant",
                "--finetune.lora_rank=4", "--finetune.lora_alpha=8", "--finetune.lora_targets=[attention,experts]",
                "--checkpoint.every=0", f"--log.run_dir={run}", "--log.every=1", "--log.progress_bar=false",
                "--log.tensorboard=false")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hf_in_lora_on_experts_merged_hf_out(tmp_path, shakespeare_cached):
    from transformers import AutoModelForCausalLM

    from moetrain.cli import main

    hf_dir, run, out = tmp_path / "hf", tmp_path / "run", tmp_path / "out"
    _hf_folder(hf_dir)
    trained = _finetune(hf_dir, run, steps=3)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert main(["convert", str(run), "--to-hf", str(out)]) == 0  # a file conversion: in-process
    merged, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    original = AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
    got = merged.state_dict()
    assert set(got) == set(original)
    moved = [n for n in original if not torch.equal(got[n], original[n])]
    assert moved and all(_adapted(n) for n in moved), [n for n in moved if not _adapted(n)]
    for name in original:
        if name.endswith(("q_b_proj.weight", "o_proj.weight")):
            assert name in moved, name  # every adapted attention projection learned something
        if not _adapted(name):
            assert torch.equal(got[name], original[name]), name  # frozen: bit for bit
    assert any("mlp.experts." in n for n in moved)
