"""Measured memory (``moetrain.utils.memory``) on hand-sized workloads, and the planner's
activation estimate against it for the tiny preset and a larger, Mixtral-shaped model.

Estimated / measured activation peak (fp32, one process, 4 x 256 tokens) when this was written:
tiny 0.999 (ac none), 0.999 (full), 0.999 (moe), 0.999 (every_n); Mixtral-shaped at dim 256
0.999, 1.10, 1.07, 0.998; DeepSeek-shaped at dim 128 1.003, 0.999, 0.999, 1.002. The test bound
is the issue's 25%. At 2 x 128 tokens: tiny with mtp_depth 1 1.003 (none), 1.003 (full); mtp_depth
2 1.003, 1.002, 1.002 (moe); MLA as DeepSeek-V3 (vocab 256) 1.025 with CPU attention's extra
probabilities; expert choice at capacity factor 2 1.000. These hold within 10%.
"""

from dataclasses import replace

import pytest
import torch

from moetrain.config.presets import get_preset
from moetrain.distributed.parallelize import apply_activation_checkpointing, checkpoint_blocks
from moetrain.models.transformer import Transformer
from moetrain.plan.activations import estimate_activations
from moetrain.train.optim import build_optimizer
from moetrain.utils.memory import MemoryTracker, model_state_bytes, track_memory


def test_tracker_counts_a_known_workload_exactly():
    w = torch.nn.Parameter(torch.randn(256, 256))
    model = torch.nn.Module()
    model.w = w
    with MemoryTracker(model) as tracker:
        a = torch.empty(2**18)             # 1 MiB
        b = torch.empty(2**19)             # 2 MiB: 3 MiB alive
        del a
        c = torch.ones(2**18) + 1          # 1 MiB + the 1 MiB temporary of ones: 4 MiB at the add
        del b, c
        w.grad = torch.zeros(256, 256)     # allocated as an activation ...
        tracker._track(w.grad, "grad")     # ... until a hook names it a gradient
    report = tracker.report()
    assert report.activation_peak_bytes == 4 * 2**20
    assert report.param_bytes == report.grad_bytes == 256 * 256 * 4
    assert report.optim_bytes == 0
    assert tracker.current["act"] == 0


def test_tracker_labels_gradients_and_optimizer_states():
    model = torch.nn.Linear(256, 256, bias=False)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randn(64, 256)
    with MemoryTracker(model, opt) as tracker:
        model(x).square().sum().backward()
        opt.step()
    report = tracker.report()
    assert report.param_bytes == 256 * 256 * 4
    assert report.grad_bytes == 256 * 256 * 4
    # exp_avg + exp_avg_sq + step, and AdamW's temporaries inside the step.
    assert report.optim_bytes >= 2 * 256 * 256 * 4 + 4
    assert model_state_bytes(model, opt)["optim_bytes"] == 2 * 256 * 256 * 4 + 4


def test_tracker_follows_storage_resize_and_frees():
    model = torch.nn.Linear(4, 4)
    with MemoryTracker(model) as tracker:
        t = torch.empty(1024)  # 4 KiB
        t.untyped_storage().resize_(0)  # what FSDP does to a gathered parameter
        u = torch.empty(2048)  # 8 KiB
        del u
    assert tracker.peak["act"] == 8192
    assert tracker.current["act"] == 0
    del t


def test_model_state_bytes_dedups_shared_storage():
    p = get_preset("tiny")
    model = Transformer(replace(p.model, vocab_size=300), moe=p.moe, seed=0)  # tied embedding
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    n = sum(q.numel() for q in model.parameters())  # parameters() lists the tied weight once
    x = torch.randint(0, 300, (2, 9))
    model(x[:, :-1], x[:, 1:]).total_loss.backward()
    opt.step()
    states = model_state_bytes(model, opt)
    assert states["param_bytes"] == 4 * n and states["grad_bytes"] == 4 * n
    assert states["optim_bytes"] == 8 * n + 4 * len(list(model.parameters()))


def test_track_memory_disabled_costs_nothing():
    with track_memory(torch.nn.Linear(2, 2), enabled=False) as tracker:
        pass
    assert tracker is None


