"""The expert-load heat map's columns: each log step's shares drawn in a column that holds that step
on the x axis (uneven log steps, and a run with one log step), read back from the drawn mesh."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moetrain.train import report


def _drawn(tmp_path, monkeypatch, steps: list[int], shares: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """(x edges, [experts, columns] colours) of layer 0's heat map in expert_load.png."""
    recs = [{"step": s, "loss": 1.0, "expert_share": [share]} for s, share in zip(steps, shares, strict=True)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = {}
    save = report._save

    def grab(fig, path):
        if path.name == "expert_load.png":
            ax = fig.axes[0]
            if ax.images:  # an image: its columns split its x extent evenly
                x0, x1 = ax.images[0].get_extent()[:2]
                got["x"] = np.linspace(x0, x1, len(steps) + 1)
                got["c"] = np.asarray(ax.images[0].get_array())
            else:
                mesh = ax.collections[0]
                got["x"] = mesh.get_coordinates()[0, :, 0]
                got["c"] = np.asarray(mesh.get_array()).reshape(len(shares[0]), len(steps))
        return save(fig, path)

    monkeypatch.setattr(report, "_save", grab)
    report.write_report(tmp_path)
    return got["x"], got["c"]


@pytest.mark.parametrize("steps", [[10, 20, 30, 40], [5, 10, 30], [7]])
def test_each_log_step_is_drawn_in_a_column_over_that_step(tmp_path, monkeypatch, steps):
    rng = np.random.default_rng(len(steps))
    shares = [list(rng.dirichlet(np.ones(4))) for _ in steps]
    edges, colours = _drawn(tmp_path, monkeypatch, steps, shares)
    assert len(edges) == len(steps) + 1 and np.all(np.diff(edges) > 0)
    for step, share in zip(steps, shares, strict=True):
        column = int(np.searchsorted(edges, step)) - 1  # the column whose x range holds the step
        assert edges[column] < step < edges[column + 1]
        np.testing.assert_allclose(colours[:, column], share)
    if len(steps) == 1:
        assert edges.tolist() == [steps[0] - 0.5, steps[0] + 0.5]
