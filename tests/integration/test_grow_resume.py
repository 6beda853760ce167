"""A grown checkpoint resumes at another layout and trains: a 2-process ep=2 run (4 experts) is grown
by ``moetrain experts grow`` to 8 experts; with top_k scaled alike the grown model computes the run's
logits; the export loads (``checkpoint.init_from``'s loader) into one process and into 2 processes
at ep=2 (4 experts per rank) with the same logits, and trains at world 1.
"""

from __future__ import annotations

import pytest
import torch

from moetrain.cli import main
from moetrain.interop.export import build_model, load_source, model_configs
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides, train_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]




def _grown_model(export: str):
    """The grown model as ``checkpoint.init_from`` builds it: the model of the export's config from
    the run's seed, then the export's tensors copied in (shard by shard when parallel)."""
    from moetrain.models.transformer import Transformer

    model_cfg, moe_cfg = model_configs(load_source(export)[0])
    return Transformer(model_cfg, moe=moe_cfg, seed=0)


def _load_at_ep2(rank: int, world_size: int, export: str, ids: torch.Tensor) -> torch.Tensor:
    from moetrain.distributed import ParallelDims, parallelize
    from moetrain.train.init_from import load_initial_weights

    model = _grown_model(export)
    dims = ParallelDims(world_size=world_size, ep=2, num_experts=model.moe_config.num_experts)
    dims.build_mesh()
    wrapped = parallelize(model, dims)
    load_initial_weights(model, export)
    model.eval()
    with torch.no_grad():
        return wrapped(ids).logits


def test_grow_an_ep2_run_resume_at_world1_and_ep2(tmp_path, shakespeare_cached):
    run = tmp_path / "ep2"
    run_ranks(train_job, 2, job_overrides(run, steps=3, ep=2), timeout_s=150)

    export = str(tmp_path / "grown")
    assert main(["experts", "grow", str(run), "--num-experts", "8", "--top-k", "4", "--to", export]) == 0
    config, state, info = load_source(run)
    grown_config, _, grown_info = load_source(export)
    assert info["step"] == 3 and grown_info["step"] == 3
    assert grown_config["moe"]["num_experts"] == 8 and grown_config["moe"]["top_k"] == 4
    assert grown_config["parallel"] == config["parallel"]

    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    original = build_model(config, state).eval()
    with torch.no_grad():
        expected = original(ids).logits

    from moetrain.train.init_from import load_initial_weights
    from moetrain.train.optim import build_optimizer

    model = _grown_model(export)
    load_initial_weights(model, export)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)

    # Another layout: 4 experts per rank at ep=2, the same function.
    for logits in run_ranks(_load_at_ep2, 2, export, ids, timeout_s=120):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)

    # And it trains at world 1: a few AdamW steps on one batch bring its loss down.
    model.train()
    labels = torch.roll(ids, -1, dims=1)
    opt = build_optimizer(model, lr=3e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        out = model(ids, labels)
        out.total_loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.1, losses
