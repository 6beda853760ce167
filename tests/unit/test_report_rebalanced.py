"""`moetrain report` on a rebalanced run (docs/routing.md#expert-rebalancing): the per-rank load and
straggler factor come from what each rank's slots received (rebalance.jsonl's ``rank_copies``), not
from the experts' home ranks, which the routing trace's figure still shows, labelled as such. Worked
by hand on a written run folder: E = 4 experts over ep = 2, re-planned every 2 steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moetrain.train.report import plot_rank_load
from moetrain.train.routing_trace_read import INDEX, TRACE_DIR, step_file
from moetrain.utils.safetensors_io import ShardedWriter, TensorSpec

E = 4
# Every step routes 6, 2, 2, 2 copies to experts 0-3 (over both ranks): home rank 0 (experts 0-1) gets 8
# of 12, rank 1 gets 4, a factor of 8 / 6 at every step.
COUNTS = ([4, 1, 1, 1], [2, 1, 1, 1])
# What the ranks' slots received: the home layout up to the first plan (after step 2), then a replica
# of expert 0 on rank 1 takes part of its load.
RANK_COPIES = {1: [8, 4], 2: [8, 4], 3: [6, 6], 4: [7, 5]}


def _trace(run_dir: Path, steps: list[int]) -> None:
    folder = run_dir / TRACE_DIR
    folder.mkdir(parents=True)
    for step in steps:
        for rank, counts in enumerate(COUNTS):
            with ShardedWriter(folder, [TensorSpec("counts.L", (E,), torch.int32)], metadata={},
                               weights=step_file(step, rank)) as w:
                w.write("counts.L", torch.tensor(counts, dtype=torch.int32))
                w.close()
    (folder / INDEX).write_text(json.dumps({"format": 1, "mode": "counts", "layers": ["L"], "num_experts": E,
                                            "top_k": 2, "tokens_per_step": 6, "world_size": 2, "ep": 2,
                                            "steps": steps}))


def _rebalance_log(run_dir: Path) -> None:
    with open(run_dir / "rebalance.jsonl", "w") as f:
        for step, copies in RANK_COPIES.items():
            rec = {"step": step, "rank_copies": [copies], "replica_bytes": 0, "after_step_s": 0.0,
                   "rebalanced": step % 2 == 0}
            f.write(json.dumps(rec) + "\n")


def test_rebalanced_run_reports_what_the_ranks_received(tmp_path):
    _trace(tmp_path, [1, 2, 3, 4])
    _rebalance_log(tmp_path)
    (tmp_path / "report").mkdir()
    made = plot_rank_load(tmp_path, tmp_path / "report")
    assert [p.name for p in made] == ["rank_load.png", "rank_load_home.png", "routing_straggler.json"]
    assert all(p.stat().st_size > 0 for p in made)
    got = json.loads(made[-1].read_text())
    assert got["rebalanced"] is True
    # The trace's keys keep their meaning: the load by home rank, which the replicas do not change.
    assert got["steps"] == [1, 2, 3, 4] and got["layers"]["L"]["mean"] == round(8 / 6, 5) > 1.1
    rep = got["replicas"]
    assert rep["first_plan_step"] == 2 and rep["steps"] == [1, 2, 3, 4]
    layer = rep["layers"]["L"]
    assert layer["straggler_factor"] == [round(8 / 6, 5), round(8 / 6, 5), 1.0, round(7 / 6, 5)]
    assert layer["before_first_plan"] == {"mean": round(8 / 6, 5), "max": round(8 / 6, 5)}
    assert layer["after_first_plan"] == {"mean": pytest.approx((1 + 7 / 6) / 2, abs=1e-5), "max": round(7 / 6, 5)}
    assert layer["after_first_plan"]["mean"] < 1.1


def test_rebalance_log_without_a_trace(tmp_path):
    _rebalance_log(tmp_path)
    made = plot_rank_load(tmp_path, tmp_path)
    assert [p.name for p in made] == ["rank_load.png", "routing_straggler.json"]
    got = json.loads(made[-1].read_text())
    assert sorted(got) == ["rebalanced", "replicas"] and list(got["replicas"]["layers"]) == ["layer 0"]


def test_run_without_rebalancing_keeps_the_trace_figure(tmp_path):
    _trace(tmp_path, [1, 2])
    made = plot_rank_load(tmp_path, tmp_path)
    assert [p.name for p in made] == ["rank_load.png", "routing_straggler.json"]
    got = json.loads(made[-1].read_text())
    assert got["rebalanced"] is False and "replicas" not in got
    assert got["layers"]["L"]["straggler_factor"] == [round(8 / 6, 5)] * 2


def test_a_resume_at_another_ep_reports_the_last_layout(tmp_path, caplog):
    """Steps 1-2 ran at ep = 2 and steps 3-4 at ep = 4 (a resume at another layout appends records of
    another width): the replica figure keeps the last layout's steps and says which it left out."""
    widths = {1: [8, 4], 2: [8, 4], 3: [3, 3, 3, 3], 4: [4, 3, 3, 2]}
    with open(tmp_path / "rebalance.jsonl", "w") as f:
        for step, copies in widths.items():
            f.write(json.dumps({"step": step, "rank_copies": [copies], "replica_bytes": 0, "after_step_s": 0.0,
                                "rebalanced": step == 4}) + "\n")
    with caplog.at_level("WARNING", logger="moetrain"):
        made = plot_rank_load(tmp_path, tmp_path)
    rep = json.loads(made[-1].read_text())["replicas"]
    assert rep["steps"] == [3, 4] and rep["layers"]["layer 0"]["straggler_factor"] == [1.0, round(4 / 3, 5)]
    assert "steps 1-2 ran at another ep" in caplog.text
