"""``moetrain verify``: the job run at world 1 and at each layout, compared step by step, then
state by state, then through a reshard and an export (docs/verify.md).

    1. shrink the job (``shrink``) and write it to WORK/job.yaml
    2. reference: world 1, steps 1..S+1, a checkpoint after each
    3. each layout: its processes, steps 1..S+1, a checkpoint after each; then world 1 resumed from
       its checkpoint after S for step S+1 (the reshard)
    4. compare: every step's records; every tensor of the checkpoint after S; the resumed step and
       state; the Hugging Face export of the layout's checkpoint read back by the importer
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moetrain.config.convert import config_from_dict, config_to_dict
from moetrain.config.job import JobConfig
from moetrain.config.loader import save_config
from moetrain.config.model import ModelConfig
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.verify.checks import Comparison, Precision, Tolerance, counts_from_shares, routed_counts
from moetrain.verify.flips import FLIP_WHY, Flips, flipped_experts, loosened_rows
from moetrain.verify.groups import compare_hyperparameters
from moetrain.verify.init_export import PLACEHOLDER, cut_export
from moetrain.verify.launcher import Launcher
from moetrain.verify.layouts import Layout, auto_layouts, micro_batch_sizes
from moetrain.verify.runs import Run, RunFailed, export_digest, read_checkpoint, reference_run, train
from moetrain.verify.shrink import GRAD_ACCUM, Change, shrink_job, unshrunk_job


@dataclass
class Plan:
    cfg: JobConfig
    """The job as verified (shrunk or not)."""
    layouts: list[Layout]
    changes: list[Change]
    steps: int
    init_from: str | None = None
    """The job's checkpoint.init_from, cut to the shrunk model in the work folder before any run."""
    original_model: ModelConfig | None = None


def plan_verification(cfg: JobConfig, *, layouts: list[Layout] | None, steps: int, shrink: bool,
                      cpu: bool, nproc: int | None = None) -> Plan:
    """What will run: the layouts (``None``: ``auto_layouts`` for the job at ``nproc`` processes), the
    shrunk job and its changes."""
    if steps < 1:
        raise ValueError(f"--steps ({steps}) must be >= 1")
    chosen = layouts if layouts is not None else auto_layouts(cfg, nproc=nproc)
    if shrink:
        job, changes = shrink_job(cfg, pps=[lay.pp for lay in chosen], tps=[lay.tp for lay in chosen], cpu=cpu)
    else:
        job, changes = unshrunk_job(cfg)
    for lay in chosen:
        if lay.pp > 1 and job.model.num_layers % lay.pp:
            raise ValueError(f"model.num_layers ({job.model.num_layers}) must be a multiple of layout "
                             f"{lay.name}'s pp ({lay.pp})")
        if lay.ep > 1 and not job.model.is_moe:
            raise ValueError(f"layout {lay.name}: ep > 1 needs an MoE model (model.moe_every > 0)")
        # Every layout rule, before any process starts.
        par = replace(job.parallel, dp=lay.dp, ep=lay.ep, tp=lay.tp, pp=lay.pp, etp=lay.etp, zero_stage=lay.zero)
        try:
            ParallelDims.from_config(par, world_size=lay.world,
                                     num_experts=job.moe.num_experts if job.model.is_moe else None)
            layout_job(job, lay)
        except ValueError as e:
            raise ValueError(f"layout {lay.name}: {e}") from e
    if job.checkpoint.init_from == PLACEHOLDER:
        return Plan(job, chosen, changes, steps, init_from=cfg.checkpoint.init_from, original_model=cfg.model)
    return Plan(job, chosen, changes, steps)


