"""Routing skew in the plan (``moetrain plan --skew SPEC`` or ``--routing-trace RUN_DIR``).

Under skewed routing the expert-parallel rank with the hottest experts receives more routed copies
than it sends: its expert activations, its all-to-all receive buffer and its expert GEMMs grow with
them, and every all-to-all waits for it. For the config's own layout (parallel.ep, zero stage,
checkpointing) this predicts what each rank receives, the hottest rank's memory and the step time,
dropless, under capacity factors, and with R spare expert slots per rank:

* **Load**: ``share_E``, each expert's fraction of the routed copies. From a spec (moe.force_skew's
  grammar): the weights of ``models.moe.skew``; each token takes top_k *distinct* experts (sampling
  without replacement caps a hot expert at 1/top_k of the copies), so the shares are those of the
  same sampler over ``SAMPLE_TOKENS`` tokens (fixed seed), not the weights; "drift" gives one vector
  per position of its hot expert. From a trace: one vector per recorded step and MoE layer.
* **Per rank**: a micro-batch routes ``G = T * K * dp`` copies over the world; expert e gets
  ``G * share_e`` and keeps ``min(that, capacity)`` (the dispatcher's ``expert_capacity`` over the dp
  group's tokens; dropless keeps all); its replicas split what it keeps evenly, each ep group's
  copy of it a 1/edp share. A rank receives the sum over its slots; the mean rank ``N = T * K``.
* **Spare slots** (``parallel.expert_slots_per_rank`` = E/ep + R, the replicas of issue 33 part 4,
  modelled here, not run): the R * ep spare slots go one at a time to the expert with the most
  copies per replica (at most ep replicas), then greedy longest-processing-time packing: replicas
  by load, largest first, each to the least-loaded rank with a free slot that does not hold that
  expert yet (ties to the lower rank). Each spare slot costs one expert's weights and gradients
  (``replica_slot_bytes``: a replica follows its home and keeps no optimizer state).
* **Memory**: ``plan.activations`` with the hottest rank's copies bounded by the mean + ``SIGMAS``
  standard deviations (a rank's copies of one micro-batch vary with a variance of at most their
  mean; never above its slots' capacity), the send and receive buffers beside, on top of the
  planner's model states for the layout plus the spare slots' states.
* **Step time** (with a device profile): the balanced dropless estimate of ``plan.step_time`` plus
  (f - 1) times the expert work (expert GEMMs, the expert rows' elementwise passes) and the
  all-to-all's bytes over the link (not its calls' latency), f = the hottest rank's copies / N
  averaged over the share vectors (each layer's all-to-all waits for its hottest rank). The extra
  expert work runs while the other ranks wait: on a CPU with more ranks than cores it gets their
  cores too (``DeviceProfile.core_share``).

Shape legend: E experts, P expert-parallel ranks, V share vectors (layers, steps or drift phases).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import torch

from moetrain.config.force_skew import parse_force_skew
from moetrain.config.job import JobConfig
from moetrain.config.parallel import check_rebalancing
from moetrain.models.moe.dispatcher import expert_capacity
from moetrain.models.moe.skew import skew_seed, skew_weights, skewed_assignment
from moetrain.plan.activations import estimate_activations
from moetrain.plan.model_states import Layout, param_specs, replica_slot_bytes, state_bytes_per_rank

SAMPLE_TOKENS = 1 << 16
"""Tokens drawn to measure a spec's shares (their standard error is below 0.2% of the copies)."""
SIGMAS = 3.0
"""Margin of the memory bound over the expected copies of the hottest rank, in standard deviations."""
CAPACITY_FACTORS = (1.0, 1.25, 1.5, 2.0)
SPARE_SLOTS = (1, 2)


