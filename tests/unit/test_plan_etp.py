"""``moetrain plan``'s expert tensor-parallel choices: expert states per rank and etp collective bytes
against numbers worked out by hand, the config's rules, the advice, and a layout's communication at
etp. (That these volumes, forward and backward, are what a real fp32 etp run sends over its etp
group is checked on gloo ranks in tests/distributed/test_tensor_parallel.py.)"""

import pytest

from moetrain.config.loader import load_config
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.plan.comm import comm_per_step, etp_bytes_per_micro_batch
from moetrain.plan.expert_tensor_parallel import etp_advice, etp_choices
from moetrain.plan.model_states import Layout, param_specs
from moetrain.plan.plan_table import format_plan
from moetrain.plan.planner import make_plan, resolve_vocab
from moetrain.plan.step_time import H200, estimate_for_config

# 2 blocks, both MoE, D 32; 4 experts of hidden 64 (gelu: w1 [4, 32, 64], w2 [4, 64, 32]), top-2.
OVERRIDES = ["model.dim=32", "model.num_layers=2", "model.num_heads=4", "model.moe_every=1", "moe.num_experts=4",
             "moe.top_k=2", "moe.expert_hidden_dim=64", "data.seq_len=16", "model.max_seq_len=16",
             "train.global_batch_size=8", "train.micro_batch_size=1", "parallel.ep=2", "data.vocab_size=512",
             "train.dtype=fp32"]
EXPERT_NUMEL = 2 * (4 * 32 * 64 + 4 * 64 * 32)  # 32768
OTHER_NUMEL = 2 * 512 * 32 + 2 * (4 * 32 * 32 + 2 * 32 + 4 * 32) + 32  # embedding, head, blocks, final norm


def _choices(extra=(), *, world=8, per_node=None, device_memory=None):
    cfg = load_config(None, OVERRIDES + list(extra))
    model = resolve_vocab(cfg)
    specs = param_specs(model, cfg.moe)
    return etp_choices(specs, cfg, model, world=world, per_node=per_node or world, tokens_per_micro_batch=16,
                       grad_accum=3, compute_bytes=4, device_memory=device_memory)


def test_bytes_by_hand():
    model = ModelConfig(vocab_size=512, dim=32, num_layers=2, num_heads=4, max_seq_len=16, moe_every=1)
    # T = 16 tokens, K = 2, fp32, etp 2 (each rank sends one chunk of every collective), per layer:
    # forward gather 16 * (32*4 + 2*8 + 2*4) = 2432, forward reduce-scatter 16 * 32*4 = 2048;
    # backward: the output gradient's gather 2048, the token and gate-weight gradients' reduce-scatter
    # 16 * (32*4 + 2*4) = 2176. Two MoE layers.
    assert etp_bytes_per_micro_batch(model, etp=2, tokens=16, top_k=2, compute_bytes=4) == (2 * (2432 + 2048),
                                                                                          2 * (2048 + 2176))
    # Both layers recomputed: their forward collectives again.
    assert etp_bytes_per_micro_batch(model, etp=2, tokens=16, top_k=2, compute_bytes=4, num_recomputed=2) == (
        2 * (2432 + 2048) + 2 * 2432, 2 * (2048 + 2176) + 2 * 2048)
    # etp 4: three chunks out of every collective.
    assert etp_bytes_per_micro_batch(model, etp=4, tokens=16, top_k=2, compute_bytes=4) == (3 * 8960, 3 * 8448)
    # bf16: tokens and outputs 2 bytes a value; ids stay int64 and gate weights fp32.
    assert etp_bytes_per_micro_batch(model, etp=2, tokens=16, top_k=2, compute_bytes=2) == (
        2 * (16 * (64 + 16 + 8) + 16 * 64), 2 * (16 * 64 + 16 * (64 + 8)))
    assert etp_bytes_per_micro_batch(model, etp=1, tokens=16, top_k=2, compute_bytes=4) == (0, 0)