def _mixtral_shaped():
    """The "mixtral-mini" preset: Mixtral's structure at dim 256, larger than tiny in every way."""
    p = get_preset("mixtral-mini")
    return replace(p.model, preset=None), p.moe


def _tiny():
    p = get_preset("tiny")
    return replace(p.model, vocab_size=4096, preset=None), p.moe  # the tokenizer's 4096 tokens


def _measure(model_cfg, moe, ac, *, batch, seq):
    torch.manual_seed(0)
    model = Transformer(model_cfg, moe=moe, seed=0)
    apply_activation_checkpointing(checkpoint_blocks(model, ac))
    x = torch.randint(0, model_cfg.vocab_size, (batch, seq + 1))
    with MemoryTracker(model) as tracker:  # the optimizer step allocates no activations
        out = model(x[:, :-1], x[:, 1:])  # held through backward, as the trainer holds it
        out.total_loss.backward()
    return tracker.report().activation_peak_bytes


@pytest.mark.parametrize("name,ac", [("tiny", "none"), ("tiny", "full"), ("tiny", "moe"), ("tiny", "every_n"),
                                     ("mixtral-shaped", "none"), ("mixtral-shaped", "full")])
def test_activation_estimate_within_25_percent(name, ac):
    model_cfg, moe = _tiny() if name == "tiny" else _mixtral_shaped()
    batch, seq = (2, 256) if name == "tiny" else (1, 256)
    measured = _measure(model_cfg, moe, ac, batch=batch, seq=seq)
    estimate = estimate_activations(model_cfg, moe, micro_batch_size=batch, seq_len=seq, ac=ac).peak_bytes
    assert 0.75 <= estimate / measured <= 1.25, f"{name} ac={ac}: estimate {estimate} vs measured {measured}"


def _mla_v3():
    """DeepSeek-V3's latent attention at dim 128: a q latent and a kv latent, heads of nope 2 x
    rope features and values of nope's size (V3: 128 + 64 and 128), so v's dim is not q's; a
    256-token vocabulary so that the blocks dominate."""
    model_cfg, moe = _tiny()
    return replace(model_cfg, vocab_size=256, attention="mla", num_heads=8, q_lora_rank=96, kv_lora_rank=32,
                   qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32), moe


def _cpu_math_kernel_bytes(model_cfg, *, batch, seq):
    """What CPU attention saves beyond the fused kernels the estimate models: with a value dim
    other than q's (MLA) SDPA has no fused CPU kernel and its math path keeps each block's
    softmax probabilities, B H S S fp32 (a GPU's memory-efficient kernel keeps only q, k, v, the
    output and the log-sum-exp)."""
    if model_cfg.attention != "mla" or model_cfg.v_head_dim == model_cfg.resolved_head_dim:
        return 0
    return model_cfg.num_layers * batch * model_cfg.num_heads * seq * seq * 4


# Multi-token modules, latent attention and expert choice beyond capacity 1: the estimate once left
# their activations out (MTP: est/meas 0.78 at depth 1, 0.52 at depth 2 under "full"), used MHA
# shapes (MLA 0.85) or capped expert choice's copies at T*K (0.82 at factor 2); now 0.99 to 1.03.
@pytest.mark.parametrize("case,ac", [("mtp1", "none"), ("mtp2", "full"), ("mtp2", "moe"), ("mla-v3", "none"),
                                     ("expert-choice-cf2", "none")])
def test_activation_estimate_within_10_percent_beyond_the_plain_block(case, ac):
    model_cfg, moe = _mla_v3() if case == "mla-v3" else _tiny()
    if case.startswith("mtp"):
        model_cfg = replace(model_cfg, mtp_depth=int(case[3:]))
    if case == "expert-choice-cf2":
        moe = replace(moe, router="expert_choice", capacity_factor=2.0)
    batch, seq = 1, 128
    measured = _measure(model_cfg, moe, ac, batch=batch, seq=seq)
    estimate = (estimate_activations(model_cfg, moe, micro_batch_size=batch, seq_len=seq, ac=ac).peak_bytes
                + _cpu_math_kernel_bytes(model_cfg, batch=batch, seq=seq))
    assert 0.9 <= estimate / measured <= 1.1, f"{case} ac={ac}: estimate {estimate} vs measured {measured}"
