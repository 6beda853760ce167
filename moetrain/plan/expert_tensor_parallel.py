"""Expert tensor-parallel choices for ``moetrain plan``: what ``parallel.etp`` saves in the routed
experts' model states and what it costs on the wire, per the layout of
``moetrain.distributed.expert_parallel.tensor_parallel`` (each expert's hidden dim split over ``etp``
consecutive ranks, the group's routed tokens gathered around the experts).

Memory. A rank holds E/ep experts and 1/etp of their hidden dim: the expert states divide by
ep * etp. Model states at ZeRO stage 0, as in the tensor-parallel table: fp32 parameter, gradient
and two AdamW moments, 16 bytes an element (etp allows stages 0 and 1 only).

Communication per MoE layer and micro-batch, the bytes one rank sends as a ring moves them, with
``T`` the rank's tokens, ``K`` = top_k, ``c`` the compute dtype's bytes, ``f = etp - 1``:

    forward   all-gather of the tokens (D * c), expert ids (int64) and gate weights (fp32):
              f * T * (D * c + 8 * K + 4 * K); reduce-scatter of the partial outputs: f * T * D * c
    backward  the reduce-scatter's backward all-gathers the output gradient (f * T * D * c); the
              all-gather's backward reduce-scatters the token and gate-weight gradients
              (f * T * (D * c + 4 * K)); expert ids carry no gradient
    recompute a checkpointed MoE layer repeats its forward
    all-to-all with ep > 1 every rank dispatches the etp * T gathered tokens: etp times the bytes of
              etp = 1 for the same local tokens (``comm``'s volume at etp * T tokens)

The forward volume is what ``CommStats.etp_bytes`` counts on a real run, sent plus received (twice
this). A classifier routes its real tokens only, so ``T = micro-batch * seq_len`` is its upper bound;
its per-layer exchange of token counts (8 bytes per rank) is too small to list. The byte formulas
live in ``comm``, whose ``comm_per_step`` counts them for any layout with etp > 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.plan.activations import moe_layers_recomputed
from moetrain.plan.comm import comm_per_step
from moetrain.plan.job_rules import LayoutRules
from moetrain.plan.model_states import Layout, ParamSpec
from moetrain.plan.tensor_parallel import choice_table

STATE_BYTES_PER_ELEMENT = 16
"""fp32 parameter + gradient + AdamW exp_avg + exp_avg_sq (ZeRO stage 0)."""


@dataclass(frozen=True)
class EtpChoice:
    etp: int
    ep: int
    valid: bool
    reason: str | None
    expert_state_bytes: int
    """Routed-expert model states on one rank: its E/ep experts' 1/etp share, stage 0."""
    other_state_bytes: int
    """Model states of everything else (not split by ep or etp), stage 0."""
    gather_bytes: int
    """Bytes this rank sends per optimizer step in etp's all-gathers (forward, backward, recompute)."""
    scatter_bytes: int
    """The same for etp's reduce-scatters."""
    all_to_all_bytes: int
    """Expert all-to-all bytes this rank sends per step at this (ep, etp) (0 at ep = 1)."""
    fits: bool | None = None
    """Whether expert + other states fit the device memory (None without one, or when invalid)."""
    spans_nodes: bool = False
    """The ep * etp block of ranks exceeds a node: the all-to-all crosses nodes."""

    @property
    def total_bytes(self) -> int:
        return self.gather_bytes + self.scatter_bytes + self.all_to_all_bytes


def etp_invalid(cfg: JobConfig, *, ep: int, etp: int, world: int, per_node: int,
                rules: LayoutRules | None = None) -> str | None:
    """Why (ep, etp) cannot train ``cfg`` on ``world`` processes (``ParallelDims``' rules, then the
    job config's through ``rules``, built here when not given), or None. The table is at ZeRO stage 0,
    which etp allows, whatever the config's ``parallel.zero_stage``."""
    try:
        ParallelDims(world_size=world, ep=ep, etp=etp, dp=world, num_experts=cfg.moe.num_experts,
                     ranks_per_node=per_node, ep_hierarchical=cfg.parallel.ep_hierarchical)
    except ValueError as e:
        return str(e)
    rules = rules or LayoutRules(cfg, world=world, per_node=per_node)
    return rules.etp_row(ep=ep, etp=etp)


