"""Routing traces and replay end to end (docs/routing.md#routing-traces).

A run recorded with ``log.routing_trace=full`` and replayed by the same layout is bit-identical
(losses, aux losses, grad norms at every step) at world 1 and at ep=2; the ep=2 trace replayed by
one process gives the ep=2 run's losses within fp32 reduction-order noise and routes every token
as recorded; replayed at tp=2 x ep=2 (each rank routes its sequence shard) it gives that one
process's losses and parameters, and its own full trace is the replayed one; a run with other
weights replaying a trace routes exactly the recorded ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moetrain.train.checkpoint.files import step_dir_name
from moetrain.train.routing_trace_read import (
    INDEX,
    TRACE_DIR,
    load_step_ids,
    read_index,
    read_tensor,
    step_file,
)
from moetrain.utils.safetensors_io import read_header
from moetrain.verify.runs import read_checkpoint
from tests.distributed.workers.zero_parity import rel_err
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides, train_job

pytestmark = pytest.mark.timeout(240)
STEPS = 3
KEYS = ("loss", "aux_loss", "grad_norm")


def _ov(run_dir: Path, *, ep: int = 1, extra: tuple[str, ...] = ()) -> list[str]:
    return job_overrides(run_dir, steps=STEPS, ep=ep, extra=("--train.deterministic=true", "--log.memory=false",
                                                             "--moe.aux_loss_coef=0.01", *extra))




def _train_all(runs: list[list[str]], world_size: int = 1) -> None:
    for overrides in runs:  # one process group per run
        run_ranks(train_job, world_size, overrides, timeout_s=120)


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def _ids(run_dir: Path) -> list[dict[str, torch.Tensor]]:
    folder, index = read_index(run_dir)
    return [load_step_ids(folder, index, s, index["layers"], num_tokens=index["tokens_per_step"],
                          num_experts=index["num_experts"]) for s in range(1, STEPS + 1)]


def _same_ids(a: Path, b: Path) -> bool:
    return all(torch.equal(x[n], y[n]) for x, y in zip(_ids(a), _ids(b), strict=True) for n in x)


def test_trace_and_replay(tmp_path, shakespeare_cached):
    full = ("--log.routing_trace=full",)
    a, b, f = tmp_path / "w1", tmp_path / "w1_replay", tmp_path / "w1_other_seed_replay"
    c, d, e = tmp_path / "ep2", tmp_path / "ep2_replay", tmp_path / "w1_replays_ep2"
    g = tmp_path / "tp2_ep2_replays_ep2"
    # One micro-batch of the whole global batch: the balance loss over the same tokens as ep=2's.
    whole = ("--train.micro_batch_size=8", f"--moe.routing_replay={c}")
    _train_all([_ov(c, ep=2, extra=full), _ov(d, ep=2, extra=(f"--moe.routing_replay={c}",))], world_size=2)
    # tp=2 folded with ep=2 on 2 ranks: each rank routes positions 32-63 or 0-31 of all 8 sequences.
    _train_all([_ov(g, ep=2, extra=(*full, *whole, "--parallel.tp=2"))], world_size=2)
    _train_all([_ov(a, extra=full), _ov(b, extra=(f"--moe.routing_replay={a}",)), _ov(e, extra=(*full, *whole)),
                _ov(f, extra=(*full, "--train.seed=7", f"--moe.routing_replay={a}"))])
    # Replaying its own trace at the same layout: bit for bit.
    for orig, replay in ((a, b), (c, d)):
        assert [[r[k] for k in KEYS] for r in _records(orig)] == [[r[k] for k in KEYS] for r in _records(replay)]
    # Another layout: every token routed as recorded, the losses those of the recorded run.
    assert _same_ids(c, e)
    for rc, re_ in zip(_records(c), _records(e), strict=True):
        assert re_["loss"] == pytest.approx(rc["loss"], rel=1e-5)
    _check_tp_replay(e, g, c)
    # Other weights: the router would choose otherwise (other losses), the replay imposes the ids.
    assert _same_ids(a, f)
    assert [r["loss"] for r in _records(a)] != [r["loss"] for r in _records(f)]
    # The trace's own account of itself: ep=2 wrote one file per rank per step, each with its blocks.
    index = json.loads((c / TRACE_DIR / INDEX).read_text())
    assert index["steps"] == [1, 2, 3] and index["world_size"] == 2 and index["ep"] == 2
    assert read_header(c / TRACE_DIR / step_file(1, 1))[0]["blocks"].shape == (1, 2)  # one micro-batch per rank
    assert read_header(a / TRACE_DIR / step_file(1, 0))[0]["blocks"].shape == (2, 2)  # two in one process
    # The default trace of the replaying run: counts on every log step (log.every=1 here), equal to the
    # expert_share logged for that step's window.
    folder, index = read_index(b)
    assert index["mode"] == "counts" and index["steps"] == [1, 2, 3]
    for record in _records(b):
        path = folder / step_file(record["step"], 0)
        tensors, _ = read_header(path)
        for i, name in enumerate(index["layers"]):
            counts = read_tensor(tensors[f"counts.{name}"], path).double()
            assert counts.sum() == 8 * 64 * 2  # global batch x seq_len x top_k
            assert [round(v, 5) for v in (counts / counts.sum()).tolist()] == record["expert_share"][i]
    _check_bad_traces(a, tmp_path)


def _check_tp_replay(one: Path, tp: Path, trace: Path) -> None:
    """The same replay at tp=2 x ep=2 and in one process: every token routed as recorded (the tp run's
    own full trace, one block per sequence shard, reassembles to the replayed ids), the loss and aux
    loss of every step, and every parameter after the last step (norm-wise, zero_parity's rule:
    AdamW's first steps turn the rounding of a gradient entry near zero into an update of order lr)."""
    assert _same_ids(trace, tp)
    assert read_header(tp / TRACE_DIR / step_file(1, 1))[0]["blocks"].shape == (8, 2)  # 8 sequences' shards
    for r1, rt in zip(_records(one), _records(tp), strict=True):
        assert rt["loss"] == pytest.approx(r1["loss"], rel=1e-5) and rt["aux_loss"] == pytest.approx(r1["aux_loss"],
                                                                                                   rel=1e-5)
    want, got = (read_checkpoint(run / "checkpoints" / step_dir_name(STEPS)) for run in (one, tp))
    params = [k for k in want if k.startswith("model.")]
    assert params and set(params) <= set(got)
    for k in params:
        assert rel_err(got[k].double(), want[k].double()) <= 1e-5, k


def _check_bad_traces(a: Path, tmp_path: Path) -> None:
    """A trace of another model, or a corrupt shard: one ValueError naming the file, before any step."""
    from moetrain.config.loader import load_config
    from moetrain.train.trainer import Trainer

    def fails(extra, match):
        with pytest.raises(ValueError, match=match):
            Trainer(load_config(None, _ov(tmp_path / "bad", extra=(f"--moe.routing_replay={a}", *extra))))

    fails(("--moe.top_k=1",), r"index.json.*top_k 2 != this run's 1")
    fails(("--moe.num_experts=8",), r"num_experts 4 != this run's 8")
    fails(("--train.global_batch_size=4",), r"tokens_per_step 512 != this run's 256")
    fails(("--model.num_layers=3",), r"MoE layers")
    fails(("--train.steps=5",), r"steps \[4, 5\] not recorded")
    shard = a / TRACE_DIR / step_file(2, 0)
    shard.write_bytes(shard.read_bytes()[:40])
    fails((), rf"{shard.name}.*corrupt")
