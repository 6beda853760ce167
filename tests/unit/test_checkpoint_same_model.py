"""The rule of a resume: the fields that define the model keep their saved values (hand-built
config dicts; the end-to-end refusal is tests/integration/test_resume_same_model.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetrain.config import JobConfig
from moetrain.config.loader import config_to_dict
from moetrain.train.checkpoint.files import CheckpointError
from moetrain.train.checkpoint.same_model import MAY_CHANGE, check_same_model, model_changes


def _saved(**sections) -> dict:
    config = {"model": {"dim": 64, "activation": "gelu", "dense_layers": [0], "dropout": 0.0},
              "moe": {"num_experts": 4, "top_k": 2, "router": "softmax", "aux_loss_coef": 0.01,
                      "capacity_factor": None}}
    for section, fields in sections.items():
        config[section] = {**config[section], **fields}
    return config


def test_every_changed_model_defining_field_is_named_with_both_values():
    new = _saved(moe={"top_k": 1, "router": "sigmoid"}, model={"activation": "swiglu"})
    assert model_changes(_saved(), new) == ["model.activation (saved 'gelu', now 'swiglu')",
                                            "moe.router (saved 'softmax', now 'sigmoid')",
                                            "moe.top_k (saved 2, now 1)"]


def test_training_settings_may_change_and_tuples_equal_their_saved_lists():
    new = _saved(moe={"aux_loss_coef": 0.05, "capacity_factor": 1.25}, model={"dropout": 0.1, "dense_layers": (0,)})
    assert model_changes(_saved(), new) == []


def test_a_field_the_old_checkpoint_lacks_is_not_compared_and_a_dense_model_ignores_moe():
    saved = _saved()
    del saved["moe"]["router"]
    assert model_changes(saved, _saved(moe={"router": "sigmoid"})) == []
    assert model_changes(_saved(), _saved(moe={"top_k": 1}), moe=False) == []


def test_the_refusal_names_the_checkpoint_the_field_and_the_way_out():
    with pytest.raises(CheckpointError) as e:
        check_same_model(Path("runs/tiny/checkpoints/step_000000002"), _saved(), _saved(moe={"num_experts": 8}))
    message = str(e.value)
    assert "'runs/tiny/checkpoints/step_000000002' does not match this job's model: moe.num_experts " \
           "(saved 4, now 8)" in message
    assert "--log.run_dir" in message and "--checkpoint.init_from" in message and "capacity factor" in message
    assert isinstance(e.value, ValueError)
    check_same_model(Path("x"), None, _saved(moe={"num_experts": 8}))  # no saved config: nothing to compare


def test_the_changeable_fields_exist_and_the_architecture_fields_are_not_among_them():
    defaults = config_to_dict(JobConfig())
    for section, names in MAY_CHANGE.items():
        assert names <= set(defaults[section]), names - set(defaults[section])
    frozen = {"num_experts", "top_k", "expert_hidden_dim", "activation", "router", "renormalize",
              "routed_scaling_factor", "num_shared_experts", "shared_hidden_dim", "shared_expert_gate",
              "expert_bias", "num_expert_groups", "group_score", "top_groups"}
    assert frozen <= set(defaults["moe"]) and not frozen & MAY_CHANGE["moe"]
