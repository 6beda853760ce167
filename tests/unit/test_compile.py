"""``train.compile`` at ep = 1: an MoE transformer block traces into one graph (dynamo's explain
finds no graph break), also with the balancer's routing statistics on (counted once, as eager
counts them, with every activation-checkpointing mode), and training steps whose token counts per
expert change run the first step's compiled code without recompiling.

Both are dynamo's business (tracing and guards), so the recompile test stops at the "eager"
backend: inductor's code generation costs seconds per graph on CPU. The compiled numerics
(inductor, against eager, under every parallel layout) are tested in
tests/distributed/test_compile_parallel.py.
"""

import functools

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.distributed.parallelize import (
    apply_activation_checkpointing,
    checkpoint_blocks,
    compile_blocks,
    compiled_blocks,
)
from moetrain.models.attention import rope_rows
from moetrain.models.moe.layer import MoELayer
from moetrain.models.transformer import Transformer
from moetrain.train.balancing import install_balancing

DIM, SEQ = 32, 16

# The dropless path's variants: softmax top-k with GELU experts; sigmoid scores with a selection
# bias and group limit, SwiGLU experts and a gated shared expert.
VARIANTS = {
    "softmax_gelu": {},
    "sigmoid_groups_swiglu_shared": {"router": "sigmoid", "expert_bias": True, "num_expert_groups": 2,
                                     "top_groups": 1, "activation": "swiglu", "num_shared_experts": 1,
                                     "shared_expert_gate": True},
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


CONFIG = ModelConfig(vocab_size=64, dim=DIM, num_layers=1, num_heads=2, max_seq_len=SEQ)


def _moe_block(variant: dict) -> torch.nn.Module:
    """The MoE transformer block of a one-block model (attention, norms, the MoE layer)."""
    model = Transformer(CONFIG, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=32, **variant), seed=0)
    block = model.layers[0]
    assert isinstance(block.feed_forward, MoELayer)
    return block


def _rope() -> tuple[torch.Tensor, torch.Tensor]:
    model = Transformer(CONFIG, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=32), seed=0)
    return rope_rows(CONFIG, model.rope_cos_SA, model.rope_sin_SA, 0, SEQ)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_moe_block_traces_without_a_graph_break(name):
    block = _moe_block(VARIANTS[name])
    x_BSD = torch.randn(2, SEQ, DIM)
    cos, sin = _rope()

    def step(x):
        h, aux = block(x, cos, sin)
        return h.square().mean() + aux.loss

    explained = torch._dynamo.explain(step)(x_BSD)
    reasons = [b.reason for b in explained.break_reasons]
    assert explained.graph_break_count == 0, reasons
    assert explained.graph_count == 1


def _loss_and_grads(block, x_BSD) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    cos, sin = _rope()
    block.zero_grad(set_to_none=True)
    h, aux = block(x_BSD, cos, sin)
    loss = h.square().mean() + aux.loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in block.named_parameters()}


def test_steps_with_changing_expert_loads_do_not_recompile():
    # Dropless at ep = 1 every shape is fixed by T and K; the per-expert counts are tensor data
    # (the grouped GEMM's offsets), never Python ints, so nothing guards on them. A recompile
    # raises here (error_on_recompile).
    block = _moe_block(VARIANTS["softmax_gelu"])
    block.compile(backend="eager")
    opt = torch.optim.SGD(block.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(0)
    loads = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(4):
            # Each step draws its tokens around a different expert's router row: the loads move.
            bias_D = 3.0 * block.feed_forward.router.gate.weight[step % 4].detach() / 0.02
            x_BSD = torch.randn(2, SEQ, DIM, generator=g) + bias_D
            _loss_and_grads(block, x_BSD)
            loads.append(block.feed_forward.tokens_per_expert.tolist())
            opt.step()
    assert len({tuple(load) for load in loads}) == len(loads), f"the loads did not change: {loads}"
    assert counters["stats"]["unique_graphs"] >= 1, "the block did not compile"
    assert sum(counters["recompiles"].values()) == 0


def _aot_eager(monkeypatch) -> None:
    """parallelize's compiles through aot_eager: dynamo's graphs and aot_autograd's forward/backward
    split (buffer mutations, checkpoint recompute) as inductor gets them, without code generation."""
    compile_fn, module_compile = torch.compile, torch.nn.Module.compile
    monkeypatch.setattr(torch, "compile", functools.partial(compile_fn, backend="aot_eager"))
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: module_compile(self, backend="aot_eager", **kw))