def test_states_all_to_all_and_validity():
    choices = _choices()
    assert [c.etp for c in choices] == [1, 2, 4, 8]
    assert [c.valid for c in choices] == [True, True, True, False]
    # The rules are ParallelDims' own, word for word what a launch would say.
    assert choices[3].reason == ("parallel.ep (2) * parallel.etp (8) must divide parallel.dp * parallel.tp (8): expert "
                                 "parallelism folds over the ranks of one pipeline stage")
    # E/ep experts, 1/etp of their hidden dim, 16 bytes an element.
    assert [c.expert_state_bytes for c in choices[:3]] == [EXPERT_NUMEL // 2 * 16, EXPERT_NUMEL // 4 * 16,
                                                            EXPERT_NUMEL // 8 * 16]
    assert all(c.other_state_bytes == OTHER_NUMEL * 16 for c in choices)
    assert (choices[1].gather_bytes, choices[1].scatter_bytes) == (3 * 8960, 3 * 8448)  # 3 micro-batches
    # All-to-all at ep 2: 2 (dispatch, combine) * T*K rows of 32 fp32 values, half to the other rank,
    # forward and backward of 2 layers, 3 micro-batches: 3 * 4 * 4096 at etp 1; the gathered
    # etp * T tokens make it etp times that.
    assert [c.all_to_all_bytes for c in choices[:3]] == [3 * 4 * 4096 * e for e in (1, 2, 4)]
    assert choices[0].gather_bytes == choices[0].scatter_bytes == 0
    # On nodes of 4: ep 2 x etp 4 = 8 ranks is two nodes.
    assert [c.spans_nodes for c in _choices(world=8, per_node=4)] == [False, False, True]


@pytest.mark.parametrize("extra, etp, reason", [
    (["moe.expert_hidden_dim=34"], 4, ("moe.expert_hidden_dim (34) must be a multiple of parallel.etp (4): each rank "
                                        "holds 1/etp of every expert's hidden dim")),
    (["parallel.ep_hierarchical=true"], 2,
     ("parallel.ep_hierarchical needs parallel.tp, pp and etp = 1 (are 1, 1, 2): its node mesh is laid out for one "
     "stage without tensor parallelism")),
    (["moe.capacity_factor=1.25"], 2, ("moe.capacity_factor (1.25) must be null with parallel.etp (2) > 1: expert "
                                        "tensor parallelism is dropless")),
])
def test_the_configs_rules(extra, etp, reason):
    choices = {c.etp: c for c in _choices(extra)}
    assert choices[1].valid
    assert not choices[etp].valid and choices[etp].reason == reason


def test_advice_and_the_plan_section():
    # etp 1 holds 662,016 + 262,144 bytes of states; etp 2 holds 662,016 + 131,072.
    tight = _choices(device_memory=800_000)
    assert [c.fits for c in tight] == [False, True, True, None]
    assert etp_advice(tight).startswith("the stage-0 model states do not fit at ep=2, etp=1: parallel.etp=2 splits")
    # The table is at stage 0 whatever the config's stage (a ZeRO-3 config asks what etp would give).
    assert [c.valid for c in _choices(["parallel.zero_stage=3"])] == [True, True, True, False]
    assert etp_advice(_choices()) is None  # no device memory given
    plan = make_plan(load_config(None, OVERRIDES), nproc=8, stages=(0,), offloads=("none",), acs=("none",))
    assert [c.etp for c in plan.etp_rows] == [1, 2, 4, 8]
    assert "expert tensor parallelism at ep=2" in format_plan(plan)
    as_json = plan.to_dict()
    assert as_json["expert_tensor_parallel"][1]["etp"] == 2 and as_json["etp_advice"] is None
    dense = make_plan(load_config(None, OVERRIDES + ["model.moe_every=0", "parallel.ep=1"]), nproc=8, stages=(0,),
                      offloads=("none",), acs=("none",))
    assert dense.etp_rows == [] and "expert tensor parallelism" not in format_plan(dense)


def test_a_layouts_communication_at_etp():
    """``comm_per_step`` of an etp layout (the dry run's and the config's): expert gradients split
    over ep * etp and reduced over edp = world / (ep * etp), the all-to-all of the gathered tokens,
    and the etp collectives on top. World 8, ZeRO-1, 3 micro-batches of 16 tokens, fp32."""
    model = ModelConfig(vocab_size=512, dim=32, num_layers=2, num_heads=4, max_seq_len=16, moe_every=1)
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=64)
    specs = param_specs(model, moe)

    def comm(ep, etp):
        return comm_per_step(specs, Layout(world=8, ep=ep, zero_stage=1, etp=etp), model, moe,
                             tokens_per_micro_batch=16, grad_accum=3, compute_bytes=4)

    dense_ar, dense_ag = 2 * OTHER_NUMEL * 4 * 7 // 8, OTHER_NUMEL * 4 * 7 // 8  # over all 8 ranks
    base, split = comm(2, 1), comm(2, 2)
    # etp 1: 16,384 local expert elements over edp 4; etp 2: 8,192 over edp 2.
    assert base.all_reduce == dense_ar + 2 * 16384 * 4 * 3 // 4
    assert split.all_reduce == dense_ar + 2 * 8192 * 4 // 2
    assert base.all_to_all == 3 * 4 * 4096 and split.all_to_all == 2 * base.all_to_all
    # The ZeRO-1 parameter gather plus the etp gathers (3 x 8,960); the etp reduce-scatters (3 x 8,448).
    assert split.all_gather == dense_ag + 8192 * 4 // 2 + 3 * 8960 and split.reduce_scatter == 3 * 8448
    # ep 1 x etp 2: the experts still reduce over edp 4 only, and there is no all-to-all.
    alone = comm(1, 2)
    assert (alone.all_reduce, alone.all_to_all) == (dense_ar + 2 * 16384 * 4 * 3 // 4, 0)
    with pytest.raises(ValueError, match=r"parallel.etp \(2\) > 1 needs parallel.zero_stage 0 or 1 \(is 2\)"):
        comm_per_step(specs, Layout(world=8, ep=2, zero_stage=2, etp=2), model, moe, tokens_per_micro_batch=16,
                      grad_accum=1, compute_bytes=4)


def test_the_step_time_estimate_refuses_etp():
    with pytest.raises(ValueError, match=r"parallel.etp \(2\) must be 1 for a step-time estimate"):
        estimate_for_config(load_config(None, OVERRIDES + ["parallel.etp=2"]), world=8, profile=H200)