def spec_shares(spec: str, *, num_experts: int, top_k: int) -> list[torch.Tensor]:
    """The share vectors ``[E]`` (summing to 1) of a moe.force_skew spec: one, or one per hot position
    of "drift"; "trace:PATH" reads the trace (``trace_shares``)."""
    kind, params = parse_force_skew(spec, num_experts=num_experts)
    if kind == "none":
        return [torch.full((num_experts,), 1.0 / num_experts, dtype=torch.float64)]
    if kind == "trace":
        return trace_shares(params[0])
    w_E = skew_weights(kind, params, step=1, num_experts=num_experts)
    idx_TK = skewed_assignment(w_E, num_tokens=SAMPLE_TOKENS, top_k=top_k, seed=skew_seed(0, 0))
    share_E = torch.bincount(idx_TK.reshape(-1), minlength=num_experts).double() / idx_TK.numel()
    if kind == "drift":  # the hot expert visits every id: skew_weights rolls the weights by one per period
        return [torch.roll(share_E, r) for r in range(num_experts)]
    return [share_E]


def trace_shares(path: str) -> list[torch.Tensor]:
    """One share vector per recorded step and MoE layer of a routing trace (counts or full)."""
    from moetrain.train.routing_trace import expert_loads

    _, _, load_SLE, _ = expert_loads(path)
    load_VE = load_SLE.reshape(-1, load_SLE.shape[-1])
    return [v / v.sum() for v in load_VE if v.sum() > 0]


def place_replicas(load_E: list[float], *, ep: int, slots_per_rank: int) -> list[list[int]]:
    """Experts held by each of the ``ep`` ranks (``slots_per_rank`` each): replicas of the hottest
    experts in the spare slots, packed by greedy longest-processing-time (module docstring). With no
    spare slot, the expert-parallel sharding's own order (rank p: ``p * E/ep .. (p + 1) * E/ep - 1``)."""
    E = len(load_E)
    if slots_per_rank * ep < E:
        raise ValueError(f"expert slots per rank ({slots_per_rank}) must be >= num_experts / ep ({E} / {ep})")
    if slots_per_rank * ep == E:
        return [list(range(p * slots_per_rank, (p + 1) * slots_per_rank)) for p in range(ep)]
    replicas = [1] * E
    for _ in range(slots_per_rank * ep - E):
        open_ = [e for e in range(E) if replicas[e] < ep]
        if not open_:
            break
        hottest = max(open_, key=lambda e: (load_E[e] / replicas[e], -e))
        replicas[hottest] += 1
    items = sorted(((load_E[e] / replicas[e], e) for e in range(E) for _ in range(replicas[e])),
                   key=lambda it: (-it[0], it[1]))
    held: list[list[int]] = [[] for _ in range(ep)]
    rank_load = [0.0] * ep
    for load, e in items:
        free = [p for p in range(ep) if len(held[p]) < slots_per_rank]
        # A second replica on a rank that holds one already only adds a slot's memory: avoided
        # unless the last free slots leave no other place.
        free = [p for p in free if e not in held[p]] or free
        p = min(free, key=lambda q: (rank_load[q], q))
        held[p].append(e)
        rank_load[p] += load
    return held


@dataclass(frozen=True)
class RankCopies:
    """Per ep rank, for one share vector and one setting: expected copies received per micro-batch,
    and the copies its slots can keep at most (None: dropless)."""

    expected: list[float]
    cap: list[float | None]
    kept_fraction: float


def rank_copies(share_E: torch.Tensor, *, copies: float, ep: int, edp: int, capacity: int | None,
                held: list[list[int]]) -> RankCopies:
    """``copies``: G, the routed copies of one micro-batch over the world; ``capacity``: copies one
    expert keeps of them (None = dropless); ``held``: each rank's experts (``place_replicas``)."""
    load_E = (share_E * copies).tolist()
    kept_E = [x if capacity is None else min(x, capacity) for x in load_E]
    replicas = [0] * len(load_E)
    for experts in held:
        for e in experts:
            replicas[e] += 1
    expected = [sum(kept_E[e] / replicas[e] for e in experts) / edp for experts in held]
    cap = [None if capacity is None else sum(capacity / replicas[e] for e in experts) / edp for experts in held]
    return RankCopies(expected=expected, cap=cap, kept_fraction=sum(kept_E) / copies)


