"""ParallelDims: the checks (every violated rule named with its value), the rank order, and bad
layouts failing fast with the same clear error on every rank of a real process group."""

import re

import pytest
import torch

from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.distributed import ParallelDims, parallelize
from moetrain.models.moe import MoELayer
from tests.helpers.dist_launcher import run_ranks

EP3_E8 = "parallel.ep (3) must divide moe.num_experts (8)"
EP4_W2 = "parallel.ep (4) must divide the world size (2)"


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 6, "ep": 3, "num_experts": 8}, EP3_E8),
    ({"world_size": 2, "ep": 4, "num_experts": 8}, EP4_W2),
    ({"world_size": 2, "ep": 3, "num_experts": 8}, "parallel.ep (3) must divide the world size (2); " + EP3_E8),
    ({"world_size": 4, "ep": 2, "dp": 3},
     "parallel.dp (3) * parallel.tp (1) * parallel.pp (1) must equal the world size (4)"),
    ({"world_size": 4, "ep": 0}, "parallel.ep (0) must be an integer >= 1"),
    ({"world_size": 8, "tp": 2, "pp": 2, "ep": 8, "num_experts": 8},
     ("parallel.ep (8) must divide parallel.dp * parallel.tp (4): expert parallelism folds over the ranks of one "
      "pipeline stage")),
    ({"world_size": 4, "tp": 3, "pp": 2}, "parallel.tp (3) * parallel.pp (2) must divide the world size (4)"),
    ({"world_size": 4, "tp": 0}, "parallel.tp (0) must be an integer >= 1"),
    ({"world_size": 4, "ep": 4, "etp": 2, "num_experts": 8},
     "parallel.ep (4) * parallel.etp (2) must divide parallel.dp * parallel.tp (4)"),
    ({"world_size": 4, "tp": 2, "ep": 2, "ep_hierarchical": True},
     "parallel.ep_hierarchical needs parallel.tp, pp and etp = 1 (are 2, 1, 1)"),
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


def test_folded_rank_order_of_the_docstring_example():
    """pp=2, tp=2, ep=2 on 8 ranks: rank = (pp_index * dp + dp_index) * tp + tp_index, and the MoE
    part re-factors each stage's dp x tp ranks as edp x ep with ep consecutive."""
    dims = ParallelDims(world_size=8, pp=2, tp=2, ep=2, num_experts=4)
    assert (dims.dp, dims.dp_tp, dims.edp) == (2, 4, 2)
    assert dims.rank_of(pp=1, dp=1, tp=0) == 6
    assert dims.pp_group_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.tp_group_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.dp_group_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.dp_tp_group_ranks() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.ep_group_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.edp_group_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # ep borrows the whole stage: 4 ranks of dp 2 x tp 2.
    wide = ParallelDims(world_size=4, tp=2, ep=4, num_experts=8)
    assert (wide.dp, wide.edp, wide.ep_group_ranks(), wide.edp_group_ranks()) == (2, 1, [[0, 1, 2, 3]],
                                                                                 [[0], [1], [2], [3]])


def test_config_accepts_tp_pp_and_etp():
    dims = ParallelDims.from_config(ParallelConfig(tp=2, ep=2), world_size=8, num_experts=8)
    assert (dims.tp, dims.pp, dims.dp, dims.edp) == (2, 1, 4, 4)
    dims = ParallelDims.from_config(ParallelConfig(pp=2, ep=2), world_size=8, num_experts=8)
    assert (dims.tp, dims.pp, dims.dp, dims.edp) == (1, 2, 4, 2)
    dims = ParallelDims.from_config(ParallelConfig(tp=2, pp=2, ep=2), world_size=8, num_experts=8)
    assert (dims.tp, dims.pp, dims.dp, dims.edp) == (2, 2, 2, 2)
    dims = ParallelDims.from_config(ParallelConfig(tp=2, ep=2, etp=2), world_size=8, num_experts=8)
    assert (dims.dp, dims.edp) == (4, 2)
    assert dims.etp_group_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.ep_group_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.edp_group_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match=re.escape("parallel.ep (2) * parallel.etp (4) must divide parallel.dp * "
                                                   "parallel.tp (4)")):
        ParallelDims(world_size=4, ep=2, etp=4)
    with pytest.raises(ValueError, match=re.escape("parallel.etp (2) must be 1 with parallel.zero_stage 2")):
        ParallelConfig(etp=2, zero_stage=2)
    with pytest.raises(ValueError, match=re.escape("parallel.tp (1.5) must be an int >= 1")):
        ParallelConfig(tp=1.5)


