"""1-bit Adam's settings: dp.onebit_warmup_steps is validated and resolves against train.steps;
ZeRO stages other than 0 are refused naming the fields."""

from __future__ import annotations

import pytest

from moetrain.config.dp import DataParallelConfig
from moetrain.distributed import ParallelDims
from moetrain.distributed.data_parallel.ddp import apply_data_parallel


def test_warmup_steps_default_and_explicit():
    assert DataParallelConfig().onebit_warmup_steps is None
    assert DataParallelConfig().onebit_warmup(300) == 60  # 20% of the run
    assert DataParallelConfig().onebit_warmup(100) == 20
    assert DataParallelConfig().onebit_warmup(2) == 1  # never zero
    assert DataParallelConfig(grad_compression="onebit", onebit_warmup_steps=7).onebit_warmup(300) == 7


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"])
def test_warmup_steps_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"dp.onebit_warmup_steps \(.*\) must be None or an int >= 1"):
        DataParallelConfig(grad_compression="onebit", onebit_warmup_steps=bad)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_onebit_needs_zero_stage_0(stage):
    dims = ParallelDims(world_size=2)
    with pytest.raises(ValueError, match=rf"dp.grad_compression \('onebit'\) needs parallel.zero_stage "
                                         rf"(= 0|<= 1) \(is {stage}\)"):
        apply_data_parallel(None, dims, zero_stage=stage, grad_compression="onebit")
