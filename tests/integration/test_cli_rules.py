"""Every rule that spans config sections, or the config and the world size, refuses a job before
any process starts: `moetrain train --nproc N` prints it once, as one line, with no traceback and
no torchrun, and writes nothing. The rules come from ``JobConfig`` (its own checks, the ``check_*``
functions of the sections it calls, and ``check_microbatches`` through ``grad_accum_steps``),
``ParallelDims`` at the requested world size, the command line itself (``--sample-tokens`` under
pp) and the model built on the meta device (tensor-parallel shapes, LoRA targets).

ParallelDims's node rules (ranks per node, hierarchical ep groups of whole nodes) read the
launcher's LOCAL_WORLD_SIZE: `--nproc N` starts one node of N, where they hold by construction.

Every case runs the command's ``main`` in this process, with the launcher replaced by one that
fails the test: an interpreter per case (~2.5 s with torch's import) would make these cases the
suite's largest group. A few cases, one per kind of rule, also run as the real command line (its
exit status and stderr)."""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moetrain.config import job

ROOT = Path(__file__).resolve().parents[2]

UNTIE = "--model.tie_embeddings=false"  # tiny ties its embeddings; these cases test other rules
CLASSIFIER = ("--model.head=classifier", "--model.num_classes=3", "--data.corpus=r8")