def layout_job(job: JobConfig, lay: Layout) -> JobConfig:
    """The job as layout ``lay``'s runs load it (its degrees, micro-batch and offload overrides),
    validated by every JobConfig rule: a layout the trainer would refuse (data.seq_len not a multiple
    of tp, heads tp cannot split) is refused here, before the reference trains."""
    accum = GRAD_ACCUM if job.train.global_batch_size % GRAD_ACCUM == 0 else 1
    micro = micro_batch_sizes([lay], global_batch=job.train.global_batch_size, grad_accum=accum)[lay]
    raw = config_to_dict(job)
    for override in [*lay.overrides(micro_batch=micro), *offload_overrides(job, lay)]:
        name, _, value = override.removeprefix("--").partition("=")
        section, field = name.split(".")
        raw[section][field] = int(value) if value.isascii() and value.isdigit() else value
    return config_from_dict(raw)


def offload_overrides(job: JobConfig, lay: Layout) -> list[str]:
    """The job's ZeRO offload where the layout's stage allows it (config.zero.check_offload), else
    off: offload changes where a shard lives, not the math, and a layout (or world 1) at a lower
    stage than the job's still verifies the step."""
    z, out = job.zero, []
    if z.offload_param != "none" and lay.zero != 3:
        out.append("--zero.offload_param=none")
    if z.offload_optimizer != "none" and (lay.zero < 1 or (lay.pp > 1 and lay.zero < 2)):
        out.append("--zero.offload_optimizer=none")
    return out


CHECKS = ("steps", "reshard", "export")
"""What is compared after the layout's own steps (always): the resharded step, the export."""


@dataclass
class _Context:
    work: Path
    config: Path
    common: list[str]
    ref_overrides: list[str]
    ref_records: dict[int, dict]
    ref_state: dict[int, dict[str, torch.Tensor]]
    precision: Precision
    launcher: Launcher


def run_verification(plan: Plan, *, work: Path | None = None, say: Callable[[str], None] = print,
                     checks: tuple[str, ...] = CHECKS, launcher: Launcher | None = None) -> Comparison:
    """Run the reference and every layout of ``plan`` and compare them, step by step. ``checks``
    names the comparisons: without ``"steps"`` the layouts' runs are those an earlier verification
    of the same plan left in ``work`` (re-checking its reshard or export without training again).
    ``launcher``: the process server the runs are forked from (default: one started here)."""
    bad = sorted(set(checks) - set(CHECKS))
    if bad:
        raise ValueError(f"checks ({bad}) must be among {CHECKS}")
    if launcher is None:
        with Launcher() as own:
            return run_verification(plan, work=work, say=say, checks=checks, launcher=own)
    work = Path(work) if work is not None else Path(tempfile.mkdtemp(prefix="moetrain-verify-"))
    work.mkdir(parents=True, exist_ok=True)
    source = None
    if plan.init_from is not None:
        assert plan.original_model is not None
        source = export_digest(plan.init_from)
        cut = cut_export(plan.init_from, job=plan.cfg, original=plan.original_model, out_dir=work / "init_from")
        plan = replace(plan, cfg=replace(plan.cfg, checkpoint=replace(plan.cfg.checkpoint, init_from=str(cut))),
                       init_from=None)
    config = work / "job.yaml"
    save_config(plan.cfg, config)
    S = plan.steps
    accum = GRAD_ACCUM if plan.cfg.train.global_batch_size % GRAD_ACCUM == 0 else 1
    micro = micro_batch_sizes([Layout(), *plan.layouts], global_batch=plan.cfg.train.global_batch_size,
                              grad_accum=accum)
    # A checkpoint after every step: the state (router bias included) is compared step by step.
    common = [f"--train.steps={S + 1}", "--checkpoint.resume=auto", "--checkpoint.async_save=false",
              "--checkpoint.every=1", f"--checkpoint.keep_last={S + 1}"]
    ref_overrides = [*Layout().overrides(micro_batch=micro[Layout()]), *offload_overrides(plan.cfg, Layout()), *common]
    ref = reference_run(work, config, S, ref_overrides, say, launcher, source=source)
    ctx = _Context(work, config, common, ref_overrides, ref.records(),
                   {s: read_checkpoint(ref.checkpoint(s)) for s in range(1, S + 2)},
                   Precision(plan.cfg.train.dtype, plan.cfg.moe.dispatch_dtype if plan.cfg.model.is_moe else "none"),
                   launcher)
    out = Comparison()
    for i, lay in enumerate(plan.layouts):
        try:
            _verify_layout(out, plan, ctx, i, lay, micro[lay], checks, say)
        except RunFailed as e:  # a layout that cannot train the job fails its verification
            say(str(e))
            out.missing(f"[{lay.name}] training run", str(e).splitlines()[0], step=0)
    return out