def copies_bound(expected: float, cap: float | None) -> int:
    """The copies a rank's buffers are sized for: mean + SIGMAS standard deviations, at most its cap."""
    bound = expected + SIGMAS * math.sqrt(expected)
    return math.ceil(bound if cap is None else min(bound, cap))


@dataclass
class SkewRow:
    setting: str
    capacity_factor: float | None
    spare_slots: int
    copies_per_rank: list[float]
    """Expected routed copies each ep rank receives per micro-batch, in the worst share vector."""
    mean_copies: int
    """N = T * K: what each rank sends dropless (the balanced receive)."""
    max_over_mean: float
    """The hottest rank's expected copies / N, averaged over the share vectors."""
    bound_copies: int
    """The hottest rank's copies the memory estimate assumes (``copies_bound``)."""
    dropped_fraction: float
    activation_bytes: int
    """The hottest rank's activation peak (``plan.activations`` at ``bound_copies``)."""
    a2a_buffer_bytes: int
    slot_state_bytes: int
    """Weights and gradients of the spare slots' replicas (``replica_slot_bytes`` each)."""
    device_bytes: int
    fits: bool | None = None
    step_s: float | None = None
    step_ratio_vs_balanced: float | None = None
    placement: list[list[int]] = field(default_factory=list)
    activation_bytes_per_rank: list[int] = field(default_factory=list)
    """Each ep rank's activation peak, at its own bounded copies (worst share vector)."""


@dataclass
class SkewPlan:
    source: str
    world: int
    ep: int
    micro_batch_size: int
    grad_accum: int
    device_memory: int | None
    balanced_device_bytes: int
    balanced_step_s: float | None
    rows: list[SkewRow]
    vectors: int

    @property
    def recommendation(self) -> str:
        """Dropless if it fits, else the fewest spare slots that fit (nothing dropped), else the
        largest capacity factor that fits (the fewest drops)."""
        if self.device_memory is None:
            return "no --device-memory: nothing to fit (the rows give each setting's memory)"
        fit = [r for r in self.rows if r.fits]
        dropless = [r for r in fit if r.capacity_factor is None]
        if dropless:
            best = min(dropless, key=lambda r: r.spare_slots)
            if best.spare_slots == 0:
                return "dropless fits: no capacity factor or spare slot needed"
            return (f"parallel.expert_slots_per_rank = num_experts / ep + {best.spare_slots}: the fewest spare "
                    "slots that fit, dropless")
        if fit:
            best = max(fit, key=lambda r: r.capacity_factor or 0.0)
            return (f"moe.capacity_factor = {best.capacity_factor}: the largest listed factor that fits "
                    f"({best.dropped_fraction:.1%} of the copies dropped)")
        return "nothing listed fits: more ranks, activation checkpointing or a smaller micro-batch"

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "rows"}, "rows": [asdict(r) for r in self.rows],
                "recommendation": self.recommendation}


def _spare_slots(spare_slots, cfg: JobConfig, *, ep: int) -> tuple[int, ...]:
    """The spare-slot counts to plan: those given, each under the trainer's rules for expert
    rebalancing (``check_rebalancing``: num_experts / ep + spare <= num_experts, ep > 1, ZeRO 0/1,
    no 1-bit Adam, ...), or by default the ``SPARE_SLOTS`` that meet them (none at ep = 1)."""
    E = cfg.moe.num_experts
    home = E // ep

    def problem(r: int) -> str | None:
        if home + r > E:
            return (f"must be <= moe.num_experts - moe.num_experts / parallel.ep ({E - home}): "
                    f"parallel.expert_slots_per_rank = {home} + {r} must be <= moe.num_experts ({E}), a rank "
                    "holds each expert at most once")
        par = replace(cfg.parallel, ep=ep, expert_slots_per_rank=home + r)
        try:
            check_rebalancing(par, num_experts=E, rebalance_every=max(1, cfg.moe.rebalance_every), is_moe=True,
                              expert_choice=cfg.moe.is_expert_choice, grad_compression=cfg.dp.grad_compression)
        except ValueError as e:
            return f"this job cannot rebalance experts: {e}"
        return None

    if spare_slots is None:
        return tuple(r for r in SPARE_SLOTS if problem(r) is None)
    for r in spare_slots:
        why = problem(r)
        if why is not None:
            raise ValueError(f"--spare-slots ({r}) {why}")
    return tuple(spare_slots)