def etp_choices(specs: list[ParamSpec], cfg: JobConfig, model: ModelConfig, *, world: int, per_node: int,
                tokens_per_micro_batch: int, grad_accum: int, compute_bytes: int,
                device_memory: int | None = None, rules: LayoutRules | None = None) -> list[EtpChoice]:
    """One ``EtpChoice`` per etp dividing the processes per node (its collectives stay in a node),
    etp = 1 first, at the config's ``parallel.ep``; none for a dense model. ``rules``: the job
    config's (``etp_invalid``)."""
    if not model.is_moe:
        return []
    ep, train = cfg.parallel.ep, cfg.train
    experts = sum(s.numel for s in specs if s.expert)
    other = sum(s.numel for s in specs if not s.expert)
    recomputed = moe_layers_recomputed(model, train.activation_checkpointing, train.activation_checkpointing_every)
    rules = rules or LayoutRules(cfg, world=world, per_node=per_node)
    out = []
    for etp in (e for e in range(1, per_node + 1) if per_node % e == 0):
        reason = etp_invalid(cfg, ep=ep, etp=etp, world=world, per_node=per_node, rules=rules)
        expert_bytes = -(-experts // (ep * etp)) * STATE_BYTES_PER_ELEMENT
        other_bytes = other * STATE_BYTES_PER_ELEMENT
        # At stage 0 the layout's all-gathers and reduce-scatters are etp's alone.
        vol = comm_per_step(specs, Layout(world=world, ep=ep, zero_stage=0, etp=etp), model, cfg.moe,
                            tokens_per_micro_batch=tokens_per_micro_batch, grad_accum=grad_accum,
                            compute_bytes=compute_bytes, ac_moe_layers_recomputed=recomputed, procs_per_node=per_node,
                            ep_hierarchical=cfg.parallel.ep_hierarchical, seq_len=cfg.data.seq_len)
        fits = None if device_memory is None or reason else expert_bytes + other_bytes <= device_memory
        out.append(EtpChoice(etp, ep, reason is None, reason, expert_bytes, other_bytes, vol.all_gather,
                             vol.reduce_scatter, vol.all_to_all, fits, per_node % (ep * etp) != 0))
    return out


def etp_advice(choices: list[EtpChoice]) -> str | None:
    """Recommend the smallest valid etp whose states fit when etp = 1 does not; None when etp = 1
    fits or no device memory was given."""
    if not choices or choices[0].fits is not False:
        return None
    fitting = [c for c in choices if c.valid and c.fits]
    if not fitting:
        return f"the stage-0 model states do not fit at ep={choices[0].ep} with any etp within a node"
    best = fitting[0]
    return (f"the stage-0 model states do not fit at ep={best.ep}, etp=1: parallel.etp={best.etp} splits each expert's "
            "hidden dim "
            f"({best.expert_state_bytes / 2**30:.2f} GiB of expert states per rank, {best.total_bytes / 2**30:.2f} GiB "
            "of etp and all-to-all traffic per step); a larger parallel.ep, where moe.num_experts allows, splits "
            "the experts without gathering tokens")


def format_etp(choices: list[EtpChoice]) -> list[str]:
    """Lines of the plan's expert tensor-parallel section."""
    gib, spans = 2**30, "  (ep x etp spans nodes: the all-to-all crosses them)"
    rows = [(c.etp, c.reason, [f"{b / gib:8.3f}" for b in (c.expert_state_bytes, c.other_state_bytes, c.gather_bytes,
                                                          c.scatter_bytes, c.all_to_all_bytes)],
             c.fits, spans if c.spans_nodes else "") for c in choices]
    return choice_table(f"expert tensor parallelism at ep={choices[0].ep}, tp = pp = 1 (each expert's hidden dim split "
                        "over etp; GiB: stage-0 states per rank, etp allows stages 0 and 1; traffic per step):",
                        ["etp", "experts", "other", "allgat", "redsc", "a2a"], rows, etp_advice(choices))
