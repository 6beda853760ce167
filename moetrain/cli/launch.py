"""What the job commands share: starting local processes through torch.distributed.run, the
world size a command knows, and the job config checked before any process starts."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

EXIT_CODES_ENV = "MOETRAIN_EXIT_CODES_DIR"
"""Where ``launch`` asks each rank to record the code it ends with: torchrun reports any rank
that exits non-zero as failed (1), which would hide a run every rank stopped on request."""


def under_launcher() -> bool:
    """Whether this process was started by torchrun (or ``launch``), as one rank of a job."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(nproc: int, argv: list[str]) -> int:
    """Re-run this command in ``nproc`` local processes through torch.distributed.run (what
    torchrun is), single node, with its own rendezvous on a free port. A SIGTERM sent to this
    process alone (a supervisor, ``kill PID``, PID 1 of a container) goes on to torchrun, which
    passes it to the ranks: they save and stop at the end of the step, and this returns 143."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "moetrain.cli", *strip_option(argv, "--nproc")]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    with tempfile.TemporaryDirectory(prefix="moetrain-exit-") as codes_dir:
        env[EXIT_CODES_ENV] = codes_dir
        child = subprocess.Popen(cmd, env=env)
        forwarded: list[int] = []

        def forward(signum, frame) -> None:
            forwarded.append(signum)
            child.send_signal(signum)

        previous = signal.signal(signal.SIGTERM, forward)
        try:
            code = child.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
        codes = [f.read_text().strip() for f in Path(codes_dir).glob("rank*")]
        every_rank_stopped = len(codes) == nproc and set(codes) == {"143"}
    # A SIGTERM to this process, or to one rank (the stop is agreed over the world, so every rank
    # saved and stopped): the run stopped on request, not on a failure.
    return 128 + signal.SIGTERM if forwarded or every_rank_stopped else code


def record_exit_code(code: int) -> None:
    """Leave this rank's exit code where ``launch`` reads it (nothing when not under ``launch``)."""
    codes_dir = os.environ.get(EXIT_CODES_ENV)
    if codes_dir and os.path.isdir(codes_dir):
        Path(codes_dir, f"rank{os.environ.get('RANK', '0')}").write_text(f"{code}\n")


def strip_option(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option`` and its value (``--opt V`` or ``--opt=V``)."""
    out, skip = [], False
    for a in argv:
        if skip or a.startswith(f"{option}="):
            skip = False
            continue
        skip = a == option
        if not skip:
            out.append(a)
    return out


def add_job_args(sp: argparse.ArgumentParser, *, default_config: str | None = None) -> None:
    """--config, --deepspeed, --nproc: what names a job and its process count."""
    from moetrain.config.loader import shipped_config_names

    sp.add_argument("--config", default=default_config,
                    help="YAML config (a run's config.yaml reproduces it) or a shipped config's name: "
                         + ", ".join(shipped_config_names()))
    sp.add_argument("--deepspeed", default=None,
                    help="import a DeepSpeed JSON config (explicit --section.field=value "
                         "overrides win over its values)")
    sp.add_argument("--nproc", type=int, default=None,
                    help="launch N local processes (torch.distributed.run); not needed under torchrun")


def world_size(args: argparse.Namespace, *, default: int | None) -> int | None:
    """Processes of the job when the command knows them: torchrun's WORLD_SIZE, else --nproc,
    else ``default``."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc ({args.nproc}) must be an int >= 1")
    return args.nproc or default


def load_job(args: argparse.Namespace, overrides: list[str], *, world: int | None, sample_tokens: int = 0):
    """The job config of ``args``, checked as far as the command knows the job, before any process
    starts: the corpus name always; at a known world size every rule of the layout
    (``ParallelDims``) and of the batch and pipeline schedule (``JobConfig.grad_accum_steps``);
    without one, the layout rules that hold at any world size."""
    from moetrain.config.loader import load_config

    deepspeed = args.deepspeed
    # A DeepSpeed config's batch sizes are per process: without a world size, one process.
    cfg = load_config(args.config, overrides, deepspeed=deepspeed, world_size=world or 1)
    # Imported once the config holds: they bring torch, which a refused config does not wait for.
    from moetrain.data.registry import check_corpus
    from moetrain.distributed.parallel_dims import ParallelDims

    check_corpus(cfg.data.corpus)
    par = cfg.parallel
    if sample_tokens and par.pp > 1:
        raise ValueError(f"--sample-tokens ({sample_tokens}) needs the whole model in each process, and "
                         f"parallel.pp ({par.pp}) splits it: sample after training with `moetrain generate`")
    num_experts = cfg.moe.num_experts if cfg.model.is_moe else None
    fixed = world is None and par.dp != -1
    if fixed:
        world = par.dp * par.tp * par.pp  # a fixed dp fixes the world: check every rule at it
    if world is None:
        if deepspeed is not None and par.ep > 1:
            raise ValueError(f"moe.ep_size ({par.ep}) of {deepspeed} needs a world of at least {par.ep} processes: "
                             "pass --nproc N, the number of processes of the job")
        # The rules that hold at any world size, checked at the smallest world the layout allows.
        ParallelDims(world_size=par.ep * par.etp * par.tp * par.pp, ep=par.ep, tp=par.tp, pp=par.pp, etp=par.etp,
                     num_experts=num_experts, ep_hierarchical=par.ep_hierarchical)
        return cfg
    try:
        ParallelDims.from_config(par, world_size=world, num_experts=num_experts)
        cfg.grad_accum_steps(world)
    except ValueError as e:
        told = "WORLD_SIZE" in os.environ or args.nproc
        where = (f"parallel.dp * tp * pp fixes the world at {world} processes" if fixed
                 else "this runs 1 process: pass --nproc N to launch N")
        raise ValueError(str(e) if told else f"{e} ({where})") from e
    return cfg


def check_model(cfg) -> None:
    """What only the built model tells, checked on the model built on the meta device (no memory,
    no weights: the modules every rank builds): LoRA targets that match nothing, and the shapes
    tensor parallelism cannot split (``check_tensor_parallel``). The vocabulary is model.vocab_size,
    else data.vocab_size; no rule here reads it."""
    import torch

    from moetrain.models.lora import apply_lora
    from moetrain.models.transformer import Transformer

    # data.vocab_size is a BPE's target, not the tokenizer's real size (a byte tokenizer has 256, an
    # export its own): the ranks check the vocabulary against the tokenizer they load.
    model_cfg = cfg.model if cfg.model.vocab_size is not None else cfg.model.with_vocab_size(cfg.data.vocab_size)
    with torch.device("meta"):
        model = Transformer(model_cfg, moe=cfg.moe if model_cfg.is_moe else None, seed=cfg.train.seed)
        apply_lora(model, cfg.finetune, seed=cfg.train.seed)
    if cfg.parallel.tp > 1:
        from moetrain.distributed.tensor_parallel import check_tensor_parallel

        check_tensor_parallel(model, cfg.parallel.tp)