def make_skew_plan(cfg: JobConfig, *, nproc: int, nodes: int = 1, skew: str | None = None,
                   routing_trace: str | None = None, device_memory: int | None = None, profile=None,
                   capacity_factors=CAPACITY_FACTORS, spare_slots=None) -> SkewPlan:
    """The rows of the module docstring for ``cfg``'s layout on ``nproc`` ranks over ``nodes`` nodes
    under one skew source (``skew``: a moe.force_skew spec; ``routing_trace``: a run or trace folder)."""
    from moetrain.plan.planner import planned_micro_batch, resolve_vocab

    if (skew is None) == (routing_trace is None):
        raise ValueError("--skew and --routing-trace: give exactly one")
    if not isinstance(nodes, int) or nodes < 1 or nproc % nodes != 0:
        raise ValueError(f"--nodes ({nodes!r}) must be an int >= 1 that divides --nproc ({nproc})")
    per_node = nproc // nodes
    model, moe, ep = resolve_vocab(cfg), cfg.moe, cfg.parallel.ep
    if not model.is_moe or moe.is_expert_choice:
        raise ValueError("--skew / --routing-trace need a token-choice MoE model (model.moe_every > 0, moe.router "
                         "not 'expert_choice')")
    for name in ("tp", "pp", "etp"):
        if getattr(cfg.parallel, name) != 1:
            raise ValueError(f"parallel.{name} ({getattr(cfg.parallel, name)}) must be 1 for a skew plan: it plans "
                             "the dp x ep layouts")
    E, K = moe.num_experts, moe.top_k
    spare_slots = _spare_slots(spare_slots, cfg, ep=ep)
    flag, value = ("--skew", skew) if skew is not None else ("--routing-trace", routing_trace)
    try:
        vectors = spec_shares(skew, num_experts=E, top_k=K) if skew is not None else trace_shares(routing_trace or "")
    except ValueError as e:
        raise ValueError(f"{flag} ({value!r}): {e}") from e
    if not vectors:
        raise ValueError(f"{flag} ({value!r}) holds no complete step (every step lacks the file of some rank): "
                         "nothing to plan from")
    if any(v.numel() != E for v in vectors):
        raise ValueError(f"{flag} ({value!r}): the trace's experts ({vectors[0].numel()}) do not match "
                         f"moe.num_experts ({E})")
    micro, accum, _ = planned_micro_batch(cfg.train, nproc)
    t = cfg.train
    specs = param_specs(model, moe, finetune=cfg.finetune)
    row = _balanced_row(cfg, model, specs, nproc=nproc, micro=micro, accum=accum, per_node=per_node)
    layout = Layout.of_config(cfg, nproc)
    per_slot = replica_slot_bytes(specs)
    T, dp = micro * cfg.data.seq_len, nproc
    N = T * K
    settings = [("dropless", None, 0), *((f"capacity {c}", c, 0) for c in capacity_factors),
                *((f"dropless, {r} spare slot(s)", None, r) for r in spare_slots)]
    balanced = profile and _step_parts(cfg, model, specs, nproc=nproc, micro=micro, accum=accum, per_node=per_node,
                                       profile=profile)
    rows = []
    for label, factor, spare in settings:
        capacity = None if factor is None else expert_capacity(T * dp, num_experts=E, top_k=K, capacity_factor=factor)
        mean_load = torch.stack(vectors).mean(0).tolist()
        held = place_replicas(mean_load, ep=ep, slots_per_rank=E // ep + spare)
        per_vector = [rank_copies(v, copies=N * dp, ep=ep, edp=layout.edp, capacity=capacity, held=held)
                      for v in vectors]
        worst = max(per_vector, key=lambda rc: max(rc.expected))
        hot = max(range(ep), key=lambda p: worst.expected[p])
        bound = copies_bound(worst.expected[hot], worst.cap[hot])
        f_mean = sum(max(rc.expected) for rc in per_vector) / len(per_vector) / N
        def act_of(copies: int, factor=factor):
            return estimate_activations(model, replace(moe, capacity_factor=factor), micro_batch_size=micro,
                                        seq_len=cfg.data.seq_len, ep=ep, ac=t.activation_checkpointing,
                                        ac_every=t.activation_checkpointing_every, dtype=t.dtype, recv_copies=copies)

        act = act_of(bound)
        device = row.device_bytes - row.activation_bytes + act.peak_bytes + spare * per_slot
        r = SkewRow(setting=label, capacity_factor=factor, spare_slots=spare, copies_per_rank=worst.expected,
                    mean_copies=N, max_over_mean=f_mean, bound_copies=bound,
                    dropped_fraction=1 - sum(rc.kept_fraction for rc in per_vector) / len(per_vector),
                    activation_bytes=act.peak_bytes, a2a_buffer_bytes=act.a2a_buffer_bytes,
                    activation_bytes_per_rank=[act_of(copies_bound(c, cap)).peak_bytes
                                               for c, cap in zip(worst.expected, worst.cap, strict=True)],
                    slot_state_bytes=spare * per_slot, device_bytes=device,
                    fits=None if device_memory is None else device <= device_memory, placement=held)
        if balanced:
            r.step_s = balanced["step_s"] + (f_mean - 1) * (balanced["skewable_compute_s"] * profile.core_share
                                                            + balanced["all_to_all_s"])
            r.step_ratio_vs_balanced = r.step_s / balanced["step_s"]
        rows.append(r)
    return SkewPlan(source=skew if skew is not None else f"trace {routing_trace}", world=nproc, ep=ep,
                    micro_batch_size=micro, grad_accum=accum, device_memory=device_memory,
                    balanced_device_bytes=row.device_bytes, balanced_step_s=balanced["step_s"] if balanced else None,
                    rows=rows, vectors=len(vectors))


def _balanced_row(cfg: JobConfig, model, specs, *, nproc: int, micro: int, accum: int, per_node: int):
    """The planner's row (``PlanRow``) of the config's own layout under balanced routing, with
    ``per_node`` processes per node."""
    from moetrain.plan.planner import Choice, PlanRow, _fill, _invalid

    p = cfg.parallel
    choice = Choice(p.zero_stage, p.ep, "none", cfg.train.activation_checkpointing, p.hsdp_replicate)
    reason = _invalid(choice, model, cfg.moe, nproc, per_node=per_node, hierarchical=p.ep_hierarchical)
    if reason is not None:
        raise ValueError(f"the config's layout is invalid at --nproc {nproc} over {nproc // per_node} node(s): "
                         f"{reason}")
    row = PlanRow(choice=choice, valid=True)

    def states(layout: Layout) -> list:
        # The config's 1-bit residuals, and no replica bank: each row adds its own spare slots.
        return state_bytes_per_rank(specs, replace(layout, grad_compression=cfg.dp.grad_compression,
                                                   expert_slots_per_rank=0))

    _fill(row, specs, model, cfg, nproc=nproc, micro=micro, grad_accum=accum,
          compute_bytes=4 if cfg.train.dtype == "fp32" else 2, per_node=per_node, device_memory=None, states=states)
    return row


def _step_parts(cfg: JobConfig, model, specs, *, nproc: int, micro: int, accum: int, per_node: int,
                profile) -> dict[str, float]:
    """The balanced dropless step and its parts that scale with a rank's received copies: the expert
    GEMMs and the routed expert rows' elementwise passes, and the all-to-all's bytes over the link
    (seconds per step)."""
    from moetrain.plan.activations import moe_layers_recomputed
    from moetrain.plan.comm import comm_per_step
    from moetrain.plan.step_time import ELEMENTWISE_PASSES, estimate_step_time, step_work

    t, moe = cfg.train, replace(cfg.moe, capacity_factor=None)
    layout = Layout.of_config(cfg, nproc)
    est = estimate_step_time(specs, layout, model, moe, micro_batch_size=micro,
                             seq_len=cfg.data.seq_len, grad_accum=accum, profile=profile, dtype=t.dtype, tf32=t.tf32,
                             ac=t.activation_checkpointing, ac_every=t.activation_checkpointing_every,
                             procs_per_node=per_node, dispatch_chunks=moe.dispatch_chunks)
    work = step_work(model, moe, micro_batch_size=micro, seq_len=cfg.data.seq_len, grad_accum=accum, ep=layout.ep,
                     ac=t.activation_checkpointing, ac_every=t.activation_checkpointing_every, dtype=t.dtype)
    peak = profile.peak(t.dtype, tf32=t.tf32)
    expert_s = sum(work.expert_gemm_flops) / (peak * profile.expert_gemm_efficiency)
    b = 4 if t.dtype == "fp32" else 2
    N = micro * cfg.data.seq_len * moe.top_k
    hidden = (4 if moe.activation == "swiglu" else 2) * moe.expert_hidden_dim
    rows_bytes = N * (2 * model.dim + hidden) * b * len(model.moe_layer_ids)  # input, output, hidden rows
    elementwise_s = ELEMENTWISE_PASSES * rows_bytes * accum / profile.memory_bandwidth
    # The all-to-all's bytes grow with the hottest rank's copies; its calls' latency does not.
    vol = comm_per_step(specs, layout, model, moe, tokens_per_micro_batch=micro * cfg.data.seq_len,
                        grad_accum=accum, compute_bytes=b,
                        ac_moe_layers_recomputed=moe_layers_recomputed(model, t.activation_checkpointing,
                                                                       t.activation_checkpointing_every),
                        procs_per_node=per_node, seq_len=cfg.data.seq_len)
    # The ep group's link, as in estimate_step_time: inter-node when the group leaves the node.
    link = profile.inter_node if layout.ep > per_node or per_node % layout.ep != 0 else profile.intra_node
    return {"step_s": est.step_s, "skewable_compute_s": expert_s + elementwise_s,
            "all_to_all_s": link.seconds("all_to_all", vol.all_to_all, 0)}


def format_skew_plan(plan: SkewPlan) -> str:
    mib = 2**20
    lines = [f"routing skew {plan.source} ({plan.vectors} share vector(s)): world {plan.world}, ep {plan.ep}, "
             f"micro-batch {plan.micro_batch_size} x {plan.grad_accum}; per rank, the hottest ep rank's memory in MiB",
             f"balanced dropless: device {plan.balanced_device_bytes / mib:.2f} MiB"
             + (f", step {plan.balanced_step_s:.4f} s" if plan.balanced_step_s is not None else "")]
    lines.append(f"{'setting':28s} {'copies/rank (expected)':>30s} {'max/mean':>8s} {'bound':>7s} {'dropped':>7s} "
                 f"{'activ':>8s} {'a2a buf':>8s} {'slots':>8s} {'device':>8s} {'fits':>4s} {'step s':>8s} "
                 f"{'vs bal':>6s}")
    for r in plan.rows:
        copies = " ".join(f"{c:.0f}" for c in r.copies_per_rank)
        fits = "-" if r.fits is None else ("yes" if r.fits else "NO")
        step = (f"{r.step_s:8.4f} {r.step_ratio_vs_balanced:6.3f}" if r.step_s is not None
                and r.step_ratio_vs_balanced is not None else f"{'-':>8s} {'-':>6s}")
        lines.append(f"{r.setting:28s} {copies:>30s} {r.max_over_mean:8.3f} {r.bound_copies:7d} "
                     f"{r.dropped_fraction:7.1%} {r.activation_bytes / mib:8.2f} {r.a2a_buffer_bytes / mib:8.2f} "
                     f"{r.slot_state_bytes / mib:8.2f} {r.device_bytes / mib:8.2f} {fits:>4s} {step}")
    lines.append("recommendation: " + plan.recommendation)
    return "\n".join(lines)
