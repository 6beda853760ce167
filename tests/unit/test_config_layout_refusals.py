"""Settings the chosen parallel layout would ignore or crash on are refused when the config is built:
train.compile with tensor parallelism, and ZeRO bucket sizes of buckets the layout does not have."""

import pytest
import yaml

from moetrain.config import load_config
from moetrain.config.convert import config_to_dict


def test_compile_with_tensor_parallelism_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"parallel\.tp \(2\) must be 1 with train\.compile: true"):
        load_config("tiny", ["parallel.ep=1", "parallel.tp=2", "train.compile=true"])
    # Either alone is fine.
    load_config("tiny", ["parallel.ep=1", "parallel.tp=2"])
    load_config("tiny", ["parallel.ep=1", "train.compile=true"])


REFUSED = [
    (["parallel.zero_stage=2", "zero.reduce_bucket_size=1000"], "zero.reduce_bucket_size", "zero_stage=2"),
    (["parallel.zero_stage=3", "zero.reduce_bucket_size=1000"], "zero.reduce_bucket_size", "zero_stage=3"),
    (["parallel.pp=2", "zero.reduce_bucket_size=1000"], "zero.reduce_bucket_size", "pp=2"),
    (["parallel.ep=1", "parallel.tp=2", "zero.reduce_bucket_size=1000"], "zero.reduce_bucket_size", "tp=2"),
    (["parallel.zero_stage=0", "zero.allgather_bucket_size=1000"], "zero.allgather_bucket_size", "is 0"),
    (["parallel.zero_stage=3", "zero.allgather_bucket_size=1000"], "zero.allgather_bucket_size", "is 3"),
]


@pytest.mark.parametrize("overrides, field, layout", REFUSED, ids=[" ".join(r[0]) for r in REFUSED])
def test_a_bucket_size_the_layout_has_no_bucket_for_is_refused(overrides, field, layout):
    with pytest.raises(ValueError, match=rf"{field} \(1000\) acts only with .*{layout}"):
        load_config("tiny", overrides)


@pytest.mark.parametrize("overrides", [["parallel.zero_stage=0", "zero.reduce_bucket_size=1000"],
                                       ["parallel.zero_stage=1", "zero.reduce_bucket_size=1000",
                                        "zero.allgather_bucket_size=1000"]])
def test_bucket_sizes_where_they_act_are_taken(overrides):
    cfg = load_config("tiny", overrides)
    assert cfg.zero.reduce_bucket_size == 1000


def test_a_saved_config_with_an_ignored_bucket_size_still_loads(tmp_path):
    # Saved before this refusal: the value did nothing then, so it is reset with a warning.
    saved = config_to_dict(load_config("tiny", ["parallel.zero_stage=3"]))
    saved["zero"]["reduce_bucket_size"] = 1000
    path = tmp_path / "config.yaml"
    path.write_text("# Resolved moetrain config: moetrain train --config x\n" + yaml.safe_dump(saved, sort_keys=False))
    with pytest.warns(UserWarning, match=r"zero\.reduce_bucket_size \(1000\) acts only with"):
        cfg = load_config(path, [])
    assert cfg.zero.reduce_bucket_size == 500_000_000 and cfg.parallel.zero_stage == 3
