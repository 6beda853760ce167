"""``train.compile`` at ep = 1: an MoE transformer block traces into one graph (dynamo's explain
finds no graph break), and training steps whose token counts per expert change run the first
step's compiled code without recompiling.

Both are dynamo's business (tracing and guards), so the recompile test stops at the "eager"
backend: inductor's code generation costs seconds per graph on CPU. The compiled numerics
(inductor, against eager, under every parallel layout) are tested in
tests/distributed/test_compile_parallel.py.
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.models.attention import rope_rows
from moetrain.models.moe.layer import MoELayer
from moetrain.models.transformer import Transformer

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
