"""``moetrain plan --dry-run``: one rank built for real (meta device, torch's fake process group of
the real world size, the trainer's parallelisation and optimizer) against the planner's exact
per-rank model-state bytes; and the planner against DeepSpeed's published ZeRO estimates."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch.distributed as dist

from moetrain.cli import main as cli_main
from moetrain.config.loader import load_config
from moetrain.plan.dry_run import DryRun, dry_run, dry_run_isolated, format_dry_run
from moetrain.plan.model_states import ADAM_STEP_BYTES, Layout, _meta_model, param_specs, rank_state_bytes
from moetrain.plan.planner import resolve_vocab

CONFIGS = ("mixtral-8x7b", "deepseek-v3")


def _cfg(name: str, *overrides: str):
    return load_config(name, list(overrides))


@pytest.fixture(autouse=True)
def _no_process_group():
    # The dry run creates (and removes) a process-wide fake group: there must be none around it.
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized()


@pytest.mark.parametrize("world", [64, 1024])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_dry_run_bytes_equal_the_planner_at_cluster_size(config, world, stage):
    """At the config's expert-parallel layout (mixtral ep 8, deepseek-v3 ep 64) and ZeRO 1-3, the
    default (largest-memory) rank's counted bytes equal the planner's, byte for byte."""
    cfg = _cfg(config, f"--parallel.zero_stage={stage}")
    d = dry_run(cfg, nproc=world)
    assert (d.world, d.zero_stage, d.ep) == (world, stage, cfg.parallel.ep)
    assert d.measured == d.planned, (d.measured, d.planned)
    assert d.measured_buffer_bytes == d.planned_buffer_bytes
    assert d.param_devices == ["meta"]
    # Sanity: the bytes are the sharded ones, not the whole model's 16 bytes per parameter.
    num_params = sum(s.numel for s in param_specs(resolve_vocab(cfg), cfg.moe))
    assert d.measured.total < 16 * num_params / 8


@pytest.mark.parametrize("config,world,stage,rank", [
    ("mixtral-8x7b", 1024, 3, 1023), ("mixtral-8x7b", 1024, 2, 517), ("deepseek-v3", 1024, 3, 1023),
    ("deepseek-v3", 64, 0, 63), ("mixtral-8x7b", 64, 0, 5)])
def test_dry_run_of_a_chosen_rank(config, world, stage, rank):
    """Other ranks hold other (uneven, maybe empty) chunks: still exact, and ``--rank`` is obeyed."""
    d = dry_run(_cfg(config, f"--parallel.zero_stage={stage}"), nproc=world, rank=rank)
    assert d.rank == rank and d.rank_note == "given (--rank)"
    assert d.measured == d.planned


@pytest.mark.parametrize("stage,rank", [(1, 5), (3, 517)])
def test_weight_average_bytes_equal_the_planner(stage, rank):
    """optim.ema_decay adds the rank's copy of its weights (whole at stages 0/1, the unpadded shard at
    2/3): counted on the built WeightAverage, planned by the shard arithmetic."""
    world = 1024
    base = dry_run(_cfg("mixtral-8x7b", f"--parallel.zero_stage={stage}"), nproc=world, rank=rank)
    d = dry_run(_cfg("mixtral-8x7b", f"--parallel.zero_stage={stage}", "--optim.ema_decay=0.999"), nproc=world,
                rank=rank)
    assert d.measured == d.planned, (d.measured, d.planned)
    assert base.measured.average == 0 and d.measured.average > 0
    assert (d.measured.param, d.measured.grad, d.measured.optim) == (base.measured.param, base.measured.grad,
                                                                       base.measured.optim)
    if stage <= 1:
        assert d.measured.average == d.measured.param  # every held weight, whole
    else:
        assert d.measured.average <= d.measured.param  # FSDP2 pads its shards; the average does not


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_default_rank_is_the_largest_of_every_rank(stage):
    """Every rank of a small world with uneven shards (dim 256 over 12 ranks), dry-run one by one:
    each equals the planner, they differ, and the default rank holds the most."""
    cfg = _cfg("mixtral-8x7b", "--model.preset=mixtral-mini", "--model.num_layers=2", "--data.vocab_size=2048",
               "--data.seq_len=256", "--parallel.ep=2", f"--parallel.zero_stage={stage}")
    runs = [dry_run(cfg, nproc=12, rank=r) for r in range(12)]
    assert all(d.measured == d.planned for d in runs)
    totals = [d.measured.total for d in runs]
    assert len(set(totals)) > 1, "the shards should be uneven in this layout"
    default = dry_run(cfg, nproc=12)
    assert default.measured.total == max(totals)
    assert default.rank == totals.index(max(totals))


def _peak_rss_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def test_nothing_is_allocated_for_weights():
    """DeepSeek-V3 at ZeRO-0 on 1024 ranks: the built rank holds > 300 GiB of model states (and
    the model is 2.7 TB in fp32), yet the process's peak memory grows by far less than 1 GiB."""
    cfg = _cfg("deepseek-v3", "--parallel.zero_stage=0")
    _peak_rss_reset()
    before = _status_kib("VmRSS")
    d = dry_run(cfg, nproc=1024, rank=3)
    grown = (_status_kib("VmHWM") - before) * 1024
    assert d.measured.total > 300 * 2**30
    assert d.param_devices == ["meta"]
    assert grown < 2**30, f"peak RSS grew by {grown / 2**20:.0f} MiB"