def _verify_layout(out: Comparison, plan: Plan, ctx: _Context, i: int, lay: Layout, micro: int,
                   checks: tuple[str, ...], say: Callable[[str], None]) -> None:
    S, work, tag = plan.steps, ctx.work, f"[{lay.name}]"
    stale = ["-resumed", "-hf", "-hf-back"] + ([""] if "steps" in checks else [])
    for path in [work / f"layout{i}{suffix}" for suffix in stale]:
        shutil.rmtree(path, ignore_errors=True)  # a run folder left by an earlier verify would resume
    overrides = [*lay.overrides(micro_batch=micro), *offload_overrides(plan.cfg, lay), *ctx.common]
    if "steps" in checks:
        # S + 1 steps like the reference: the learning-rate schedule is a function of train.steps.
        say(f"layout {lay.name}: {lay.world} processes, {S + 1} steps")
        run = train(f"layout{i}", ctx.config, work, nproc=lay.world, overrides=overrides, launcher=ctx.launcher)
        records = run.records()
        for step in range(1, S + 2):
            compare_step(out, tag, records.get(step), ctx.ref_records.get(step), plan, ctx.precision, step=step)
            compare_state(out, tag, read_checkpoint(run.checkpoint(step)), ctx.ref_state[step], plan,
                          ctx.precision, step=step, flips=_flips(plan, ctx, records, step))
    else:
        run = Run(f"layout{i}", work / f"layout{i}", work / f"layout{i}.log")
        if not run.checkpoint(S).is_dir():
            raise RunFailed(f"layout {lay.name}: no run of an earlier verification in {run.run_dir} to re-check")
    if "reshard" in checks:
        say(f"layout {lay.name}: its step-{S} checkpoint resharded to world 1 for step {S + 1}")
        resumed = train(f"layout{i}-resumed", ctx.config, work, nproc=1,
                        overrides=[*ctx.ref_overrides, f"--checkpoint.resume={run.checkpoint(S)}"],
                        launcher=ctx.launcher)
        compare_step(out, f"{tag} resharded", resumed.records().get(S + 1), ctx.ref_records.get(S + 1), plan,
                     ctx.precision, step=S + 1)
        # The resumed state holds the layout's steps 1..S and world 1's own step S + 1.
        steps = {s: r for s, r in run.records().items() if s <= S} | {S + 1: resumed.records().get(S + 1, {})}
        compare_state(out, f"{tag} resharded", read_checkpoint(resumed.checkpoint(S + 1)), ctx.ref_state[S + 1],
                      plan, ctx.precision, step=S + 1, flips=_flips(plan, ctx, steps, S + 1))
    if "export" in checks:
        compare_export(out, tag, run.checkpoint(S), ctx.ref_state[S], work / f"layout{i}-hf", plan, ctx.precision,
                       step=S)


def _flips(plan: Plan, ctx: _Context, records: dict[int, dict], step: int) -> Flips | None:
    """The experts whose routed counts differ from world 1's at steps 1..``step``, where low
    precision lets routing flip (fp32 counts are exact: nothing is loosened)."""
    if not (ctx.precision.low_precision and plan.cfg.model.is_moe):
        return None
    routed_L = routed_counts(plan.cfg)["expert_share"]
    return flipped_experts(records, ctx.ref_records, routed_L=routed_L, up_to=step)