AXES = ("pp", "dp", "tp", "dp_tp", "edp", "ep", "etp")


def _mesh_worker(rank, world_size, kwargs):
    dims = ParallelDims(world_size=world_size, **kwargs)
    dims.build_mesh("cpu")
    import torch.distributed as dist

    def ranks(group):
        return dist.get_process_group_ranks(group)

    out: dict = {axis: ranks(dims.group(axis)) for axis in AXES}
    out["degrees"] = [dims.degree(axis) for axis in AXES]
    try:
        dims.group("expert")
    except ValueError as e:
        out["unknown"] = str(e)
    out["coords"] = (dims.pp_rank, dims.dp_rank, dims.tp_rank, dims.edp_rank, dims.ep_rank, dims.etp_rank)
    out["same_root"] = dims.axis_mesh("tp")._get_root_mesh() is dims.expert_mesh._get_root_mesh()
    return out


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs", [{"pp": 2, "tp": 2, "ep": 2}, {"tp": 2, "ep": 2, "etp": 2}],
                         ids=["pp2_tp2_ep2", "tp2_ep2_etp2"])
def test_meshes_give_the_groups_of_the_rank_arithmetic(kwargs):
    dims = ParallelDims(world_size=8, num_experts=4, **kwargs)
    results = run_ranks(_mesh_worker, 8, {**kwargs, "num_experts": 4}, timeout_s=55)
    for rank, got in enumerate(results):
        def mine(groups, rank=rank):
            return next(g for g in groups if rank in g)
        assert got["tp"] == mine(dims.tp_group_ranks()) and got["dp"] == mine(dims.dp_group_ranks())
        assert got["pp"] == mine(dims.pp_group_ranks()) and got["dp_tp"] == mine(dims.dp_tp_group_ranks())
        assert got["ep"] == mine(dims.ep_group_ranks()) and got["edp"] == mine(dims.edp_group_ranks())
        assert got["etp"] == mine(dims.etp_group_ranks())
        assert got["degrees"] == [len(got[axis]) for axis in AXES]
        assert got["unknown"].startswith("no mesh axis named 'expert': one of pp, dp, tp, dp_tp")
        if dims.etp == 1:
            pp, rest = divmod(rank, 4)
            assert got["coords"] == (pp, rest // 2, rest % 2, rest // 2, rest % 2, 0)
        else:  # 8 ranks = dp 4 x tp 2 = edp 2 x ep 2 x etp 2, etp innermost
            assert got["coords"] == (0, rank // 2, rank % 2, rank // 4, rank // 2 % 2, rank % 2)
        assert got["same_root"]  # FSDP and DTensor compose the dense and expert meshes


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


# ----- nodes -----------------------------------------------------------------------------------------


def test_node_layout_and_which_ep_ranks_share_a_node():
    dims = ParallelDims(world_size=8, ep=4, num_experts=8, ranks_per_node=2)
    assert (dims.num_nodes, dims.node_of(5), dims.ep_spans_nodes) == (4, 2, True)
    assert dims.ep_rank_nodes(1) == [2, 2, 3, 3] and dims.ep_node_ranks(1) == [[0, 1], [2, 3]]
    assert dims.dp_rank_nodes() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert not dims.hierarchical_ep  # spans nodes, but not asked for
    assert ParallelDims(world_size=8, ep=4, num_experts=8, ranks_per_node=2, ep_hierarchical=True).hierarchical_ep
    inside = ParallelDims(world_size=8, ep=2, num_experts=8, ranks_per_node=4, ep_hierarchical=True)
    assert not inside.ep_spans_nodes and not inside.hierarchical_ep  # falls back to the flat exchange
    assert inside.ep_node_ranks(3) == [[0, 1]]
    # Straddling (ranks 3-5 over two nodes) spans nodes too, but not as whole nodes.
    assert ParallelDims(world_size=12, ep=3, ranks_per_node=4).ep_rank_nodes(1) == [0, 1, 1]


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 6, "ranks_per_node": 4},
     ("the world size (6) must be a multiple of the ranks per node (4, LOCAL_WORLD_SIZE): every node must run "
      "the same number of processes")),
    ({"world_size": 4, "ranks_per_node": 0}, "ranks per node (0) must be an integer >= 1"),
    ({"world_size": 12, "ep": 6, "ranks_per_node": 4, "ep_hierarchical": True},
     ("parallel.ep_hierarchical needs ep groups made of whole nodes: parallel.ep (6) must be a multiple of the "
      "ranks per node (4) or divide it")),
    ({"world_size": 12, "ep": 3, "ranks_per_node": 4, "ep_hierarchical": True},
     "parallel.ep (3) must be a multiple of the ranks per node (4) or divide it"),
])
def test_bad_node_layouts_name_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelDims(**kwargs)


