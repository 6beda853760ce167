"""Model states the trainer allocates beyond parameters, gradients and optimizer states, and the
trainer's LoRA model, in the planner (``plan.model_states``) and the dry run (``plan.dry_run``):

* finetune.lora_rank: frozen base weights have no gradient or optimizer state (against a real model
  built as ``build_model`` builds it, and against the dry run);
* dp.grad_compression "onebit": 1-bit Adam's worker and server residuals (worked by hand, and against
  the buffers the real wrapper allocates under the fake process group);
* parallel.expert_slots_per_rank: the Rebalancer's replica bank and its gradients (against the bank the
  real Rebalancer attaches, and the skew plan's spare-slot rows);
* ``moetrain plan --nodes`` with ``--skew``, and the CLI's rules for --device-memory and --spare-slots.
"""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from moetrain.cli import main as cli_main
from moetrain.cli.plan import parse_bytes
from moetrain.config.loader import load_config
from moetrain.plan import model_states
from moetrain.plan.dry_run import dry_run
from moetrain.plan.model_states import Layout, ParamSpec, param_specs, rank_state_bytes
from moetrain.plan.planner import resolve_vocab
from moetrain.plan.skew import make_skew_plan
from moetrain.plan.step_time import H100_SXM

# The skew tests' model: 2 MoE blocks of 8 experts top-2 at ep = 4.
SKEW = ["--model.dim=64", "--model.num_layers=2", "--model.num_heads=4", "--model.max_seq_len=64",
        "--moe.num_experts=8", "--moe.top_k=2", "--moe.expert_hidden_dim=128", "--data.tokenizer=bytes",
        "--data.seq_len=64", "--train.global_batch_size=16", "--train.micro_batch_size=4", "--parallel.ep=4"]


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized()


# ----- LoRA ---------------------------------------------------------------------------------------------


def test_lora_states_equal_the_model_the_trainer_builds():
    """World 1, stage 0: every parameter in fp32, but gradients and AdamW states (two fp32 moments and a
    4-byte step) only for the adapters, counted on a real CPU model with ``apply_lora``."""
    from moetrain.models.lora import apply_lora
    from moetrain.models.transformer import Transformer

    cfg = load_config("tiny", ["--finetune.lora_rank=8", "--parallel.ep=1"])
    model_cfg = resolve_vocab(cfg)
    model = Transformer(model_cfg, moe=cfg.moe, seed=0)
    apply_lora(model, cfg.finetune, seed=0)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    assert 0 < len(trainable) < len(params)
    planned = rank_state_bytes(param_specs(model_cfg, cfg.moe, finetune=cfg.finetune), Layout.of_config(cfg, 1), 0)
    assert planned.param == sum(p.numel() for p in params) * 4
    assert planned.grad == sum(p.numel() for p in trainable) * 4
    assert planned.optim == sum(p.numel() * 8 + 4 for p in trainable)
    assert planned.average == planned.replica == planned.residual == 0


@pytest.mark.parametrize("overrides,world", [
    (["--parallel.ep=1", "--parallel.zero_stage=0"], 2),
    (["--parallel.ep=2", "--parallel.zero_stage=1"], 4),
    (["--parallel.ep=2", "--parallel.zero_stage=3", "--optim.ema_decay=0.99"], 4),
    (["--parallel.ep=2", "--parallel.zero_stage=2", "--finetune.lora_targets=[attention,experts]"], 2),
])
def test_lora_dry_run_equals_the_planner(overrides, world):
    """The dry run builds the adapters (as the trainer does) and the planner plans them: equal, and the
    gradients are a small fraction of the (frozen) parameters."""
    cfg = load_config("tiny", ["--finetune.lora_rank=8", *overrides])
    d = dry_run(cfg, nproc=world)
    assert d.measured == d.planned, (d.measured, d.planned)
    assert 0 < d.measured.grad < d.measured.param / 4
    assert 0 < d.measured.optim < d.measured.param / 2


# ----- 1-bit Adam residuals -------------------------------------------------------------------------------


