"""benchmarks/moe_vs_dense.py --sizes: the dense size an MoE's loss matches, worked by hand, and the
model shapes behind the "1x / 2x / 4x" labels counted by the package's own parameter counter."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from moetrain.config.loader import load_config
from moetrain.models.transformer import count_params

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_vs_dense.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("moe_vs_dense", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # @dataclass looks its module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


# Loss falls by 0.2 per doubling: the matched size is 2 ** (drop / 0.2) million.
DENSE = [(4e6, 3.6), (1e6, 4.0), (2e6, 3.8)]  # unsorted on purpose


@pytest.mark.parametrize(("loss", "params", "outside"), [
    (3.9, 2 ** 0.5 * 1e6, False),   # halfway (in log) between 1M and 2M
    (3.7, 2 ** 1.5 * 1e6, False),   # in the second segment
    (3.8, 2e6, False),              # on a dense point
    (3.5, 2 ** 2.5 * 1e6, True),    # below the 4x loss: the last segment extended
    (4.1, 2 ** -0.5 * 1e6, True),   # worse than the smallest dense model: the first one extended
])
def test_matched_dense_params_interpolates_in_log_params(bench, loss, params, outside):
    got, got_outside = bench.matched_dense_params(loss, DENSE)
    assert math.isclose(got, params, rel_tol=1e-9) and got_outside is outside


def test_equal_dense_losses_have_no_slope(bench):
    with pytest.raises(ValueError, match="no slope"):
        bench.matched_dense_params(3.0, [(1e6, 3.5), (2e6, 3.5)])


def test_the_sizes_have_the_active_parameter_ratios_they_are_labelled_with(bench):
    def non_embedding_active(size):
        _, config, *overrides = size.overrides()  # "--config", its name, the field overrides
        cfg = load_config(config, [*overrides, f"--data.vocab_size={bench.VOCAB}"])
        pc = count_params(cfg.model, cfg.moe, vocab_size=bench.VOCAB)
        assert bench._size_params(size) == pc  # what the table prints
        return pc.active - pc.embedding

    active = {size.name: non_embedding_active(size) for size in bench.SIZES}
    base = active["dense 1x"]
    assert 1.8 < active["dense 2x"] / base < 2.2 and 3.9 < active["dense 4x"] / base < 4.1
    # The MoE adds only its router (dim x experts per block) to the dense 1x model's active parameters.
    assert active["MoE 8 experts"] - base == 4 * 64 * 8
    assert active["MoE 32 experts"] - base == 4 * 64 * 32