def test_ranks_per_node_come_from_the_launcher_of_this_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    dims = ParallelDims.from_config(ParallelConfig(ep=8, ep_hierarchical=True), world_size=8, num_experts=8)
    assert (dims.ranks_per_node, dims.num_nodes, dims.hierarchical_ep) == (4, 2, True)
    # A count that does not divide the world is left to build_mesh's check, which every rank reaches.
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert ParallelDims(world_size=6, ep=1).ranks_per_node == 4
    # Planning or checking another world size: the launcher's nodes do not describe it.
    assert ParallelDims(world_size=64, ep=8).ranks_per_node == 64
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ParallelDims(world_size=8, ep=8).num_nodes == 1


def test_ep_hierarchical_needs_expert_parallelism():
    assert ParallelConfig().ep_hierarchical is False
    with pytest.raises(ValueError, match=re.escape("parallel.ep_hierarchical (True) needs parallel.ep > 1 (is 1)")):
        ParallelConfig(ep_hierarchical=True)
    with pytest.raises(ValueError, match=re.escape("parallel.ep_hierarchical ('yes') must be true or false")):
        ParallelConfig(ep=2, ep_hierarchical="yes")


def _launcher_nodes_worker(rank, world_size, sizes):
    """Ranks told by their launcher that nodes hold ``sizes[rank]`` processes: every rank must
    raise the same error from build_mesh's gathered check."""
    import os

    os.environ["LOCAL_WORLD_SIZE"] = str(sizes[rank])
    os.environ.pop("GROUP_RANK", None)
    try:
        ParallelDims(world_size=world_size, ep=1).build_mesh()
        return None
    except ValueError as e:
        return str(e)


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [
    [2, 2, 1, 1],  # each count divides the world on its own
    # A node of 1 and one of 2: 2 does not divide 3. Those ranks used to raise alone, before the
    # process group, and the other waited for them until the setup timeout.
    [1, 2, 2]])
def test_nodes_of_different_sizes_fail_on_every_rank(sizes):
    messages = run_ranks(_launcher_nodes_worker, len(sizes), sizes, timeout_s=60)
    assert len(set(messages)) == 1 and messages[0] == (
        f"every node must run the same number of processes; LOCAL_WORLD_SIZE by rank: {sizes}")