def test_dry_run_in_a_fresh_interpreter_when_a_process_group_exists():
    """With a process group already in this process, the fake one cannot be created here: the
    dry run goes to a subprocess and comes back as the same numbers."""
    cfg = _cfg("mixtral-8x7b", "--parallel.zero_stage=3")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="without a process group"):
            dry_run(cfg, nproc=64)
        d = dry_run_isolated(cfg, nproc=64, rank=9)
    finally:
        dist.destroy_process_group()
    assert isinstance(d, DryRun) and d.rank == 9 and d.measured == d.planned
    assert d.planned == rank_state_bytes(param_specs(resolve_vocab(cfg), cfg.moe),
                                         Layout(world=64, ep=8, zero_stage=3), 9)


def test_cli_prints_the_comparison(capsys):
    assert cli_main(["plan", "--config", "deepseek-v3", "--nproc", "1024", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "world 1024 = ep 64 x edp 16, ZeRO-3" in out and "rank 0: the largest-memory rank" in out
    assert "model states match the planner exactly" in out
    assert cli_main(["plan", "--config", "mixtral-8x7b", "--nproc", "64", "--dry-run", "--rank", "7", "--json",
                     "--parallel.zero_stage=1"]) == 0
    import json

    d = DryRun.from_dict(json.loads(capsys.readouterr().out))
    assert (d.rank, d.zero_stage, d.measured == d.planned) == (7, 1, True)


@pytest.mark.parametrize("stage,etp,rank", [(0, 2, None), (1, 2, None), (1, 4, 63), (0, 8, 17)])
def test_expert_tensor_parallel_bytes_equal_the_planner(stage, etp, rank):
    """parallel.etp: each rank holds 1/etp of its E/ep experts' hidden dim (2-D DTensors on the (ep,
    etp) mesh), and ZeRO-1 slices their optimizer states over edp = world / (ep * etp)."""
    world, ep = 64, 8
    cfg = _cfg("mixtral-8x7b", f"--parallel.zero_stage={stage}", f"--parallel.etp={etp}")
    d = dry_run(cfg, nproc=world, rank=rank)
    assert (d.etp, d.ep) == (etp, ep) and d.measured == d.planned, (d.measured, d.planned)
    # Against etp = 1 on the same rank: the expert weights shrink by exactly (etp - 1) / etp.
    base = dry_run(_cfg("mixtral-8x7b", f"--parallel.zero_stage={stage}"), nproc=world, rank=d.rank)
    expert_numel = sum(s.numel for s in param_specs(resolve_vocab(cfg), cfg.moe) if s.expert) // ep
    assert base.measured.param - d.measured.param == expert_numel * 4 * (etp - 1) // etp
    assert f"world 64 = ep 8 x etp {etp} x edp {64 // (8 * etp)}" in format_dry_run(d)


@pytest.mark.parametrize("args,match", [
    (["--dry-run", "--zero.offload_optimizer=cpu"], r"zero.offload_optimizer \('cpu'\) must be 'none'"),
    (["--dry-run", "--rank", "64"], r"--rank \(64\) must be an int in \[0, --nproc \(64\)\)"),
    (["--rank", "3"], r"--rank \(3\) needs --dry-run"),
])
def test_dry_run_errors_name_the_setting(args, match, capsys):
    assert cli_main(["plan", "--config", "mixtral-8x7b", "--nproc", "64", *args]) != 0
    assert re.search(match, capsys.readouterr().err)


# ----- cross-check with DeepSpeed's published ZeRO estimates ------------------------------------------


def _deepspeed_zero2_gpu_bytes(total_params: int, total_gpus: int) -> int:
    # deepspeed/runtime/zero/stage_1_and_2.py, estimate_zero2_model_states_mem_needs, cpu_offload=False
    return 4 * total_params + int(16 * total_params / total_gpus)


def _deepspeed_zero3_gpu_bytes(total_params: int, largest_layer_params: int, total_gpus: int) -> int:
    # deepspeed/runtime/zero/stage3.py, estimate_zero3_model_states_mem_needs, cpu_offload=False
    return 4 * largest_layer_params + int(18 * total_params / total_gpus)


@pytest.mark.parametrize("config,overrides,world", [
    ("tiny-dense", ["--data.vocab_size=4096"], 8),
    ("tiny-dense", ["--data.vocab_size=4096"], 64),
    ("mixtral-8x7b", ["--model.moe_every=0", "--parallel.ep=1"], 64),  # a 6.9B Llama-shaped dense model
])
def test_planner_against_deepspeed_zero_estimates(config, overrides, world):
    """DeepSpeed's estimates for a dense model of Φ parameters on N GPUs (mixed precision, Adam,
    no offload), per GPU:

        ZeRO-2: 4Φ + 16Φ/N  = fp16 parameters and fp16 gradients, both whole (2Φ + 2Φ), plus the
                              partition of fp32 master weights, momentum, variance and fp32 gradients
        ZeRO-3: 4L + 18Φ/N  = the largest layer's L parameters gathered (4 bytes each), plus the
                              partition of fp16 parameters (2) and the 16 bytes above

    moetrain keeps fp32 parameters (the master copy) and fp32 gradients sharded at stages 2 and 3
    and AdamW's two fp32 moments, 16Φ/N, plus a 4-byte step counter per tensor; the bf16 copies
    exist only while FSDP2 gathers a unit (the planner's ``gathered_param_bytes``). So, with every
    dim-0 divisible by N (no padding), exactly:

        planner(stage 2) - steps = DeepSpeed ZeRO-2 - 4Φ            (no whole fp16 params or grads)
        planner(stage 3) - steps = DeepSpeed ZeRO-3 - 4L - 2Φ/N     (no fp16 partition, nothing
                                                                      gathered at rest)

    The DeepSpeed numbers are computed here from its formulas (deepspeedai/DeepSpeed, the two
    functions named above), independently of the planner."""
    cfg = load_config(config, overrides)
    model = resolve_vocab(cfg)
    assert not model.is_moe
    net = _meta_model(model, cfg.moe)
    phi = sum(p.numel() for p in net.parameters())  # DeepSpeed's model_to_params: shared ones once
    largest_layer = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in net.modules())
    specs = param_specs(model, cfg.moe)
    assert all(s.shape[0] % world == 0 for s in specs), "the identity needs unpadded shards"
    assert phi % world == 0
    steps = ADAM_STEP_BYTES * len(specs)
    stage2 = rank_state_bytes(specs, Layout(world=world, ep=1, zero_stage=2), 0)
    stage3 = rank_state_bytes(specs, Layout(world=world, ep=1, zero_stage=3), 0)
    assert stage2.total - steps == _deepspeed_zero2_gpu_bytes(phi, world) - 4 * phi
    assert stage3.total - steps == _deepspeed_zero3_gpu_bytes(phi, largest_layer, world) - 4 * largest_layer \
        - 2 * phi // world
    # And the planner's own 16 bytes per parameter over N ranks.
    assert stage3.total - steps == 16 * phi // world
    assert math.isclose(_deepspeed_zero3_gpu_bytes(phi, largest_layer, world) / (stage3.total - steps),
                        18 / 16 + 4 * largest_layer * world / (16 * phi))
