"""Every layout ``moetrain plan`` marks valid is one the job config accepts: each row is re-checked
here the way ``moetrain train --nproc W`` checks a job, from the config file and the row's
``--section.field=value`` overrides (``load_config``, ``ParallelDims`` at the world size, the
micro-batch count), independently of the planner's ``LayoutRules``."""

import pytest

from moetrain.config.loader import load_config
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.plan.plan_table import format_plan
from moetrain.plan.planner import make_plan

WORLD, NODES = 4, 2
BATCH = ["--train.global_batch_size=16", "--train.micro_batch_size=4"]


def _overrides(choice) -> list[str]:
    """The overrides a user passes to train a row of the main table (every rank data-parallel)."""
    over = [f"--parallel.zero_stage={choice.zero_stage}", f"--parallel.ep={choice.ep}",
            f"--train.activation_checkpointing={choice.ac}", f"--parallel.hsdp_replicate={choice.hsdp_replicate}"]
    if choice.offload != "none":
        over.append("--zero.offload_optimizer=cpu")
    if choice.offload == "params":
        over.append("--zero.offload_param=cpu")
    return over


def _refusal(config: str, overrides: list[str], world: int = WORLD) -> str | None:
    try:
        cfg = load_config(config, overrides)
        ParallelDims.from_config(cfg.parallel, world_size=world, num_experts=cfg.moe.num_experts,
                                 ranks_per_node=world // NODES)
        cfg.grad_accum_steps(world)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("extra, refused_stage, rule", [
    (["--dp.grad_compression=bf16"], 2, "dp.grad_compression ('bf16') needs parallel.zero_stage <= 1 (is 2)"),
    (["--dp.grad_compression=onebit"], 1, "dp.grad_compression ('onebit') needs parallel.zero_stage = 0 (is 1)"),
    (["--optim.name=muon"], 2, "zero.offload_optimizer ('cpu') must be 'none' with optim.name 'muon' at "
                               "parallel.zero_stage 2"),
])
def test_rows_the_config_refuses_are_invalid_and_say_why(extra, refused_stage, rule):
    base = BATCH + extra
    plan = make_plan(load_config("tiny", base), nproc=WORLD, nodes=NODES)
    refused = [r for r in plan.rows if r.choice.zero_stage == refused_stage and r.choice.offload == "optimizer"
               and r.choice.ep <= 2]  # ep = 4 spans the nodes: ParallelDims' rules come first
    assert refused and all(not r.valid and r.reason.startswith(rule) for r in refused)
    valid = [r for r in plan.rows if r.valid]
    assert valid and plan.ranked
    # Every valid row, the first-ranked one included, is a job the config accepts.
    for r in valid:
        assert _refusal("tiny", base + _overrides(r.choice)) is None, r.choice.label()
    assert plan.ranked[0] in valid


def test_bf16_compression_plan_ranks_only_stages_0_and_1():
    # The plan of `moetrain plan --config tiny --nproc 4 --dp.grad_compression=bf16`: stages 2/3
    # reduce-scatter FSDP2's own buckets, which cannot be compressed.
    plan = make_plan(load_config("tiny", BATCH + ["--dp.grad_compression=bf16"]), nproc=WORLD, nodes=NODES)
    assert {r.choice.zero_stage for r in plan.ranked} == {0, 1}
    assert all(not r.valid for r in plan.rows if r.choice.zero_stage >= 2)
    # The tensor- and pipeline-parallel tables apply the config's rules too.
    assert [t.valid for t in plan.tp_rows] == [True, False]
    assert "needs parallel.tp = 1 (is 2)" in plan.tp_rows[1].reason
    assert plan.pp_rows and all("must be 'none' with parallel.pp" in p.reason for p in plan.pp_rows)


def test_a_config_with_every_n_checkpointing_plans_the_other_choices_too():
    # Each row stands for the job with its own checkpointing: the interval every_n reads is reset on
    # the others, which the config would refuse as a field of a switched-off feature.
    every_n = ["--train.activation_checkpointing=every_n", "--train.activation_checkpointing_every=3"]
    plan = make_plan(load_config("tiny", BATCH + every_n), nproc=WORLD, nodes=NODES)
    plain = make_plan(load_config("tiny", BATCH), nproc=WORLD, nodes=NODES)
    assert [r.valid for r in plan.rows] == [r.valid for r in plain.rows]
    assert not any("activation_checkpointing_every" in (r.reason or "") for r in plan.rows)


def test_muon_refuses_expert_tensor_parallelism_in_the_etp_table():
    plan = make_plan(load_config("tiny", BATCH + ["--optim.name=muon", "--parallel.ep=2"]), nproc=WORLD,
                     nodes=NODES)
    assert [(e.etp, e.valid) for e in plan.etp_rows] == [(1, True), (2, False)]
    assert plan.etp_rows[1].reason.startswith("parallel.etp (2) must be 1 with optim.name 'muon'")
    assert _refusal("tiny", BATCH + ["--optim.name=muon", "--parallel.ep=2", "--parallel.etp=2"]) is not None


def test_a_classifier_is_never_advised_pipeline_stages():
    # thucnews-ep2 is a classifier: no pipeline layout trains it, so none is valid or advised.
    plan = make_plan(load_config("thucnews-ep2"), nproc=2, device_memory=200 * 2**20)
    assert plan.pp_rows and all(p.reason == "model.head ('classifier') must be 'lm' with parallel.pp (2) > 1"
                                for p in plan.pp_rows)
    assert "parallel.pp=" not in format_plan(plan)
    for p in plan.pp_rows:
        assert _refusal("thucnews-ep2", [f"--parallel.pp={p.pp}", f"--parallel.pp_schedule={p.schedule}",
                                         f"--parallel.pp_virtual_stages={p.virtual_stages}"], world=2) is not None


def test_stage_3_ranks_after_every_lighter_choice_that_fits():
    # On 2 nodes of 2, ep = 4 spans the nodes; a lighter stage that fits only there still ranks
    # before stage 3 inside a node (docs/memory.md: do not use stage 3 when a lower stage fits).
    cfg = load_config("tiny", BATCH)
    plan = make_plan(cfg, nproc=WORLD, nodes=NODES, eps=[2, 4], stages=(2, 3), offloads=("none",), acs=("none",))
    rows = {(r.choice.zero_stage, r.choice.ep, r.choice.hsdp_replicate): r for r in plan.rows}
    limit = max(rows[(3, 2, 1)].device_bytes, rows[(2, 4, 1)].device_bytes)
    plan = make_plan(cfg, nproc=WORLD, nodes=NODES, eps=[2, 4], stages=(2, 3), offloads=("none",), acs=("none",),
                     device_memory=limit)
    fitting = plan.ranked
    stages = [r.choice.zero_stage for r in fitting]
    assert 2 in stages and 3 in stages and stages == sorted(stages)
    assert any(r.ep_spans_nodes for r in fitting if r.choice.zero_stage == 2)
    assert "only ZeRO-3 fits" not in format_plan(plan)
    only_three = make_plan(cfg, nproc=WORLD, nodes=NODES, stages=(3,), offloads=("none",), acs=("none",))
    assert "advice: only ZeRO-3 fits this device" in format_plan(only_three)
