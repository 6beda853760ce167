"""A relaunch that the run's checkpoint refuses leaves the run folder as it was: config.yaml (which
reproduces the run) and tokenizer.json (which generate and export decode with) are written once
the run has started or resumed. Before, both were replaced first, and generate then decoded the
old weights with the new tokenizer."""

from __future__ import annotations

import json

import pytest

from tests.helpers.dist_launcher import RankError, run_ranks
from tests.integration.conftest import job_overrides, train_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_refused_relaunch_keeps_the_runs_config_and_tokenizer(tmp_path, shakespeare_cached):
    run_dir = tmp_path / "run"
    bpe = ("--data.tokenizer=bpe", "--data.vocab_size=300", "--checkpoint.save_final=true")
    run_ranks(train_job, 1, job_overrides(run_dir, steps=1, extra=bpe), timeout_s=120)
    # Logged with its step, the learning rate that step used: the first of 2 warmup steps, half of 3e-3.
    (record,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert record["lr"] == pytest.approx(1.5e-3)
    before = {name: (run_dir / name).read_bytes() for name in ("config.yaml", "tokenizer.json")}
    other = ("--data.tokenizer=bpe", "--data.vocab_size=280")  # another embedding: the checkpoint refuses it
    with pytest.raises(RankError, match="does not match"):
        run_ranks(train_job, 1, job_overrides(run_dir, steps=2, extra=other), timeout_s=120)
    assert {name: (run_dir / name).read_bytes() for name in before} == before


def test_a_run_without_metrics_jsonl_finishes_without_its_report(tmp_path, shakespeare_cached, capsys):
    # The report reads metrics.jsonl: with log.jsonl false the run used to train, save, then fail (exit 2).
    from moetrain.cli import main

    assert main(["train", *job_overrides(tmp_path / "run", steps=1, extra=("--log.jsonl=false",))]) == 0
    assert "report/: not drawn, log.jsonl is false" in capsys.readouterr().out
