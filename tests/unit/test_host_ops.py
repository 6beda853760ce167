"""The operation count behind the step-time model's host term (``plan.host_ops``): taken at small
widths, it equals the count of the model at its real widths, counted here by a separate dispatch
mode on a model built from the unchanged config; and the step-time model charges it as it says."""

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moetrain.config.loader import load_config
from moetrain.distributed.data_parallel.grads import clip_global_grad_norm_
from moetrain.models.transformer import Transformer
from moetrain.plan.host_ops import count_host_ops, small_widths
from moetrain.plan.model_states import Layout, param_specs
from moetrain.plan.planner import resolve_vocab
from moetrain.plan.step_time import H100_SXM, DeviceProfile, Link, estimate_step_time
from moetrain.train.optim import build_optimizer

JOBS = {
    "tiny": [],  # MHA, every block MoE, lm head
    "mla-shared-groups-mtp": ["--model.attention=mla", "--model.q_lora_rank=32", "--moe.num_shared_experts=1",
                              "--moe.router=sigmoid", "--moe.num_expert_groups=4", "--moe.top_groups=2",
                              "--model.mtp_depth=1", "--model.moe_every=2"],
    "classifier": ["--model.head=classifier", "--model.num_classes=5", "--model.causal=false",
                   "--model.pooling=attention", "--model.dropout=0.1", "--model.num_kv_heads=2"],
}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _full_width_counts(model, moe) -> tuple[int, int]:
    torch.manual_seed(0)
    net = Transformer(model, moe=moe).train()
    opt = build_optimizer(net, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)  # as the trainer builds it
    ids_BS = torch.randint(0, model.vocab_size, (1, 16))
    labels = torch.zeros(1, dtype=torch.long) if model.head == "classifier" else torch.randint(0, 100, (1, 16))

    def micro():
        net(ids_BS, labels).loss.backward()

    def step():
        clip_global_grad_norm_(list(net.parameters()), 1.0)  # as the trainer clips
        opt.step()
        opt.zero_grad(set_to_none=True)

    micro()
    step()
    counts = []
    for fn in (micro, step):
        with _Ops() as ops:
            fn()
        counts.append(ops.n)
    return counts[0], counts[1]


@pytest.mark.parametrize("job", sorted(JOBS))
def test_the_small_width_count_is_the_real_models(job):
    cfg = load_config("tiny", JOBS[job])
    model = resolve_vocab(cfg)
    small, small_moe = small_widths(model, cfg.moe)
    assert small.dim < model.dim and small_moe.expert_hidden_dim < cfg.moe.expert_hidden_dim
    got = count_host_ops(model, cfg.moe)
    assert (got.micro_batch, got.optimizer) == _full_width_counts(model, cfg.moe)
    assert got.per_step(3) == 3 * got.micro_batch + got.optimizer


def test_more_layers_more_operations_in_the_micro_batch_not_in_the_optimizer_step():
    # The optimizer step is multi-tensor (norms, scaling, fused AdamW): its operations count the
    # parameter groups, not the parameters.
    cfg = load_config("tiny", [])
    two, four = (count_host_ops(replace(resolve_vocab(cfg), num_layers=n), cfg.moe) for n in (2, 4))
    assert four.micro_batch > two.micro_batch
    assert four.optimizer == two.optimizer


def _profile(op_overhead_s: float, host_async: bool) -> DeviceProfile:
    link = Link(bandwidth=1e9, latency=1e-5)
    return DeviceProfile(name="test", peak_flops={"fp32": 1e11}, gemm_efficiency=1.0, expert_gemm_efficiency=1.0,
                         attention_efficiency=1.0, memory_bandwidth=1e10, optimizer_bandwidth=1e10, intra_node=link,
                         inter_node=link, op_overhead_s=op_overhead_s, host_async=host_async)


@pytest.mark.parametrize("accum", [1, 2])
def test_the_host_term_in_series_on_a_cpu_and_hidden_on_a_gpu(accum):
    cfg = load_config("tiny", [])
    model, moe = resolve_vocab(cfg), cfg.moe
    ops = count_host_ops(model, moe)

    def est(profile):
        return estimate_step_time(param_specs(model, moe), Layout(world=2, ep=2, zero_stage=0), model, moe,
                                  micro_batch_size=2, seq_len=64, grad_accum=accum, profile=profile)

    none, cpu = est(_profile(0.0, False)), est(_profile(2e-5, False))
    assert none.host_s == 0.0
    assert cpu.host_s == pytest.approx((accum * ops.micro_batch + ops.optimizer) * 2e-5, rel=1e-12)
    assert cpu.step_s - none.step_s == pytest.approx(cpu.host_s, rel=1e-9)
    device = none.compute_s + none.optimizer_s
    # Asynchronous dispatch: only host time beyond the device's work shows.
    hidden = est(_profile(0.5 * device / ops.per_step(accum), True))
    assert hidden.host_s == 0.0
    exposed = est(_profile(3 * device / ops.per_step(accum), True))
    assert exposed.host_s == pytest.approx(2 * device, rel=1e-9)
    # The H100 profile's 10 us per operation: a big model's step is its device work.
    assert H100_SXM.host_async and H100_SXM.op_overhead_s == 10e-6
