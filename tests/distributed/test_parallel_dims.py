"""ParallelDims: the checks (every violated rule named with its value), the rank order, and bad
layouts failing fast with the same clear error on every rank of a real process group."""

import re

import pytest
import torch

from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.distributed import ParallelDims, parallelize
from moetrain.models.moe import MoELayer
from tests.distributed.dist_launcher import run_ranks

EP3_E8 = "parallel.ep (3) must divide moe.num_experts (8)"
EP4_W2 = "parallel.ep (4) must divide the world size (2)"


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 6, "ep": 3, "num_experts": 8}, EP3_E8),
    ({"world_size": 2, "ep": 4, "num_experts": 8}, EP4_W2),
    ({"world_size": 2, "ep": 3, "num_experts": 8}, "parallel.ep (3) must divide the world size (2); " + EP3_E8),
    ({"world_size": 4, "ep": 2, "dp": 3}, "parallel.dp (3) * parallel.tp (1) * parallel.pp (1) must equal the world size (4)"),
    ({"world_size": 4, "ep": 0}, "parallel.ep (0) must be an integer >= 1"),
    ({"world_size": 4, "tp": 2}, "parallel.tp (2) must be 1"),
])
def test_bad_layouts_name_fields_and_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelDims(**kwargs)


def test_degrees_and_from_config():
    dims = ParallelDims.from_config(ParallelConfig(ep=2), world_size=8, num_experts=8)
    assert (dims.dp, dims.ep, dims.edp) == (8, 2, 4)
    assert ParallelDims(world_size=4, ep=4, num_experts=8).edp == 1


def test_check_experts_is_the_constructor_rule_for_a_model_built_later():
    dims = ParallelDims(world_size=6, ep=3)  # no num_experts given: the constructor cannot check it
    dims.check_experts(9, layer="layers.0.ffn")
    with pytest.raises(ValueError, match=re.escape(EP3_E8 + " of layer 'layers.0.ffn'")):
        dims.check_experts(8, layer="layers.0.ffn")
    with pytest.raises(ValueError, match=re.escape(EP3_E8) + "$"):
        dims.check_experts(8)


def test_rank_order_puts_ep_groups_on_consecutive_ranks():
    dims = ParallelDims(world_size=8, ep=4)
    # Ranks 0-3 are one node of a 2 x 4 launch: its all-to-alls never leave the node.
    assert dims.ep_group_ranks() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.edp_group_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def _bad_layout_worker(rank, world_size):
    """Each bad layout must raise ValueError locally, before any collective could hang."""
    messages = {}
    for name, kwargs in {"ep3_e8": {"ep": 3, "num_experts": 8}, "ep4_w2": {"ep": 4, "num_experts": 8}}.items():
        try:
            ParallelDims(world_size=world_size, **kwargs)
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    # A model whose experts do not split over ep, although ParallelDims was not told num_experts.
    dims = ParallelDims(world_size=world_size, ep=2)
    dims.build_mesh()
    try:
        parallelize(MoELayer(8, MoEConfig(num_experts=3, top_k=1, expert_hidden_dim=8)), dims)
        messages["model_e3"] = None
    except ValueError as e:
        messages["model_e3"] = str(e)
    # Capacity drops over the global batch need equal token counts; found in the one host sync.
    dp_dims = ParallelDims(world_size=world_size, ep=1)
    dp_dims.build_mesh()
    layer = parallelize(MoELayer(8, MoEConfig(num_experts=4, top_k=1, expert_hidden_dim=8, capacity_factor=1.0)),
                        dp_dims)
    try:
        layer(torch.randn(4 + 4 * rank, 8))
        messages["unequal_tokens"] = None
    except ValueError as e:
        messages["unequal_tokens"] = str(e)
    return messages


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_bad_layouts_fail_fast_on_every_rank():
    results = run_ranks(_bad_layout_worker, 2, timeout_s=45)
    for rank, messages in enumerate(results):
        assert messages["ep3_e8"] == "parallel.ep (3) must divide the world size (2); " + EP3_E8, rank
        assert messages["ep4_w2"] == EP4_W2, rank
        assert messages["model_e3"] == "parallel.ep (2) must divide moe.num_experts (3) of layer ''", rank
        assert messages["unequal_tokens"] is not None and "same token count on every rank" in messages["unequal_tokens"]