# (nproc, overrides on top of --config tiny (ep=2, 8 experts, global batch 16 of micro 8), the error)
RULES = {
    # JobConfig.__post_init__
    "dense-ep": (2, ["--model.moe_every=0"], "parallel.ep (2) must be 1 for a dense model"),
    "dense-etp": (2, ["--model.moe_every=0", "--parallel.ep=1", "--parallel.etp=2"],
                  "parallel.etp (2) must be 1 for a dense model"),
    # ParallelDims.from_config: HSDP's replicas (the ranks used to start, then fail on every rank)
    "hsdp-replicas": (2, ["--parallel.zero_stage=2", "--parallel.hsdp_replicate=4"],
                      "parallel.hsdp_replicate (4) must be an int >= 1 that divides parallel.dp (2)"),
    "nproc-zero": (0, [], "--nproc (0) must be an int >= 1"),
    "nccl-cpu": (2, ["--parallel.backend=nccl", "--train.device=cpu"],
                 "parallel.backend ('nccl') needs train.device \"cuda\" or \"auto\""),
    "etp-capacity": (2, ["--parallel.ep=1", "--parallel.etp=2", "--moe.capacity_factor=1.25"],
                     "moe.capacity_factor (1.25) must be null with parallel.etp (2) > 1"),
    "etp-hidden": (2, ["--parallel.ep=1", "--parallel.etp=2", "--moe.capacity_factor=null",
                       "--moe.expert_hidden_dim=255"],
                   "moe.expert_hidden_dim (255) must be a multiple of parallel.etp"),
    "seq-len": (2, ["--data.seq_len=512"], "data.seq_len (512) must be <= model.max_seq_len (256)"),
    "mtp-seq-len": (2, ["--data.seq_len=16", "--model.mtp_depth=16"],
                    "model.mtp_depth (16) must be < data.seq_len (16)"),
    "vocab": (2, ["--model.vocab_size=1000"], "model.vocab_size (1000) must be >= the tokenizer vocabulary (4096"),
    "seq-len-tp": (2, ["--parallel.ep=1", "--parallel.tp=2", "--data.seq_len=255"],
                   "data.seq_len (255) must be a multiple of parallel.tp (2)"),
    "trace-pp": (2, ["--log.routing_trace=full", "--parallel.ep=1", "--parallel.pp=2"],
                 "log.routing_trace ('full') needs parallel.pp = 1 and model.head = 'lm'"),
    "batch-dp": (3, ["--parallel.ep=1", "--parallel.dp=3"], "train.global_batch_size (16) must be divisible"),
    "offload-param": (2, ["--zero.offload_param=cpu", "--parallel.zero_stage=2"],
                      "zero.offload_param ('cpu') needs parallel.zero_stage = 3 (is 2)"),
    "offload-optimizer": (2, ["--zero.offload_optimizer=cpu"],
                          "zero.offload_optimizer ('cpu') needs parallel.zero_stage >= 1 (is 0)"),
    "compression-zero": (2, ["--dp.grad_compression=bf16", "--parallel.zero_stage=2"],
                         "dp.grad_compression ('bf16') needs parallel.zero_stage <= 1 (is 2)"),
    "onebit-zero": (2, ["--dp.grad_compression=onebit", "--parallel.zero_stage=1"],
                    "dp.grad_compression ('onebit') needs parallel.zero_stage = 0 (is 1)"),
    "compression-tp": (2, ["--dp.grad_compression=bf16", "--parallel.ep=1", "--parallel.tp=2"],
                       "dp.grad_compression ('bf16') needs parallel.tp = 1 (is 2)"),
    "classifier-sources": (2, ["--model.head=classifier", "--model.num_classes=3", "--data.corpus=path",
                               "--data.sources=[{path: corpus.txt}]"], "data.sources ('(set)') needs model.head"),
    "classifier-document-mask": (2, [*CLASSIFIER, "--data.document_mask=true"],
                                 "data.document_mask (True) needs model.head = \"lm\""),
    "lora-tp": (2, ["--parallel.ep=1", "--parallel.tp=2", "--finetune.lora_rank=4"],
                "parallel.tp (2) must be 1 with LoRA (finetune.lora_rank > 0)"),
    "lora-etp": (2, ["--finetune.lora_rank=4", "--finetune.lora_targets=[experts]", "--parallel.ep=1",
                     "--parallel.etp=2", "--moe.capacity_factor=null"],
                 "parallel.etp (2) must be 1 with LoRA on the routed experts"),
    "lora-expert-lr": (2, ["--finetune.lora_rank=4", "--finetune.lora_targets=[experts]",
                           "--moe.expert_lr_scale_max=2.0"], "moe.expert_lr_scale_max (2.0) must be 1.0 with LoRA"),
    # check_rebalancing (tiny: 8 experts at ep=2, so 4 home experts per rank)
    "rebalance-slots": (2, ["--moe.rebalance_every=5"],
                        "moe.rebalance_every (5) needs parallel.expert_slots_per_rank > moe.num_experts / parallel.ep"),
    "slots-rebalance": (2, ["--parallel.expert_slots_per_rank=5"],
                        "parallel.expert_slots_per_rank (5) needs moe.rebalance_every > 0"),
    "rebalance-zero": (2, ["--parallel.expert_slots_per_rank=5", "--moe.rebalance_every=5", "--parallel.zero_stage=2"],
                       "parallel.zero_stage (2) must be 0 or 1 with expert rebalancing"),
    "checkpointing-dense": (2, ["--model.moe_every=0", "--parallel.ep=1", "--train.activation_checkpointing=moe"],
                            "train.activation_checkpointing ('moe') cannot be \"moe\" for a dense model"),
    # check_pipeline_model, check_pipeline_reduction, check_microbatches (JobConfig.grad_accum_steps)
    "pp-classifier": (2, ["--parallel.pp=2", "--parallel.ep=1", UNTIE, *CLASSIFIER],
                      "model.head ('classifier') must be 'lm' with parallel.pp (2) > 1"),
    "pp-ngram": (2, ["--parallel.pp=2", "--parallel.ep=1", UNTIE, *CLASSIFIER, "--model.ngram_buckets=64"],
                 "model.ngram_buckets (64) must be 0 with parallel.pp (2) > 1"),
    "pp-stages": (2, ["--parallel.pp=2", "--parallel.ep=1", UNTIE, "--parallel.pp_schedule=interleaved_1f1b",
                      "--parallel.pp_virtual_stages=4"],
                  "parallel.pp * parallel.pp_virtual_stages (8) must be <= model.num_layers (4)"),
    "pp-compression": (2, ["--parallel.pp=2", "--parallel.ep=1", UNTIE, "--dp.grad_compression=bf16"],
                       "dp.grad_compression ('bf16') must be 'none' with parallel.pp (2) > 1"),
    "pp-offload": (2, ["--parallel.pp=2", "--parallel.ep=1", UNTIE, "--zero.offload_optimizer=cpu",
                       "--parallel.zero_stage=1"],
                   "zero.offload_optimizer ('cpu') needs parallel.zero_stage >= 2 with parallel.pp (2) > 1"),
    "pp-1f1b-micro-batches": (4, ["--parallel.pp=2", UNTIE],
                              "parallel.pp_schedule ('1f1b') needs at least parallel.pp (2) micro-batches"),
    "pp-interleaved-micro-batches": (4, ["--parallel.pp=2", "--parallel.ep=1", UNTIE,
                                         "--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_virtual_stages=2",
                                         "--train.global_batch_size=10", "--train.micro_batch_size=1"],
                                     "parallel.pp_schedule ('interleaved_1f1b') needs the micro-batches to be a "
                                     "multiple of"),
    "batch-world": (3, ["--parallel.ep=1"], "train.global_batch_size (16) must be divisible by"),
    # ParallelDims at the requested world size
    "tp-pp-world": (4, ["--parallel.pp=3", "--parallel.ep=1", UNTIE],
                    "parallel.tp (1) * parallel.pp (3) must divide the world size (4)"),
    "dp-world": (4, ["--parallel.dp=2", "--parallel.ep=1"],
                 "parallel.dp (2) * parallel.tp (1) * parallel.pp (1) must equal the world size (4)"),
    "ep-world": (3, [], "parallel.ep (2) must divide the world size (3)"),
    "ep-stage": (4, ["--parallel.pp=2", "--parallel.ep=4", UNTIE],
                 "parallel.ep (4) must divide parallel.dp * parallel.tp (2)"),
    "ep-hierarchical": (4, ["--parallel.ep_hierarchical=true", "--parallel.tp=2"],
                        "parallel.ep_hierarchical needs parallel.tp, pp and etp = 1 (are 2, 1, 1)"),
    "ep-experts": (4, ["--parallel.ep=4", "--moe.num_experts=6"], "parallel.ep (4) must divide moe.num_experts (6)"),
    # the command line
    "pp-sample": (2, ["--parallel.pp=2", "--parallel.ep=1", UNTIE, "--train.global_batch_size=32",
                      "--sample-tokens", "10"], "--sample-tokens (10) needs the whole model in each process"),
    # the model on the meta device
    "tp-heads": (2, ["--parallel.ep=1", "--parallel.tp=2", "--model.num_kv_heads=1"],
                 "parallel.tp (2) must divide model.num_heads (4) and the key/value heads (1)"),
    "tp-qk-norm": (2, ["--parallel.ep=1", "--parallel.tp=2", "--model.qk_norm=full"],
                   "model.qk_norm ('full') normalises across all heads"),
    "tp-classifier": (2, ["--parallel.ep=1", "--parallel.tp=2", *CLASSIFIER],
                      "model.head ('classifier') must be 'lm' with parallel.tp > 1"),
    "tp-ngram": (2, ["--parallel.ep=1", "--parallel.tp=2", *CLASSIFIER, "--model.ngram_buckets=64"],
                 "model.ngram_buckets (64) must be 0 with parallel.tp > 1"),
    "lora-target": (2, ["--finetune.lora_rank=4", "--finetune.lora_targets=[shared_experts]"],
                    "finetune.lora_targets (('shared_experts',)) names 'shared_experts'"),
}


