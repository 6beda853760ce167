"""Routing traces across expert-parallel groups and resumes: the straggler factor of each ep group
(world > ep), a resume at another world size keeping the steps up to its resume point (each step read
with the layout that wrote it, for loads and replay), and steps whose rank files are incomplete left
out of the report with a warning. References are plain loops over the rank files' counts."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from moetrain.config.moe import MoEConfig
from moetrain.models.moe.layer import MoELayer
from moetrain.train.report import plot_rank_load
from moetrain.train.routing_trace import Geometry, RoutingRecorder, check_trace
from moetrain.train.routing_trace_read import (
    INDEX,
    TRACE_DIR,
    expert_loads,
    load_step_ids,
    rank_loads,
    read_index,
    step_file,
    straggler_factors,
)
from moetrain.utils.safetensors_io import ShardedWriter, TensorSpec

E, K, D = 8, 2, 16


def _write_counts(folder, step: int, rank: int, counts_E: list[int]) -> None:
    t = torch.tensor(counts_E, dtype=torch.int32)
    with ShardedWriter(folder, [TensorSpec("counts.L", (E,), torch.int32)], metadata={},
                       weights=step_file(step, rank), durable=False) as w:
        w.write("counts.L", t)
        w.close()


def _index(folder, steps, **layout) -> None:
    index = {"format": 1, "mode": "counts", "layers": ["L"], "num_experts": E, "top_k": K, "tokens_per_step": 64,
             "steps": steps, **layout}
    (folder / INDEX).write_text(json.dumps(index))


def _factor_by_hand(per_rank: list[list[int]], groups: list[list[int]], ep: int) -> float:
    """The worst group's max / mean of the copies its ep ranks receive (expert e on ep rank e // (E/ep))."""
    worst = 0.0
    for ranks in groups:
        received = [0] * ep
        for r in ranks:
            for e, c in enumerate(per_rank[r]):
                received[e // (E // ep)] += c
        worst = max(worst, max(received) / (sum(received) / ep))
    return worst


def test_straggler_factor_is_taken_within_each_ep_group(tmp_path):
    folder = tmp_path / TRACE_DIR
    folder.mkdir()
    # world 4, ep 2: groups [0, 1] and [2, 3]. Group A routes to experts 0-3 (ep rank 0) unevenly,
    # group B to experts 4-7 (ep rank 1): summed over the groups the ranks look balanced.
    per_rank = [[30, 10, 0, 0, 0, 0, 0, 10], [20, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 40, 20, 0, 0],
                [0, 0, 5, 0, 0, 0, 0, 5]]
    for rank, counts in enumerate(per_rank):
        _write_counts(folder, 2, rank, counts)
    _index(folder, [2], world_size=4, ep=2, etp=1,
           layouts=[{"from_step": 1, "world_size": 4, "ep": 2, "etp": 1}])
    steps, layers, load_SLGP = rank_loads(tmp_path)
    assert steps == [2] and load_SLGP.tolist() == [[[[60.0, 10.0], [5.0, 65.0]]]]
    expected = _factor_by_hand(per_rank, [[0, 1], [2, 3]], ep=2)
    assert straggler_factors(load_SLGP).tolist() == [[pytest.approx(expected)]]
    assert straggler_factors(load_SLGP, per_group=True).tolist() == [[[pytest.approx(60 / 35), pytest.approx(65 / 35)]]]
    # etp 2: the block [0, 1, 2, 3] gathers its tokens, so its two ep ranks share all of them.
    _index(folder, [2], world_size=4, ep=2, etp=2, layouts=[{"from_step": 1, "world_size": 4, "ep": 2, "etp": 2}])
    assert straggler_factors(rank_loads(tmp_path)[2]).tolist() == [
        [pytest.approx(_factor_by_hand(per_rank, [[0, 1, 2, 3]], ep=2))]]
    made = plot_rank_load(tmp_path, tmp_path)
    assert json.loads(made[1].read_text())["layers"]["L"]["max"] == round(75 / 70, 5)
    # An index written before layouts were recorded: world_size == ep, one group, as it always read.
    for rank in range(2):
        _write_counts(folder, 2, rank, per_rank[rank])
    _index(folder, [2], world_size=2, ep=2)
    assert straggler_factors(rank_loads(tmp_path)[2]).tolist() == [
        [pytest.approx(_factor_by_hand(per_rank, [[0, 1]], ep=2))]]


def test_report_leaves_out_a_step_whose_rank_file_is_missing(tmp_path):
    folder = tmp_path / TRACE_DIR
    folder.mkdir()
    counts = {(2, 0): [4, 0, 0, 0, 0, 0, 0, 0], (2, 1): [0, 0, 0, 0, 4, 0, 0, 4], (4, 0): [1] * E}
    for (step, rank), c in counts.items():
        _write_counts(folder, step, rank, c)
    (folder / step_file(6, 0)).write_bytes(b"cut")  # a rank's file cut short: unreadable
    _write_counts(folder, 6, 1, [1] * E)
    _index(folder, [2, 4, 6], world_size=2, ep=2)
    with pytest.warns(UserWarning, match=r"steps \[4, 6\] left out") as caught:
        made = plot_rank_load(tmp_path, tmp_path)
    assert len(caught) == 1
    summary = json.loads(made[1].read_text())
    assert summary["steps"] == [2] and summary["layers"]["L"]["straggler_factor"] == [round(8 / 6, 5)]
    assert (tmp_path / "rank_load.png").stat().st_size > 0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(MoELayer(D, MoEConfig(num_experts=E, top_k=K, expert_hidden_dim=16)) for _ in range(2)))


