"""``checkpoint.init_from`` under expert parallelism x ZeRO-3 on 2 real gloo processes: after
``parallelize`` (experts split over ep, dense weights FSDP-sharded over dp), every rank loads the
export and the gathered global tensors equal the export's bit for bit, the fp32 router bias
included."""

from __future__ import annotations

import pytest
import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from tests.helpers.dist_launcher import run_ranks

MODEL = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, max_seq_len=32)
MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=24, activation="swiglu", expert_bias=True)


def init_from_worker(rank: int, world_size: int, path: str) -> dict:
    from torch.distributed.tensor import DTensor

    from moetrain.distributed import ParallelDims, parallelize
    from moetrain.models.transformer import Transformer
    from moetrain.train.init_from import load_initial_weights

    dims = ParallelDims(world_size=world_size, ep=2, num_experts=MOE.num_experts)
    dims.build_mesh("cpu")
    model = Transformer(MODEL, moe=MOE, seed=7)  # another seed than the export's
    parallelize(model, dims, zero_stage=3)
    sharded = sorted(n for n, t in model.state_dict(keep_vars=True).items() if isinstance(t, DTensor))
    load_initial_weights(model, path)
    full = {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for n, t in model.state_dict(keep_vars=True).items()}
    return {"full": full if rank == 0 else None, "sharded": sharded}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_init_from_at_ep2_zero3_gives_the_export_weights(tmp_path):
    from moetrain.interop.export import write_export
    from moetrain.models.transformer import Transformer

    src = Transformer(MODEL, moe=MOE, seed=1)
    with torch.no_grad():
        for name, b in src.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.linspace(-0.1, 0.1, b.numel()) + 1e-4)
    write_export(tmp_path / "export", config={}, state_dict=src.state_dict(), max_shard_bytes=30_000)
    ranks = run_ranks(init_from_worker, 2, str(tmp_path / "export"), timeout_s=180)
    # The layout really shards: expert stacks over ep, the dense weights over dp.
    assert "layers.0.feed_forward.experts.w1" in ranks[0]["sharded"]
    assert "tok_embeddings.weight" in ranks[0]["sharded"]
    want, got = src.state_dict(), ranks[0]["full"]
    assert want.keys() == got.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