def _assert_refused_once(code: int, stderr: str, message: str, run_dir: Path) -> None:
    assert code == 2, stderr
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("moetrain: error: ")]
    assert len(errors) == 1 and message in errors[0], stderr
    assert stderr.count(message) == 1, stderr  # once, not once per rank
    assert not run_dir.exists()


@pytest.mark.parametrize("nproc, overrides, message", RULES.values(), ids=RULES.keys())
def test_rule_refuses_once_before_launch(tmp_path, monkeypatch, capsys, nproc, overrides, message):
    from moetrain.cli import main
    from moetrain.cli import train as train_cli

    def no_launch(*_args, **_kwargs):
        raise AssertionError("the job was launched: the rule did not refuse it")

    monkeypatch.setattr(train_cli, "launch", no_launch)
    monkeypatch.chdir(tmp_path)  # relative paths in the overrides, as the command line's cwd
    run_dir = tmp_path / "run"
    code = main(["train", "--config", "tiny", "--nproc", str(nproc), *overrides, f"--log.run_dir={run_dir}"])
    _assert_refused_once(code, capsys.readouterr().err, message, run_dir)


@pytest.mark.parametrize("name", ["dense-ep", "tp-pp-world", "pp-sample", "tp-heads"])
def test_the_command_line_refuses_once_without_a_traceback(tmp_path, name):
    nproc, overrides, message = RULES[name]
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "moetrain.cli", "train", "--config", "tiny", "--nproc", str(nproc), *overrides,
           f"--log.run_dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    _assert_refused_once(r.returncode, r.stderr, message, run_dir)


def _required_fields(function) -> set[str]:
    """The fields named by ``function``'s ``require(ok, "field", value, rule)`` calls (literal fields)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {call.args[1].value for call in ast.walk(tree)
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "require" and len(call.args) > 1
            and isinstance(call.args[1], ast.Constant)}


def test_every_field_a_cross_section_rule_names_has_a_case():
    checks = job.JobConfig.__post_init__
    called = {call.func.id for call in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(checks))))
              if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id.startswith("check_")}
    assert {"check_pipeline_model", "check_pipeline_reduction"} <= called
    fields = _required_fields(checks)
    for name in called:
        fields |= _required_fields(getattr(job, name))
    assert len(fields) >= 15
    messages = " ".join(message for _, _, message in RULES.values())
    missing = sorted(f for f in fields if f"{f} (" not in messages)
    assert not missing, f"rules on these fields have no case in RULES: {missing}"


def test_a_fixed_dp_fixes_the_world_the_config_is_checked_at(capsys):
    from moetrain.cli import main

    # No --nproc: parallel.dp = 3 still means 3 processes, where ep = 2 cannot divide the world.
    assert main(["config", "show", "--config", "tiny", "--parallel.dp=3", "--train.global_batch_size=24"]) == 2
    assert ("parallel.ep (2) must divide the world size (3) (parallel.dp * tp * pp fixes the world at 3 processes)"
            in capsys.readouterr().err)
