"""The attention variants under the parallel layouts: latent attention with packed-document masks
and the q/k-norm, bias and clip variant, trained a few AdamW steps on 2 gloo ranks with expert
parallelism, ZeRO-3 (FSDP2) or ZeRO-1, activation checkpointing, against one plain process on the
same global batch (the zero_parity harness: losses, gradient norms, every final parameter).
Nothing in attention depends on the layout, so the tolerances are those of test_zero_parity.py."""

import pytest

from tests.distributed.workers.zero_parity import Run, assert_matches, run_reference, zero_worker
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MLA_DOCUMENTS = {"attention": "mla", "q_lora_rank": 12, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                 "qk_rope_head_dim": 6, "v_head_dim": 10, "rope_interleave": True,
                 "document_separator": 5}  # id 5 recurs in the counting sequences: several documents each
QK_NORM_BIAS_CLIP = {"num_kv_heads": 1, "head_dim": 12, "qkv_bias": True, "qk_norm": "full", "clip_qkv": 2.0}


def test_attention_variants_under_ep_and_zero_world2():
    runs = [Run("mla_documents_stage3_ep2_ac", 3, ep=2, steps=4, ac="full", model=MLA_DOCUMENTS),
            Run("mla_documents_stage1_ep2", 1, ep=2, steps=4, model=MLA_DOCUMENTS),
            Run("qk_norm_bias_clip_stage3_ep2", 3, ep=2, steps=4, model=QK_NORM_BIAS_CLIP),
            Run("qk_norm_head_stage2_ep1_ac_moe", 2, ep=1, steps=4, ac="moe",
                model={"head_dim": 12, "qk_norm": "head"})]
    results = run_ranks(zero_worker, 2, runs, timeout_s=200)
    for run in runs:
        ref = run_reference(Run("ref", 0, steps=run.steps, model=run.model))
        assert_matches(run, results, ref, rtol=1e-5, param_rtol=1e-4)