def test_onebit_residuals_worked_by_hand():
    """Chunk length L = 8 * ceil(N / (8 W)); a tensor costs (W + 1) L fp32 (the worker residual padded to
    W chunks, the server residual one chunk).

    * dense [10] at world 4: L = 8, (4 + 1) * 8 * 4 = 160 bytes;
    * experts [4, 3, 5] at ep 2 of 4 ranks: a local shard of 30 elements over edp 2: L = 16,
      (2 + 1) * 16 * 4 = 192 bytes;
    * a frozen tensor: nothing."""
    specs = [ParamSpec("a", (10,), expert=False), ParamSpec("w", (4, 3, 5), expert=True),
             ParamSpec("frozen", (100,), expert=False, trainable=False)]
    collapsed = [(s, 1) for s in specs]

    def residuals(ep: int) -> int:
        layout = Layout(world=4, ep=ep, zero_stage=0, grad_compression="onebit")
        return model_states.onebit_residual_bytes(collapsed, layout)

    assert residuals(2) == 160 + 192
    assert rank_state_bytes(specs, Layout(world=4, ep=2, zero_stage=0, grad_compression="onebit"), 3).residual \
        == 160 + 192
    assert residuals(4) == 160  # ep = world: the experts have no copies (edp 1), no expert reducer
    assert residuals(1) == 160 + 320  # replicated experts: [60] over 4 ranks, L = 16, 5 * 16 * 4
    for layout in (Layout(world=4, ep=2, zero_stage=0), Layout(world=1, ep=1, zero_stage=0, grad_compression="onebit"),
                   Layout(world=4, ep=2, zero_stage=0, grad_compression="bf16")):
        assert rank_state_bytes(specs, layout, 0).residual == 0


@pytest.mark.parametrize("overrides,world", [(["--parallel.ep=1"], 2), (["--parallel.ep=2"], 4)])
def test_onebit_residuals_equal_the_wrapper_buffers(overrides, world):
    """The buffers ``MoEDataParallel``'s reducers allocate (counted by the dry run on the real wrapper)
    equal the planned residuals; at world 2, ep 1 the tiny model's are 17,332,992 bytes (1.5 x its
    parameters: a worker residual of each tensor and a server residual of half of it)."""
    cfg = load_config("tiny", ["--dp.grad_compression=onebit", "--parallel.zero_stage=0", *overrides])
    d = dry_run(cfg, nproc=world)
    assert d.measured == d.planned, (d.measured, d.planned)
    assert d.measured.residual > d.measured.param
    if world == 2:
        assert d.measured.residual == 17_332_992
    assert rank_state_bytes(param_specs(resolve_vocab(cfg), cfg.moe), Layout.of_config(cfg, world), 0).residual \
        == d.measured.residual


# ----- the replica bank of spare expert slots ----------------------------------------------------------------


def _slots_cfg(*extra: str):
    return load_config("tiny", ["--parallel.ep=2", "--parallel.expert_slots_per_rank=5", "--moe.rebalance_every=10",
                                *extra])


