"""Config of the Mixture-of-Experts feed-forward layer."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moetrain.config._checks import require_bool, require_int
from moetrain.config.base import (
    require,
    require_active,
    require_choice,
    require_non_negative,
    require_positive,
)
from moetrain.config.force_skew import parse_force_skew


@dataclass
class MoEConfig:
    num_experts: int = 8
    """Number of routed experts E in each MoE layer."""

    top_k: int = 2
    """Experts each token is sent to (K). Must be <= num_experts."""

    expert_hidden_dim: int = 256
    """Hidden size F of each routed expert's FFN."""

    activation: str = "gelu"
    """Expert FFN type: "gelu" (two matrices) or "swiglu" (three, Llama/Mixtral style)."""

    capacity_factor: float | None = None
    """None = dropless. Otherwise each expert takes at most ceil(factor * T * K / E) token copies per
    forward; the rest are dropped (zero expert output, the residual carries the token)."""

    drop_policy: str = "position"
    """Which overflow copies are dropped in capacity mode: "position" keeps the earliest tokens,
    "score" keeps the copies with the highest router weight."""

    renormalize: bool = True
    """Rescale the K selected router weights of a token to sum to 1 (Mixtral). False keeps the raw
    softmax probabilities (Switch/GShard). Ignored for top_k=1: a weight fixed at 1.0 would leave
    the router without any gradient from the language-model loss."""

    routed_scaling_factor: float = 1.0
    """Multiplies every routed gate weight, after the optional renormalisation (DeepSeek-V3: 2.5,
    DeepSeek-V2: 16.0): out = shared(x) + factor * sum_k w_k * expert_k(x). It scales the routed
    output against the shared experts' and the residual stream; it changes no selection, no
    capacity drop (the "score" policy ranks by the scaled weights, in the same order) and no
    balance loss (those read the unscaled probabilities). 1.0 = off."""

    router_init_std: float = 0.02
    """Std of the normal init of the router weight. Small, so that routing starts near uniform."""

    num_shared_experts: int = 0
    """Always-on dense experts added to the routed output (DeepSeek/Qwen style). 0 = none."""

    shared_hidden_dim: int | None = None
    """Hidden size of the shared-expert FFN; None = num_shared_experts * expert_hidden_dim."""

    shared_expert_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(x @ w^T), w a [1, D] weight without
    bias (Qwen2-MoE's shared_expert_gate): out = routed + sigmoid(x w^T) * shared(x). The weight
    is the layer's ``shared_gate.weight``, drawn like the other dense weights (normal(model.init_std),
    as Qwen2-MoE draws it with its initializer_range). Computed with the shared experts while the
    routed rows are dispatched. Needs num_shared_experts > 0."""

    aux_loss_coef: float = 0.01
    """Coefficient of the Switch/GShard load-balancing loss E * sum_e f_e * P_e."""

    z_loss_coef: float = 0.001
    """Coefficient of the router z-loss mean(logsumexp(logits)^2) (ST-MoE)."""

    expert_impl: str = "grouped"
    """"grouped": all experts in one torch._grouped_mm (fast path). "loop": one matmul per expert
    (the test oracle; also the fallback where grouped_mm is unavailable)."""

    dispatch_dedup: bool = False
    """Under expert parallelism, send each token once to every rank that holds any of its experts
    (then copy it to those experts there, and sum their weighted outputs there before sending one
    row back), instead of once per routed copy. Cuts all-to-all bytes whenever a token's experts
    share a rank: always with group-limited routing whose groups are the ep ranks. Costs a small
    metadata exchange per copy: its gate weight (4 bytes) and its row index (8 bytes; 1-4 bytes with
    a compressed dispatch_dtype)."""

    dispatch_dtype: str = "none"
    """Wire format of the expert-parallel all-to-all (ep = 1 has no exchange: a no-op there).
    "none": token rows travel in the dtype the layer computes in (fp32, or the autocast dtype).
    "bf16": every token exchange, forward dispatch and combine and their backward, in bf16.
    "fp8_e4m3": the forward dispatch rows as float8 e4m3 with one fp32 scale (amax / 448) per
    128-element block of a row (one per row for D <= 128), dequantised on arrival: (D + 4 * ceil(D /
    128)) bytes per row instead of 4 * D, <= 0.27 of fp32 for D >= 64. The combine and every
    backward exchange travel in bf16: gradients do not survive e4m3 well (3 mantissa bits: on the
    backward payload of an MoE layer e4m3 loses 2.5% norm-wise, 15x bf16's 0.17%, an error that
    goes into every weight update; tests/unit/test_dispatch_quant.py measures it). The backward of
    the quantised dispatch is straight-through (the gradient of the dequantised rows goes back, in
    bf16). With bf16 or fp8_e4m3 the routing metadata (split counts, with dispatch_dedup the row
    indices, with the "score" drop policy the all-gathered expert ids) also travel in the smallest
    integer type holding them (int8/int16/int32); the gate weights stay fp32, like the router."""

    dispatch_chunks: int = 1
    """Pipeline depth of the expert-parallel all-to-all. C > 1 cuts this rank's kept token copies
    (after the capacity drops, decided over the whole batch) into C chunks of consecutive tokens
    and sends chunk c+1 while the experts compute chunk c, and chunk c's outputs home while they
    compute chunk c+1 (on a GPU the exchanges overlap the GEMMs; in backward the exchanges run
    in turn). All chunks' split counts travel in the one count exchange, C times as many counts
    (with a capacity factor, where the drops need none, C > 1 adds that exchange); the token
    bytes do not change. Outputs and gradients equal the unchunked path's up to the expert
    GEMMs, which see C times fewer rows (a GEMM may sum in another order for another row count:
    an fp32 rounding difference, see tests/distributed/test_dispatch_chunks.py). Each chunk pays
    the fixed latency of its exchanges and smaller GEMMs, so C pays off only when a chunk's
    exchange takes longer than that (benchmarks/overlap.py). 1 = one exchange each way. At ep = 1
    nothing travels: a no-op there. Independently of it, the shared experts always run while the
    dispatch is in flight."""

    # ----- routing strategy (docs/routing.md compares them) -----------------------------------------

    router: str = "softmax"
    """How tokens meet experts. "softmax": each token takes its top_k experts by softmax score
    (token choice). "sigmoid": token choice over independent sigmoid scores (DeepSeek-V3); the gate
    weights are the selected scores, divided by their sum when renormalize. "expert_choice": each
    expert takes its ceil(capacity_factor * T * K / E) best tokens by softmax score (Zhou et al.
    2022), so a token gets 0..E experts and load is balanced by construction; needs
    capacity_factor, ignores the load-balancing loss and drop_policy. Its selection looks at the
    whole batch, later positions included: fine for training, not for causal decoding."""

    router_bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3: 0.001). > 0 adds a per-expert bias to the scores
    a token-choice router *selects* with (the gate weights stay the unbiased scores). After each
    optimizer step's backward, the bias moves by this rate towards balance,
    b_e += rate * sign(mean_load - load_e) (then centred), from the step's routed-token counts
    summed over every micro-batch and every data- and expert-parallel rank. The update runs in the
    optimizer pre-step hook that ``moetrain.train.balancing.install_balancing`` installs. 0 = off."""

    expert_bias: bool = False
    """Give a token-choice router its per-expert selection bias (the fp32 buffer
    ``router.expert_bias``, DeepSeek-V3's e_score_correction_bias) even when
    router_bias_update_rate is 0: the bias then selects experts (gate weights stay the unbiased
    scores) and stays fixed, e.g. one imported from a checkpoint. Implied when
    router_bias_update_rate > 0. It starts at 0, is saved in checkpoints, and stays fp32 under
    module casts (``model.to(torch.bfloat16)``) and mixed precision."""

    router_jitter: float = 0.0
    """Multiplicative jitter on the router input in training (Switch Transformer):
    x * U(1 - eps, 1 + eps). 0 = off. Random per rank, so runs are not layout-invariant with it."""

    router_noise_std: float = 0.0
    """Std of Gaussian noise added to the router logits in training (noisy top-k). 0 = off.
    Random per rank, so runs are not layout-invariant with it."""

    force_balance: str = "none"
    """Benchmark switch: "round_robin" or "random" replaces the router's expert choice in training
    mode by a forced, balanced one, so throughput can be compared with the forced-balance figures
    other frameworks publish (Megatron's --moe-router-force-load-balancing, torchtitan's
    _debug_force_load_balance). "round_robin": routed copy n = t * top_k + j of a forward goes to
    expert n mod num_experts (each expert gets T * K / E copies, exact when E divides T * K);
    "random": each token draws top_k distinct experts uniformly from the global torch RNG (seeded
    from train.seed and the rank, and checkpointed, by the trainer: each rank draws its own
    assignment, balanced in expectation, so runs are not layout-invariant with it; nor is
    "round_robin" unless E divides each forward's T * K, as its pattern restarts at every
    forward). The router still runs: the gate weights are its scores at the forced experts
    (renormalised as usual), so the gate keeps its gradients, and the balance losses see its real
    probabilities. Evaluation and generation (eval mode) route by the router's own choice. Never a
    default; every metrics record says when it is on (``force_balance``). "none" = off.
    Token-choice routers only."""

    force_skew: str = "none"
    """Benchmark switch beside force_balance: a forced, skewed routing in training mode, the same for any layout
    (drawn per step and MoE layer over the global batch's tokens, from a generator seeded by the step and the
    layer: not from the run's RNG). "zipf:S": expert e is drawn with weight (e + 1)^-S (S > 0; 1.2 is heavily
    skewed); "hot:K:FRACTION": experts 0..K-1 share the weight FRACTION (in (0, 1)), the others the rest;
    "drift:S:PERIOD": zipf:S whose hottest expert moves up one id every PERIOD steps; "trace:PATH": the expert
    ids of a recorded full trace (as moe.routing_replay). Each token takes top_k distinct experts (weighted
    sampling without replacement, so a hot expert's share is capped at 1 / top_k of the copies). The gate
    weights are the router's scores at the forced experts, as with force_balance; every metrics record says
    when it is on (``force_skew``). Needs parallel.pp = 1. "none" = off. Token-choice only."""

    routing_replay: str | None = None
    """A run folder (or its routing_trace folder) recorded with log.routing_trace = "full": in training, each
    token goes to the expert ids recorded for it at the same step (R3 replay: the ids are fixed, the gate weights
    are the current router's scores at those ids, differentiable, and the balance losses see the replayed
    assignment). The trace must come from the same model geometry (MoE layer names, num_experts, top_k) and
    tokens per step, and cover every step to train; checked, shard headers included, before training starts.
    Any layout (dp, ep, tp) may replay a trace of any other; parallel.pp must be 1. Evaluation routes
    by the router's own choice. None = off. Token-choice routers only."""

    num_expert_groups: int = 1
    """Two-level (group-limited) routing: the E experts form this many groups of consecutive ids;
    a token first picks its top_groups groups (by group_score), then its top_k experts inside
    them. With num_expert_groups = parallel.ep each group is one rank's experts, so a token's
    copies go to at most top_groups ranks. Must divide num_experts. 1 = off. Token-choice
    routers only."""

    group_score: str = "top2_sum"
    """How two-level routing scores a group, over the selection scores (the scores plus the
    expert_bias, when there is one). "top2_sum": the sum of the group's two best (DeepSeek-V3's
    noaux_tc: a group with two good experts beats one with a single outlier; one score for
    one-expert groups). "max": the group's best score (DeepSeek-V2's group_limited_greedy over
    softmax scores). Acts only with num_expert_groups > 1."""

    top_groups: int = 1
    """Groups each token may use under two-level routing (<= num_expert_groups); top_groups *
    num_experts / num_expert_groups must be >= top_k."""

    aux_loss_type: str = "batch"
    """Granularity of the load-balancing loss E * sum_e f_e * P_e (f_e: the fraction of the routed
    copies that chose expert e, a constant; P_e: the mean router probability of e). "batch"
    (Switch/GShard; Megatron-LM's default): both per micro-batch, f_e over one micro-batch of every
    data- and tensor-parallel rank together (counts summed over them), P_e over this rank's tokens:
    the same gradient for any dp and tp, another one for another micro-batch count. "sequence": the
    same term per sequence, averaged over sequences (DeepSeek-V3's sequence-wise loss): it also
    penalises a sequence that uses few experts. "global_batch" (Qwen's global-batch balancing, Qiu
    et al. 2025): f_e over a whole optimizer step, every micro-batch of every dp and tp rank. A
    micro-batch's backward runs before the step's later micro-batches are routed, so f_e is the
    previous optimizer step's (kept by install_balancing's pre-step hook, which the trainer installs;
    uniform 1/E before the first step, which gives no gradient, the P_e summing to 1) and P_e is
    over each forward's tokens: the step's loss, the mean over micro-batches and ranks, is
    E * sum_e f_e(previous step) * P_e(this step), whose gradient is the same for any dp, tp, pp and
    micro-batch count; with padding (a classifier) only where the micro-batches hold equal numbers of
    real tokens, since each weighs the same in that mean. Training without install_balancing is refused. (Megatron-LM's
    global_aux_loss takes f_e as a running mean over the step's micro-batches so far instead:
    current, but dependent on the micro-batch count.)"""

    dynamic_capacity: bool = False
    """Recompute the capacity factor from the load history every balance_interval steps:
    factor = dynamic_capacity_base + dynamic_capacity_scale * sigmoid(std(load) - dynamic_capacity_shift),
    load_e = routed copies of expert e over the interval / their mean over experts (1.0 =
    balanced, so std(load) is the coefficient of variation; torch.std, unbiased). Needs
    capacity_factor (the value until the first update) and a token-choice router. The counts are
    summed over all ranks, so every rank computes the same factor."""

    dynamic_capacity_base: float = 1.0
    """b of factor = b + s * sigmoid(std(load) - c). The defaults b=1.0, s=0.5, c=1.0
    are the formula of a practitioner's blog post on distributed MoE training with PyTorch."""

    dynamic_capacity_scale: float = 0.5
    """s of factor = b + s * sigmoid(std(load) - c)."""

    dynamic_capacity_shift: float = 1.0
    """c of factor = b + s * sigmoid(std(load) - c)."""

    balance_interval: int = 10
    """Optimizer steps between updates of the dynamic capacity factor and the per-expert learning
    rate scales, and between checks of the routing-collapse alarm (each uses the load summed over
    the interval)."""

    expert_lr_scale_max: float = 1.0
    """Per-expert learning-rate compensation: an expert whose load over the last balance_interval
    steps is a fraction u of the mean gets its update scaled by min(expert_lr_scale_max, max(1, 1/u))
    (under-used experts learn faster, over-used ones keep the base rate). Applied exactly as a
    per-expert learning rate (see docs/routing.md). 1.0 = off."""

    collapse_threshold: float = 0.5
    """Routing-collapse alarm: warn (naming the layer and expert) when one expert was chosen by more
    than this fraction of a layer's tokens over a balance_interval window (50%: the share at which a
    blog post on DeepSpeed ZeRO-3 with MoE calls routing collapsed), at
    collapse_consecutive_checks checks in a row and after collapse_warmup_steps. Disabled, with a
    warning, when top_k / num_experts (every expert's fraction under perfectly balanced routing)
    is already >= it. 1.0 = never."""

    collapse_warmup_steps: int = 100
    """No collapse alarm (and so no collapse_aux_increase) at the checks of the first this many
    optimizer steps. A freshly initialised router often sends over half of a layer's tokens to one
    expert for the first few steps, before the aux loss or the selection bias has acted; that is
    initialisation, not collapse. The checks inside the warm-up still count for
    collapse_consecutive_checks, so a collapse that lasts from the start is reported at the first
    check after the warm-up. 0 = alarms from the first check on."""

    collapse_consecutive_checks: int = 3
    """Checks in a row (one every balance_interval steps) at which a layer's most chosen expert must
    be above collapse_threshold before the alarm fires (the expert may change between them); the
    alarm then repeats at every further check above it. With the default interval of 10 steps, 3 =
    a skew that lasted 30 steps. 1 = alarm at the first check above the threshold."""

    collapse_aux_increase: float = 0.0
    """On each collapse alarm, add this to the layer's aux_loss_coef (up to collapse_aux_max), under
    the same warm-up and persistence rule as the alarm. 0 = only warn."""

    collapse_aux_max: float = 0.1
    """Ceiling of the aux_loss_coef raised by collapse alarms."""

    rebalance_every: int = 0
    """Expert rebalancing: every this many optimizer steps, re-plan which hot experts the spare
    slots of each ep rank replicate (parallel.expert_slots_per_rank) from the load since the last
    plan (copies kept per expert), so that every rank serves about the same number of token
    copies. The math does not change (same routing, drops, losses and weights as without it;
    replicas are kept identical to their home expert). 0 = off. See docs/routing.md, "Expert
    rebalancing"."""

    unused_expert_steps: int = 100
    """Report an expert as unused (metric unused_experts) once it received no token for this many
    consecutive optimizer steps."""

    def __post_init__(self) -> None:
        require_int("moe.num_experts", self.num_experts, min_value=1)
        require_int("moe.top_k", self.top_k, min_value=1)
        require_int("moe.rebalance_every", self.rebalance_every, min_value=0)
        require(self.top_k <= self.num_experts, "moe.top_k", self.top_k,
                f"must be <= moe.num_experts ({self.num_experts})")
        require_int("moe.expert_hidden_dim", self.expert_hidden_dim, min_value=1)
        require_choice("moe.activation", self.activation, ("gelu", "swiglu"))
        if self.capacity_factor is not None:
            require_positive("moe.capacity_factor", self.capacity_factor)
            require(math.isfinite(self.capacity_factor), "moe.capacity_factor", self.capacity_factor,
                    "must be finite (use null for dropless)")
        require_choice("moe.drop_policy", self.drop_policy, ("position", "score"))
        require_active(self.drop_policy == "position" or self.capacity_factor is not None, "moe.drop_policy",
                       self.drop_policy, 'acts only with moe.capacity_factor set (it is null: dropless): leave it '
                       '"position"')
        require_positive("moe.router_init_std", self.router_init_std)
        require_int("moe.num_shared_experts", self.num_shared_experts, min_value=0)
        require_int("moe.shared_hidden_dim", self.shared_hidden_dim, min_value=1, none_ok=True)
        require_active(self.shared_hidden_dim is None or self.num_shared_experts > 0, "moe.shared_hidden_dim",
                       self.shared_hidden_dim, "acts only with moe.num_shared_experts > 0 (it is 0): leave it null")
        require_bool("moe.shared_expert_gate", self.shared_expert_gate)
        require(not self.shared_expert_gate or self.num_shared_experts > 0, "moe.shared_expert_gate",
                self.shared_expert_gate, "needs moe.num_shared_experts > 0 (it gates their output)")
        require_non_negative("moe.aux_loss_coef", self.aux_loss_coef)
        require_non_negative("moe.z_loss_coef", self.z_loss_coef)
        require_choice("moe.expert_impl", self.expert_impl, ("grouped", "loop"))
        require_bool("moe.dispatch_dedup", self.dispatch_dedup)
        require_choice("moe.dispatch_dtype", self.dispatch_dtype, ("none", "bf16", "fp8_e4m3"))
        require_int("moe.dispatch_chunks", self.dispatch_chunks, min_value=1)
        self._check_routing()

    def _check_routing(self) -> None:
        require_choice("moe.router", self.router, ("softmax", "sigmoid", "expert_choice"))
        expert_choice = self.router == "expert_choice"
        require(not expert_choice or self.capacity_factor is not None, "moe.capacity_factor",
                self.capacity_factor, 'must be set (tokens per expert = factor * T * K / E) when moe.router is '
                '"expert_choice"')
        require_non_negative("moe.router_bias_update_rate", self.router_bias_update_rate)
        require(not (expert_choice and self.router_bias_update_rate > 0), "moe.router_bias_update_rate",
                self.router_bias_update_rate, 'must be 0 with moe.router "expert_choice" (experts pick tokens; '
                'there is no token-choice selection to bias)')
        require_bool("moe.expert_bias", self.expert_bias)
        require(not (expert_choice and self.expert_bias), "moe.expert_bias", self.expert_bias,
                'must be false with moe.router "expert_choice" (experts pick tokens; there is no '
                'token-choice selection to bias)')
        factor = self.routed_scaling_factor
        require_positive("moe.routed_scaling_factor", factor)
        require(not (expert_choice and factor != 1), "moe.routed_scaling_factor", factor,
                'must be 1.0 with moe.router "expert_choice" (token-choice routers only)')
        require_non_negative("moe.router_jitter", self.router_jitter)
        require(self.router_jitter < 1, "moe.router_jitter", self.router_jitter,
                "must be < 1 (inputs are scaled by U(1 - eps, 1 + eps))")
        require_non_negative("moe.router_noise_std", self.router_noise_std)
        require_choice("moe.force_balance", self.force_balance, ("none", "round_robin", "random"))
        require(not (expert_choice and self.force_balance != "none"), "moe.force_balance", self.force_balance,
                'must be "none" with moe.router "expert_choice" (experts pick tokens; it is balanced by construction)')
        parse_force_skew(self.force_skew, num_experts=self.num_experts)
        require(self.force_skew == "none" or (not expert_choice and self.force_balance == "none"
                                              and self.routing_replay is None), "moe.force_skew", self.force_skew,
                'must be "none" with moe.router "expert_choice", moe.force_balance or moe.routing_replay (each '
                'replaces the routing)')
        require(self.routing_replay is None or (isinstance(self.routing_replay, str) and self.routing_replay != ""),
                "moe.routing_replay", self.routing_replay, "must be None or a non-empty path")
        require(self.routing_replay is None or not expert_choice, "moe.routing_replay", self.routing_replay,
                'must be None with moe.router "expert_choice" (token-choice routers only)')
        require(self.routing_replay is None or self.force_balance == "none", "moe.routing_replay",
                self.routing_replay, f'must be None with moe.force_balance ({self.force_balance!r}): both replace '
                'the routing')
        require_int("moe.num_expert_groups", self.num_expert_groups, min_value=1)
        require(self.num_experts % self.num_expert_groups == 0, "moe.num_expert_groups", self.num_expert_groups,
                f"must divide moe.num_experts ({self.num_experts})")
        require(not (expert_choice and self.num_expert_groups > 1), "moe.num_expert_groups",
                self.num_expert_groups, 'must be 1 with moe.router "expert_choice" (two-level routing is '
                'token choice)')
        require_choice("moe.group_score", self.group_score, ("top2_sum", "max"))
        require_active(self.group_score == "top2_sum" or self.num_expert_groups > 1, "moe.group_score",
                       self.group_score, 'acts only with moe.num_expert_groups > 1 (two-level routing); leave it '
                       '"top2_sum" otherwise')
        require_int("moe.top_groups", self.top_groups, min_value=1)
        require(self.top_groups <= self.num_expert_groups, "moe.top_groups", self.top_groups,
                f"must be <= moe.num_expert_groups ({self.num_expert_groups})")
        allowed = self.top_groups * (self.num_experts // self.num_expert_groups)
        require(self.top_k <= allowed, "moe.top_groups", self.top_groups,
                f"leaves {allowed} experts per token (top_groups * num_experts / num_expert_groups), fewer "
                f"than moe.top_k ({self.top_k})")
        require_choice("moe.aux_loss_type", self.aux_loss_type, ("batch", "sequence", "global_batch"))
        require(not expert_choice or self.aux_loss_type == "batch", "moe.aux_loss_type", self.aux_loss_type,
                'must be "batch" with moe.router "expert_choice" (its balance loss does not read it: the '
                "sequence and global-batch forms are for token-choice routers)")
        self._check_balancing(expert_choice)

    def _check_balancing(self, expert_choice: bool) -> None:
        require_bool("moe.dynamic_capacity", self.dynamic_capacity)
        if self.dynamic_capacity:
            require(self.capacity_factor is not None, "moe.capacity_factor", self.capacity_factor,
                    "must be set (the factor until the first update) when moe.dynamic_capacity is true")
            require(not expert_choice, "moe.dynamic_capacity", self.dynamic_capacity,
                    'must be false with moe.router "expert_choice" (its load is balanced by construction)')
        require_positive("moe.dynamic_capacity_base", self.dynamic_capacity_base)
        require_non_negative("moe.dynamic_capacity_scale", self.dynamic_capacity_scale)
        shift = self.dynamic_capacity_shift
        require(isinstance(shift, (int, float)) and not isinstance(shift, bool) and math.isfinite(shift),
                "moe.dynamic_capacity_shift", shift, "must be a finite number")
        for name in ("dynamic_capacity_base", "dynamic_capacity_scale", "dynamic_capacity_shift"):
            value, default = getattr(self, name), getattr(MoEConfig, name)
            require_active(self.dynamic_capacity or value == default, f"moe.{name}", value,
                           f"acts only with moe.dynamic_capacity true (it is false): leave it at {default}")
        require_int("moe.balance_interval", self.balance_interval, min_value=1)
        require(isinstance(self.expert_lr_scale_max, (int, float)) and not isinstance(self.expert_lr_scale_max, bool)
                and math.isfinite(self.expert_lr_scale_max) and self.expert_lr_scale_max >= 1,
                "moe.expert_lr_scale_max", self.expert_lr_scale_max, "must be a finite number >= 1 (1 = off)")
        require(isinstance(self.collapse_threshold, (int, float)) and not isinstance(self.collapse_threshold, bool)
                and 0 < self.collapse_threshold <= 1, "moe.collapse_threshold", self.collapse_threshold,
                "must be in (0, 1] (a fraction of the tokens; 1 = never)")
        require_int("moe.collapse_warmup_steps", self.collapse_warmup_steps, min_value=0)
        require_int("moe.collapse_consecutive_checks", self.collapse_consecutive_checks, min_value=1)
        require_non_negative("moe.collapse_aux_increase", self.collapse_aux_increase)
        require_non_negative("moe.collapse_aux_max", self.collapse_aux_max)
        require_int("moe.unused_expert_steps", self.unused_expert_steps, min_value=1)

    @property
    def is_expert_choice(self) -> bool:
        return self.router == "expert_choice"

    @property
    def has_expert_bias(self) -> bool:
        """Whether token-choice routers hold the selection bias ``router.expert_bias``."""
        return self.expert_bias or self.router_bias_update_rate > 0

    @property
    def resolved_shared_hidden_dim(self) -> int:
        if self.shared_hidden_dim is not None:
            return self.shared_hidden_dim
        return self.num_shared_experts * self.expert_hidden_dim
