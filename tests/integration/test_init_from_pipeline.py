"""``checkpoint.init_from`` under pipeline parallelism: a pp = 2 run on 2 gloo processes starts from
the export's weights, as one process does (the same step-1 loss, unlike a fresh init's). Before,
each stage checked the export against its own layers and refused the other stage's as "not in
this model"."""

from __future__ import annotations

import pytest

from moetrain.config.loader import load_config
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides, read_losses, train_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_pipeline_run_starts_from_the_export(tmp_path, shakespeare_cached):
    from moetrain.interop.export import write_export
    from moetrain.models.transformer import Transformer

    cfg = load_config(None, job_overrides(tmp_path / "x"))
    source = Transformer(cfg.model.with_vocab_size(256), moe=cfg.moe, seed=5)  # not the runs' seed
    write_export(tmp_path / "export", config={}, state_dict=source.state_dict())
    init = (f"--checkpoint.init_from={tmp_path / 'export'}",)
    run_ranks(train_job, 2, job_overrides(tmp_path / "pp2", steps=1, extra=(*init, "--parallel.pp=2")),
              timeout_s=180)
    run_ranks(train_job, 1, job_overrides(tmp_path / "one", steps=1, extra=init), timeout_s=120)
    run_ranks(train_job, 1, job_overrides(tmp_path / "fresh", steps=1), timeout_s=120)
    (pp2,), (one,), (fresh,) = (read_losses(tmp_path / n) for n in ("pp2", "one", "fresh"))
    assert pp2 == pytest.approx(one, rel=1e-5) and abs(one - fresh) > 1e-3, (pp2, one, fresh)
