"""The optimizer's per-group hyperparameters are compared parameter by parameter (verify/groups.py)."""

from __future__ import annotations

import json

import torch

from moetrain.config.loader import load_config
from moetrain.train.checkpoint.index import text_tensor
from moetrain.verify.checks import Comparison, Precision
from moetrain.verify.driver import Plan, compare_state


def _groups(decay: list[str], no_decay: list[str]) -> dict[str, torch.Tensor]:
    """A checkpoint's ``optim.param_groups`` entry as the trainer saves it (JSON text in a uint8 tensor)."""
    common = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "fused": True}
    groups = [{"name": "decay", "weight_decay": 0.1, **common, "params": decay},
              {"name": "no_decay", "weight_decay": 0.0, **common, "params": no_decay}]
    return {"optim.param_groups": text_tensor(json.dumps(groups))}


def _compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> Comparison:
    out = Comparison()
    compare_state(out, "[ep=2]", got, want, Plan(load_config("tiny"), [], [], 1), Precision("fp32"), step=1)
    return out


def test_a_parameter_moved_to_another_param_group_fails_naming_it():
    want = _groups(["wq", "experts.w1"], ["norm"])
    same = _compare(_groups(["wq", "experts.w1"], ["norm"]), want)
    assert [r.ok for r in same.results] == [True] and same.results[0].quantity == "[ep=2] optimizer hyperparameters"
    moved = _compare(_groups(["wq"], ["norm", "experts.w1"]), want)
    r = moved.first_failure
    assert r is not None and r.quantity == "[ep=2] optimizer hyperparameters"
    assert "experts.w1: weight_decay 0.0 at the layout against 0.1" in r.note


def test_a_pipeline_stage_listing_only_its_own_parameters_is_not_a_difference():
    assert _compare(_groups(["wq"], []), _groups(["wq", "experts.w1"], ["norm"])).first_failure is None


def test_a_changed_beta_fails():
    want = _groups(["wq"], ["norm"])
    blob = json.loads(bytes(want["optim.param_groups"].tolist()).decode())
    blob[1]["betas"] = [0.9, 0.999]
    r = _compare({"optim.param_groups": text_tensor(json.dumps(blob))}, want).first_failure
    assert r is not None and "norm: betas" in r.note
