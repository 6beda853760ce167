"""``eval_layout``: a saved run's parallel layout folded to fit the process count of `moetrain eval`:
no pipeline, no ZeRO, tp and ep (etp) kept where they divide the processes (and ep the experts)."""

from __future__ import annotations

import pytest

from moetrain.config.loader import load_config
from moetrain.train.evaluate import eval_layout

TRAINED = ["--parallel.pp=2", "--parallel.tp=2", "--parallel.ep=2", "--parallel.zero_stage=2",
           "--model.tie_embeddings=false"]


@pytest.mark.parametrize("world, want", [
    (1, (1, 1, 1, 1)),      # (pp, tp, ep, etp): one process holds everything
    (2, (1, 2, 2, 1)),      # tp and ep fit two ranks; the pipeline folds into data parallelism
    (3, (1, 1, 1, 1)),
    (4, (1, 2, 2, 1)),
    (8, (1, 2, 2, 1)),
])
def test_the_layout_folds_to_fit_the_processes(world, want):
    cfg = eval_layout(load_config("tiny", TRAINED), world)
    par = cfg.parallel
    assert (par.pp, par.tp, par.ep, par.etp) == want
    assert (par.dp, par.zero_stage, par.hsdp_replicate) == (-1, 0, 1)
    assert cfg.data_parallel_size(world) == world // par.tp


def test_expert_tensor_parallelism_is_kept_where_it_fits():
    cfg = load_config("tiny", ["--parallel.ep=2", "--parallel.etp=2", "--moe.capacity_factor=null"])
    assert (eval_layout(cfg, 4).parallel.ep, eval_layout(cfg, 4).parallel.etp) == (2, 2)
    assert (eval_layout(cfg, 2).parallel.ep, eval_layout(cfg, 2).parallel.etp) == (2, 1)