def test_replica_bank_is_counted_as_the_rebalancer_allocates_it():
    """tiny at ep 2 with 5 slots per rank: 1 spare slot beside the 4 home experts, in every MoE layer. The
    bank (counted on the Rebalancer the dry run builds) is one expert of each expert tensor, twice with
    its gradient: 2 * 1,048,576 bytes, and the planner says the same."""
    cfg = _slots_cfg()
    d = dry_run(cfg, nproc=2)
    assert d.measured == d.planned, (d.measured, d.planned)
    specs = param_specs(resolve_vocab(cfg), cfg.moe)
    one_expert = sum(s.numel // s.shape[0] for s in specs if s.expert) * 4
    assert one_expert == 1_048_576
    assert d.measured.replica == 2 * one_expert
    without = dry_run(load_config("tiny", ["--parallel.ep=2"]), nproc=2)
    assert d.measured.total - without.measured.total == 2 * one_expert


def test_frozen_replicas_take_no_gradient():
    """With LoRA on the experts the bank copies the frozen weights (no gradient) and the adapters (with
    theirs)."""
    cfg = _slots_cfg("--finetune.lora_rank=4", "--parallel.zero_stage=1")
    d = dry_run(cfg, nproc=4)
    assert d.measured == d.planned, (d.measured, d.planned)
    specs = param_specs(resolve_vocab(cfg), cfg.moe, finetune=cfg.finetune)
    weights = sum(s.numel // s.shape[0] for s in specs if s.expert) * 4
    adapters = sum(s.numel // s.shape[0] for s in specs if s.expert and s.trainable) * 4
    assert 0 < adapters < weights
    assert d.measured.replica == weights + adapters == model_states.replica_slot_bytes(specs)


def test_skew_spare_slot_rows_cost_what_the_rebalancer_allocates():
    """The skew plan's "1 spare slot" row adds the bank the dry run counts for E/ep + 1 slots per rank."""
    cfg = load_config(None, SKEW)
    plan = make_skew_plan(cfg, nproc=4, skew="zipf:1.2", capacity_factors=(), spare_slots=(1, 2))
    rows = {r.spare_slots: r for r in plan.rows}
    d = dry_run(load_config(None, [*SKEW, "--parallel.expert_slots_per_rank=3", "--moe.rebalance_every=5"]), nproc=4)
    assert d.measured.replica > 0
    assert rows[1].slot_state_bytes == d.measured.replica
    assert rows[2].slot_state_bytes == 2 * d.measured.replica


def test_cli_dry_run_prints_the_new_rows(capsys):
    assert cli_main(["plan", "--config", "tiny", "--nproc", "2", "--dry-run", "--parallel.ep=2",
                     "--parallel.expert_slots_per_rank=5", "--moe.rebalance_every=10"]) == 0
    out = capsys.readouterr().out
    assert "replicas" in out and "model states match the planner exactly" in out


# ----- --nodes with --skew, and the CLI's rules ---------------------------------------------------------------


def test_skew_plan_uses_the_nodes():
    """ep 4 over 2 nodes of 2: the all-to-all and the gradient all-reduce cross the slower inter-node link,
    so every row's step is slower than on one node; the memory is the same."""
    cfg = load_config(None, SKEW)
    one = make_skew_plan(cfg, nproc=4, skew="zipf:1.2", profile=H100_SXM)
    two = make_skew_plan(cfg, nproc=4, nodes=2, skew="zipf:1.2", profile=H100_SXM)
    assert two.balanced_step_s > one.balanced_step_s
    for a, b in zip(one.rows, two.rows, strict=True):
        assert b.step_s > a.step_s and b.device_bytes == a.device_bytes
    with pytest.raises(ValueError, match=r"--nodes \(3\) must be an int >= 1 that divides --nproc \(4\)"):
        make_skew_plan(cfg, nproc=4, nodes=3, skew="zipf:1.2")


def test_cli_skew_passes_the_nodes(capsys):
    steps = []
    for nodes in ("1", "2"):
        assert cli_main(["plan", "--nproc", "4", "--nodes", nodes, *SKEW, "--skew", "zipf:1.2", "--device-profile",
                         "h100", "--json"]) == 0
        steps.append(json.loads(capsys.readouterr().out)["balanced_step_s"])
    assert steps[1] > steps[0]


@pytest.mark.parametrize("value", ["0", "0.5", "0GiB", 0])
def test_device_memory_must_be_at_least_one_byte(value):
    with pytest.raises(ValueError, match=r"--device-memory \(.*\) must be > 0 and at least 1 byte"):
        parse_bytes(value)
    assert parse_bytes("1") == 1 and parse_bytes("1.5") == 1 and parse_bytes("0.5KiB") == 512


def test_cli_rules_of_the_lists(capsys):
    assert cli_main(["plan", "--nproc", "4", *SKEW, "--skew", "zipf:1", "--spare-slots", "1.5"]) == 2
    assert "--spare-slots ('1.5') must be a comma-separated list of integers >= 1" in capsys.readouterr().err
    assert cli_main(["plan", "--nproc", "4", *SKEW, "--skew", "zipf:1", "--capacity-factors", "0"]) == 2
    assert "--capacity-factors ('0') must be a comma-separated list of numbers > 0" in capsys.readouterr().err
    assert cli_main(["plan", "--nproc", "4", *SKEW, "--device-memory", "0"]) == 2
    assert "--device-memory ('0') must be > 0" in capsys.readouterr().err