def _routing_tol(precision: Precision, routed_L: list[int]) -> tuple[Tolerance, torch.Tensor | None]:
    """The tolerance shown and the bound of each layer's counts (None: exact). Per layer, a share of
    that layer's own copies (bf16 1%, fp8 dispatch 15%: checks.MEASURED): near-ties flip in proportion
    to the copies a layer routes, and a depth-k multi-token layer routes fewer than a main one."""
    if not precision.low_precision:
        return Tolerance(0.0, 0.0, "integer counts from fp32 router scores: exact"), None
    share = precision.bound("routing")
    bound_L = (share * torch.tensor(routed_L, dtype=torch.float64)).clamp(min=2.0)
    return Tolerance(float(bound_L.max()), 0.0,
                     f"{share:.0%} of each layer's routed copies in the step may flip between near-tied experts "
                     "under low-precision rounding"), bound_L


def _scalar_tol(precision: Precision, key: str) -> Tolerance:
    if key == "lr":
        return Tolerance(0.0, 1e-12, "the schedule is a function of the step alone")
    if key == "grad_norm":
        return Tolerance(0.0, precision.bound("grad_norm"), "a sum of squares over every gradient, in another order")
    return Tolerance(0.0, precision.bound("aux" if key == "aux_loss" else "scalar"),
                     "the same sums over tokens and ranks in another order")


def compare_step(out: Comparison, tag: str, got: dict | None, want: dict | None, plan: Plan,
                 precision: Precision, *, step: int) -> None:
    """One step's records: the aux terms before the loss they join, the grad norm, the learning
    rate, then routing counts and drops (exact)."""
    if want is None:
        return
    if got is None:
        out.missing(f"{tag} loss", f"no record of step {step} at the layout", step=step)
        return
    mtp = sorted(k for k in want if re.fullmatch(r"mtp_loss_\d+", k))
    for key in ("aux_loss", *mtp, "loss", "grad_norm", "lr"):
        if key in want:
            value = got.get(key)
            if value is None:
                out.missing(f"{tag} {key}", f"not logged at the layout at step {step}", step=step)
            else:
                out.values(f"{tag} {key}", value, want[key], _scalar_tol(precision, key), step=step)
    if not plan.cfg.model.is_moe:
        return
    routed = routed_counts(plan.cfg)
    for key, quantity in (("expert_share", "tokens per expert"), ("dropped_fraction", "dropped tokens")):
        if key in want:
            if key not in got:
                out.missing(f"{tag} {quantity}", f"not logged at the layout at step {step}", step=step)
            else:
                _compare_counts(out, f"{tag} {quantity}", got[key], want[key], routed[key], precision, step=step)


def _compare_counts(out: Comparison, quantity: str, got: list, want: list, routed_L: list[int],
                    precision: Precision, *, step: int) -> None:
    """Per-layer shares ``[L]`` or ``[L, E]`` of the two runs compared as counts of each layer's
    ``routed_L`` (``routed_counts``)."""
    if not len(got) == len(want) == len(routed_L):
        out.missing(quantity, f"{len(got)} MoE layers logged at the layout, {len(want)} at world 1, "
                    f"{len(routed_L)} in the job", step=step)
        return
    tol, bound_L = _routing_tol(precision, routed_L)
    got_L, want_L = counts_from_shares(got, routed_L), counts_from_shares(want, routed_L)
    bounds = None if bound_L is None else bound_L.reshape(-1, *[1] * (want_L.dim() - 1)).expand_as(want_L)
    out.values(quantity, got_L, want_L, tol, step=step, abs_bounds=bounds)


STATE_GROUPS = (
    ("optimizer exp_avg", re.compile(r"^optim.*exp_avg$")),
    ("optimizer exp_avg_sq", re.compile(r"^optim.*exp_avg_sq$")),
    ("optimizer state", re.compile(r"^optim")),
    ("router bias", re.compile(r"^model\..*(expert_bias|router\.bias|selection_bias)")),
    ("parameters", re.compile(r"^model\.")),
    ("other state", re.compile(r".")),
)
"""Checkpoint entries by kind, first match wins; compared in this order (the moments before the
weights they move)."""


NOT_COMPARED = ("rng.", "optim.param_groups")
"""Checkpoint entries not compared as tensors: each rank's random generators (per rank by design),
and the optimizer's param groups, JSON text that differs by layout (a pipeline stage lists its own
parameters) and is compared parameter by parameter instead (``groups.compare_hyperparameters``)."""