def _record(model, run_dir, *, world: int, start: int, steps: range, x_by_step: dict) -> None:
    """Each rank of ``world`` records its sequences of the 2-sequence (seq_len 4) global batch."""
    recorders = [RoutingRecorder(model, mode="full", every=1, run_dir=run_dir, num_micro=1, rank=r,
                                 world_size=world, ep=world, is_main=r == 0, start_step=start,
                                 geometry=Geometry(num_experts=E, top_k=K, tokens_per_step=8, seq_len=4,
                                                   micro_batch=2, local_batch=2 // world, dp_rank=r))
                 for r in range(world)]
    model.train()
    for step in steps:
        for r, rec in enumerate(recorders):
            rec.start_step(step)
            x = x_by_step[step][r * 8 // world:(r + 1) * 8 // world]
            [layer(x) for layer in model]  # each layer routes the same tokens: enough for the trace
            rec.finish_step()
    for rec in recorders:
        rec.remove()


def test_a_resume_at_another_world_size_keeps_the_steps_up_to_its_resume_point(tmp_path):
    model = _model()
    x_by_step = {s: torch.randn(8, D) for s in range(1, 7)}
    _record(model, tmp_path, world=1, start=0, steps=range(1, 7), x_by_step=x_by_step)
    # The run stopped after step 6; its last checkpoint was step 4: resumed there on 2 processes.
    _record(model, tmp_path, world=2, start=4, steps=range(5, 7), x_by_step=x_by_step)
    folder, index = read_index(tmp_path)
    assert index["steps"] == [1, 2, 3, 4, 5, 6]
    assert [(lay["from_step"], lay["world_size"]) for lay in index["layouts"]] == [(1, 1), (5, 2)]
    # Reference: every layer's ids over the whole global batch, routed in one piece.
    names = index["layers"]
    for step, x in x_by_step.items():
        ids = load_step_ids(folder, index, step, names, num_tokens=8, num_experts=E)
        for name, layer in zip(names, model, strict=True):
            assert torch.equal(ids[name], layer.router(x).idx_TK), (step, name)
    check_trace(folder, index, layer_names=names, steps=range(1, 7),
                geometry=Geometry(num_experts=E, top_k=K, tokens_per_step=8, seq_len=4, micro_batch=2,
                                  local_batch=2, dp_rank=0))
    steps, _, load_SLE, _ = expert_loads(tmp_path)
    assert steps == [1, 2, 3, 4, 5, 6] and load_SLE.sum((1, 2)).tolist() == [2 * 8 * K] * 6
    # A second resume from step 2 on one process drops steps 3-6 and the world-2 layout.
    _record(model, tmp_path, world=1, start=2, steps=range(3, 4), x_by_step=x_by_step)
    _, index = read_index(tmp_path)
    assert index["steps"] == [1, 2, 3] and [lay["from_step"] for lay in index["layouts"]] == [1, 3]
