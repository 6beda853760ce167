"""`moetrain eval` at any process count for runs trained with tensor or pipeline parallelism: a
tp=2 run and a pp=2 run (2 steps of a tiny MoE on 2 processes) evaluate at 1 process, their layout
folded to fit, to the validation loss the run itself measured in its own layout (the trainer's
last evaluation covers the whole validation stream here, in the same batches). The run trains on
forked gloo ranks (what each rank of ``moetrain train --nproc 2`` runs; that launcher has tests of
its own) and ``moetrain eval --nproc 1`` runs in this process, as the command does at one process."""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.cli import main
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides, train_job

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout", ["--parallel.tp=2", "--parallel.pp=2"])
def test_a_tp_or_pp_run_evaluates_at_one_process(tmp_path, shakespeare_cached, capsys, layout):
    run_dir = tmp_path / "run"
    whole_stream = ("--train.eval_every=2", "--train.eval_steps=1000000", "--data.val_fraction=0.005", layout)
    run_ranks(train_job, 2, job_overrides(run_dir, steps=2, extra=whole_stream), timeout_s=240)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [rec["val_loss"] for rec in records if "val_loss" in rec][-1]

    capsys.readouterr()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the command's process would (OMP_NUM_THREADS=1): no contention with other jobs
    try:
        assert main(["eval", str(run_dir), "--nproc", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "(step 2, 1 process(es))" in out, out
    result = json.loads((run_dir / "eval-val-step2.json").read_text())
    assert result["world_size"] == 1
    assert result["val_loss"] == pytest.approx(trained, rel=1e-5)


def _val_losses(run_dir) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["val_loss"] for r in records if "val_loss" in r]


def _whole_stream_loss(run_dir, overrides: list[str]) -> float:
    """The independent reference: the run's final weights in a plain model, one forward per
    validation window, the mean over every token of every window."""
    import torch.nn.functional as F

    from moetrain.config.loader import load_config
    from moetrain.data.prepare import prepare_data
    from moetrain.train.checkpoint.index import load_model_weights
    from moetrain.train.task import build_model

    cfg = load_config(None, overrides)
    data = prepare_data(cfg.data)
    _, model = build_model(cfg, data)
    weights, _ = load_model_weights(run_dir / "checkpoints" / "step_000000002")
    model.load_state_dict(weights)
    S = cfg.data.seq_len
    tokens = torch.from_numpy(data.val_tokens.astype("int64"))
    total, count = 0.0, 0
    with torch.no_grad():
        for w in range((len(tokens) - 1) // S):
            window = tokens[w * S:w * S + S + 1]
            logits = model(window[None, :-1]).logits
            total += F.cross_entropy(logits[0].float(), window[1:], reduction="sum").item()
            count += S
    return total / count


def test_validation_covers_the_whole_stream_alike_at_every_layout(tmp_path, shakespeare_cached, capsys):
    """79 validation windows: batches of 4 (world 1) and 8 (dp = 2) leave 3 and 7 over, which a
    partial last batch now covers. train.eval_steps past the stream's end: the trainer at world 1
    and at dp = 2, and `moetrain eval` of the dp = 2 run at 1 process, all read every window, and
    give the mean a plain model computes window by window on the same weights. Before, world 1
    read 76 windows, dp = 2 72, and `moetrain eval` a number that depended on its process count."""
    extra = ("--train.eval_every=2", "--train.eval_steps=1000000", "--data.val_fraction=0.001")
    runs = {n: tmp_path / n for n in ("dp2", "world1")}
    overrides = {n: job_overrides(runs[n], steps=2, extra=extra) for n in runs}
    run_ranks(train_job, 2, overrides["dp2"], timeout_s=120)
    run_ranks(train_job, 1, overrides["world1"], timeout_s=120)
    reference = _whole_stream_loss(runs["dp2"], overrides["dp2"])
    (dp2,), (world1,) = _val_losses(runs["dp2"]), _val_losses(runs["world1"])
    assert dp2 == pytest.approx(reference, rel=1e-5)
    # The layouts' weights differ by their gradient summation order only.
    assert world1 == pytest.approx(dp2, rel=1e-4)
    capsys.readouterr()
    assert main(["eval", str(runs["dp2"]), "--nproc", "1"]) == 0
    assert json.loads((runs["dp2"] / "eval-val-step2.json").read_text())["val_loss"] == pytest.approx(reference,
                                                                                                    rel=1e-5)