def state_group(key: str) -> str:
    return next(name for name, pattern in STATE_GROUPS if pattern.search(key))


def _state_tol(group: str, plan: Plan, precision: Precision, steps: int) -> Tolerance:
    lr = plan.cfg.optim.lr
    if group == "router bias":
        if not precision.low_precision:
            return Tolerance(0.0, 0.0, "updated from integer routing counts: exact")
        rate = plan.cfg.moe.router_bias_update_rate
        return Tolerance(2 * rate * steps, 0.0, "a flipped routing choice can flip an expert's update sign: "
                         "at most 2 * rate per step")
    if group == "parameters":
        if precision.low_precision:
            return Tolerance(2 * lr * steps, 0.0, "a flipped routing choice changes an expert's gradient: "
                             "bounded by Adam's largest move, about lr per step each way")
        return Tolerance(0.02 * lr * steps, 0.0, "Adam moves a weight by about lr per step; fp32 rounding "
                         "changes that move only where the gradient is itself at rounding level, where the "
                         f"bound is 2 lr per step (gradient RMS under {NOISE_GRADIENT:g} x optim.eps)")
    if group.startswith("optimizer exp_avg"):
        return Tolerance(0.0, precision.bound("moments"), "relative to each tensor's largest entry: moments "
                         "of gradients summed in another order; a near-zero gradient's moment is its noise")
    return Tolerance(0.0, 0.0, "step counters and integer state: exact")


NOISE_GRADIENT = 100.0
"""In multiples of Adam's eps: a weight whose gradient RMS is below this is moved by
lr * m / (sqrt(v) + eps), about lr * g / eps, so a gradient differing by rounding (1e-10 on the
expert weights under tp, whose inputs were summed over the tp ranks in another order) moves it by
a few % of lr. Its bound is Adam's largest move, 2 lr per step; the moments still bound its gradient."""


def parameter_bounds(keys: list[str], want: dict[str, torch.Tensor], plan: Plan, tol: Tolerance,
                     step: int) -> torch.Tensor | None:
    """Per-element bounds of the parameters ``keys`` (``model.*``) at ``step``: ``tol.abs``, and 2 lr
    per step where world 1's Adam second moment (``want``) puts the gradient at rounding level.
    None when no element is loosened (or the optimizer keeps no second moment)."""
    if tol.abs >= 2 * plan.cfg.optim.lr * step:  # low precision: already Adam's largest move
        return None
    b2, eps = plan.cfg.optim.betas[1], plan.cfg.optim.eps
    parts, loosened = [], False
    for key in keys:
        bound = torch.full((want[key].numel(),), tol.abs, dtype=torch.float64)
        v = want.get(f"optim.state.{key.removeprefix('model.')}.exp_avg_sq")
        if v is not None and v.numel() == bound.numel():
            noise = (v.double().flatten() / (1 - b2 ** step)).sqrt() < NOISE_GRADIENT * eps
            bound[noise] = 2 * plan.cfg.optim.lr * step
            loosened = loosened or bool(noise.any())
        parts.append(bound)
    return torch.cat(parts) if loosened else None