def _step_stats(model_config: ModelConfig, *, compile: bool, ac: str) -> list[list[torch.Tensor]]:
    """Every MoE layer's step statistics after two micro-batches of a model with the balancer
    installed (as the trainer installs it), read before the optimizer step would zero them."""
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=32, collapse_threshold=0.9)
    model = Transformer(model_config, moe=moe, seed=0)
    checkpointed = checkpoint_blocks(model, ac)
    apply_activation_checkpointing(checkpointed, compile=compile)
    if compile:
        compile_blocks(compiled_blocks(model), checkpointed=checkpointed)
    install_balancing(torch.optim.SGD(model.parameters(), lr=0.1), model)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, model_config.vocab_size, (2, SEQ), generator=g)
        model(ids, ids.roll(-1, 1)).total_loss.backward()
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    return [[layer.step_routed_E.clone(), layer.step_local_stats.clone()] for layer in layers]


@pytest.mark.parametrize("ac", ["none", "full", "moe"])
def test_routing_statistics_compile_in_the_block_graph_and_count_each_forward_once(ac, monkeypatch):
    # The trainer always installs the balancer, which has every MoE layer add its routing counts to
    # the step's statistics. Recorded in the compiled block (no checkpoint around it) or after the
    # checkpoint (which the recompute in backward does not reach): one graph, no break, and the
    # counts of the eager model without checkpointing (a recompute counted again would double them).
    reference = _step_stats(CONFIG, compile=False, ac="none")
    assert _same_stats(_step_stats(CONFIG, compile=False, ac=ac), reference)
    _aot_eager(monkeypatch)
    compiled = _step_stats(CONFIG, compile=True, ac=ac)
    breaks = {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()}
    assert sum(counters["graph_break"].values()) == 0, breaks
    assert counters["stats"]["unique_graphs"] == 1
    assert _same_stats(compiled, reference)


def _same_stats(stats: list[list[torch.Tensor]], reference: list[list[torch.Tensor]]) -> bool:
    """Counts exactly, the summed entropy within fp32 reordering (inductor and eager sum alike
    here: aot_eager runs the same kernels)."""
    assert len(stats) == len(reference)
    return all(torch.equal(r, r_ref) and torch.allclose(s, s_ref, rtol=1e-6, atol=0)
               for (r, s), (r_ref, s_ref) in zip(stats, reference, strict=True))


@pytest.mark.parametrize("ac", ["none", "full", "moe"])
def test_the_multi_token_block_is_compiled_like_the_others(ac, monkeypatch):
    # model.mtp[0].block is a transformer block: compiled as the trunk's are (a static graph at S - 1
    # positions), its routing statistics counted once, as eager counts them. "full" and "every_n"
    # checkpoint the trunk's blocks only, as the activation planner counts them; "moe" its MoE layer.
    mtp_config = ModelConfig(vocab_size=64, dim=DIM, num_layers=2, num_heads=2, max_seq_len=SEQ, mtp_depth=1)
    model = Transformer(mtp_config, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=32), seed=0)
    mtp_block = model.mtp_modules()[0].block
    assert compiled_blocks(model) == [*model.layers, mtp_block]
    assert checkpoint_blocks(model, "full") == list(model.layers)
    assert checkpoint_blocks(model, "moe")[-1] is mtp_block.feed_forward
    reference = _step_stats(mtp_config, compile=False, ac="none")
    assert len(reference) == 3, "two trunk MoE layers and the multi-token block's"
    _aot_eager(monkeypatch)
    compiled = _step_stats(mtp_config, compile=True, ac=ac)
    assert sum(counters["graph_break"].values()) == 0
    # One graph at S positions (the trunk's blocks), one at S - 1 (the multi-token block).
    assert counters["stats"]["unique_graphs"] == 2
    assert _same_stats(compiled, reference)
