"""optim.ema_decay through the Trainer, on real gloo processes (the small classifier of test_classify):

- the run's average is the recurrence over the weights after each step, recomputed here in float64;
- its evaluations use the average: the final test metrics are those of the recomputed average loaded by
  hand, not those of the raw weights;
- the average is in the checkpoint: an interrupted-and-resumed run equals one that never stopped;
- under ep=2 (2 processes) it matches the one-process run, and `moetrain eval` in one process reads the
  ep-sharded average back (DCP resharding) and reproduces the final test metrics;
- an export of the run holds the averaged weights.
"""

from __future__ import annotations

import pytest
import torch

from moetrain.config.loader import load_config
from tests.distributed.workers.zero_parity import rel_err
from tests.helpers.dist_launcher import run_ranks
from tests.integration.test_classify import full_params, overrides, records, write_data

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DECAY = 0.6
EMA = [f"--optim.ema_decay={DECAY}"]


def _full(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone() for n, t in sd.items()}


def _train(rank: int, world_size: int, args: list[str], stop_after: int | None = None, audit: bool = False):
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, args))
    if stop_after is not None:
        trainer.cfg.train.steps = stop_after
    seen = [full_params(trainer.model)]
    if audit:  # the weights after every optimizer step
        trainer.optimizer.register_step_post_hook(lambda *_: seen.append(full_params(trainer.model)))
    try:
        trainer.fit()
        out = {"params": full_params(trainer.model), "ema": _full(trainer.ema.state_dict()),
               "ema_updates": trainer.ema.num_updates, "seen": seen}
        if audit:
            want = _recurrence(seen)
            trainer.ema = None  # evaluate plain weights, set by hand
            with torch.no_grad():
                for name, p in trainer.model.named_parameters():
                    p.copy_(want[name].to(p.dtype))
            out["by_hand"] = trainer.evaluate("test")
            with torch.no_grad():
                for name, p in trainer.model.named_parameters():
                    p.copy_(out["params"][name])
            out["raw"] = trainer.evaluate("test")
    finally:
        trainer.close()
    return out if rank == 0 else None


def _recurrence(seen: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    avg = {n: t.double() for n, t in seen[0].items()}
    for t, weights in enumerate(seen[1:]):
        d = min(DECAY, (1 + t) / (10 + t))
        avg = {n: d * avg[n] + (1 - d) * weights[n].double() for n in avg}
    return avg


def _evaluate(rank: int, world_size: int, run_dir):
    from moetrain.train.evaluate import evaluate_run

    return evaluate_run(run_dir, split="test")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ema")
    data = write_data(root / "data")
    ref = run_ranks(_train, 1, overrides(root / "ref", data, extra=EMA), None, True, timeout_s=200)[0]
    ep2 = run_ranks(_train, 2, overrides(root / "ep2", data, ep=2, micro=4, extra=EMA), timeout_s=200)[0]
    return {"root": root, "data": data, "ref": ref, "ep2": ep2}


def test_the_average_is_the_recurrence_over_the_steps_weights(runs):
    ref = runs["ref"]
    assert len(ref["seen"]) == 7 and ref["ema_updates"] == 6
    want = _recurrence(ref["seen"])
    assert sorted(ref["ema"]) == sorted(want)
    for name, w in want.items():
        torch.testing.assert_close(ref["ema"][name].double(), w, rtol=1e-6, atol=1e-7)
    moved = [n for n in want if not torch.equal(ref["ema"][n], ref["params"][n])]
    assert len(moved) == len(want)  # every weight trained, and the average lags it


def test_evaluations_use_the_average(runs):
    final = records(runs["root"] / "ref")[-1]
    by_hand, raw = runs["ref"]["by_hand"], runs["ref"]["raw"]
    assert final["test_confusion"] == by_hand["test_confusion"]
    assert final["test_loss"] == pytest.approx(by_hand["test_loss"], rel=1e-6)
    assert final["test_loss"] != pytest.approx(raw["test_loss"], rel=1e-4)


def test_resumed_run_with_an_average_is_exact(runs):
    root, data = runs["root"], runs["data"]
    args = overrides(root / "resumed", data, extra=EMA)
    run_ranks(_train, 1, args, 3, timeout_s=200)
    second = run_ranks(_train, 1, args, timeout_s=200)[0]
    assert second["ema_updates"] == 6
    got, want = records(root / "resumed"), records(root / "ref")
    assert [r.get("val_loss") for r in got] == [r.get("val_loss") for r in want]  # steps 3 and 6: averages
    assert got[-1]["test_loss"] == want[-1]["test_loss"]
    for name, want in runs["ref"]["ema"].items():
        assert torch.equal(second["ema"][name], want), name


def test_expert_parallel_average_matches_one_process(runs):
    ref, got = runs["ref"]["ema"], runs["ep2"]["ema"]
    assert sorted(got) == sorted(ref) and runs["ep2"]["ema_updates"] == 6
    errors = {name: rel_err(got[name], ref[name]) for name in ref}
    assert max(errors.values()) <= 1e-5, max(errors.items(), key=lambda kv: kv[1])


def test_eval_reads_the_resharded_average_in_one_process(runs):
    run_dir = runs["root"] / "ep2"
    final = records(run_dir)[-1]
    result = run_ranks(_evaluate, 1, run_dir, timeout_s=200)[0]
    assert result["weights"] == "average" and result["world_size"] == 1
    assert result["test_confusion"] == final["test_confusion"]
    assert result["test_loss"] == pytest.approx(final["test_loss"], rel=1e-5)


def test_export_holds_the_averaged_weights(runs):
    from moetrain.interop.export import load_source

    _, state_dict, _ = load_source(runs["root"] / "ep2")
    for name, want in runs["ep2"]["ema"].items():
        assert torch.equal(state_dict[name], want), name