def compare_state(out: Comparison, tag: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                  plan: Plan, precision: Precision, *, step: int, flips: Flips | None = None) -> None:
    """Every checkpoint tensor, grouped by kind (``STATE_GROUPS``), one row per kind. ``flips``: the
    experts whose counts differ from world 1's; their moment slices get ``flips.FLIPPED_SLICE_REL``."""
    groups: dict[str, list[str]] = {}
    for key in sorted(set(got) | set(want)):
        if key.startswith(NOT_COMPARED):
            continue
        groups.setdefault(state_group(key), []).append(key)
    compare_hyperparameters(out, tag, got, want, step=step)  # the update's settings before its results
    for group in [name for name, _ in STATE_GROUPS if name in groups]:
        keys = groups[group]
        quantity = f"{tag} {group}"
        absent = [k for k in keys if k not in got or k not in want]
        if absent:
            side = "layout" if absent[0] not in got else "world 1"
            more = f" (+{len(absent) - 1} more)" if len(absent) > 1 else ""
            out.missing(quantity, f"{absent[0]} missing at {side}{more}", step=step)
            continue
        tol = _state_tol(group, plan, precision, step)
        shapes_differ = next((k for k in keys if got[k].shape != want[k].shape), None)
        if shapes_differ:
            out.missing(quantity, f"{shapes_differ}: shape {tuple(got[shapes_differ].shape)} against "
                                  f"{tuple(want[shapes_differ].shape)}", step=step)
            continue
        if group.startswith("optimizer exp_avg"):
            rows = loosened_rows(keys, want, flips, num_experts=plan.cfg.moe.num_experts, rel=tol.rel)
            out.scaled(quantity, [(got[k], want[k]) for k in keys], tol, step=step, rows=rows, rows_why=FLIP_WHY)
            continue
        bounds = parameter_bounds(keys, want, plan, tol, step) if group == "parameters" else None
        out.values(quantity, torch.cat([got[k].double().flatten() for k in keys]),
                   torch.cat([want[k].double().flatten() for k in keys]), tol, step=step, abs_bounds=bounds)


def compare_export(out: Comparison, tag: str, checkpoint: Path, want: dict[str, torch.Tensor], hf_dir: Path,
                   plan: Plan, precision: Precision, *, step: int) -> None:
    """The layout's checkpoint exported to Hugging Face and read back by the importer: every weight
    equal to world 1's (export and import copy tensors; no arithmetic)."""
    from moetrain.interop.export import model_configs, open_source
    from moetrain.interop.hf import choose_family, export_hf, import_hf

    config, _, _ = open_source(checkpoint)
    model, moe = model_configs(config)
    try:
        family = choose_family(model, moe)
    except ValueError as e:
        out.note(f"{tag} HF export", f"no Hugging Face family expresses this job ({e})")
        return
    quantity = f"{tag} HF export ({family.model_type})"
    try:
        export_hf(checkpoint, hf_dir)
        import_hf(hf_dir, hf_dir.with_name(hf_dir.name + "-back"))
    except ValueError as e:
        out.missing(quantity, f"export/import refused: {str(e)[:200]}", step=step)
        return
    from safetensors.torch import load_file

    back: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.with_name(hf_dir.name + "-back").glob("*.safetensors")):
        back.update(load_file(str(f)))
    ref = {k.removeprefix("model."): v for k, v in want.items() if k.startswith("model.")}
    missing = sorted(set(ref) - set(back))
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        out.missing(quantity, f"{missing[0]} not in the export{more}", step=step)
        return
    keys = [f"model.{k}" for k in sorted(ref)]
    tol = _state_tol("parameters", plan, precision, step)
    out.values(quantity, torch.cat([back[k.removeprefix("model.")].double().flatten() for k in keys]),
               torch.cat([want[k].double().flatten() for k in keys]), tol, step=step,
               abs_bounds=model_bounds(keys, want, plan, precision, step))


def model_bounds(keys: list[str], want: dict[str, torch.Tensor], plan: Plan, precision: Precision,
                 step: int) -> torch.Tensor | None:
    """Per-element bounds of the model tensors ``keys`` (``model.*``) compared in one quantity (the
    HF export's round trip): each tensor at its own kind's bound (``state_group``), so a router's
    selection bias, which moves by its update rate rather than by lr, is held to the router-bias
    bound as in the checkpoint's rows. None when every element has the parameters' ``tol.abs``."""
    tol = _state_tol("parameters", plan, precision, step)
    bounds = parameter_bounds(keys, want, plan, tol, step)
    bias = {k for k in keys if state_group(k) == "router bias"}
    if not bias:
        return bounds
    if bounds is None:
        bounds = torch.cat([torch.full((want[k].numel(),), tol.abs, dtype=torch.float64) for k in keys])
    bias_abs, start = _state_tol("router bias", plan, precision, step).abs, 0
    for key in keys:
        n = want[key].numel()
        if key in bias:
            bounds[start:start + n] = bias_abs
        start += n
    return bounds
