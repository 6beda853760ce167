"""Config of the parallel layout. Degrees only; ``moetrain.distributed.ParallelDims`` turns them into a
DeviceMesh and does every check that needs the world size."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config._checks import require_bool
from moetrain.config.base import require, require_choice, require_positive


@dataclass
class ParallelConfig:
    dp: int = -1
    """Data-parallel degree of the dense parameters. -1 = world / (tp * pp)."""

    ep: int = 1
    """Expert-parallel degree: each EP group of `ep` ranks (consecutive, or at stride `etp`)
    splits the experts among itself. Must divide dp * tp (the ranks of a pipeline stage, over which the MoE layers fold)
    and moe.num_experts (checked by ``ParallelDims``, with the
    world size: `moetrain train`, `moetrain config show --nproc N`)."""

    ep_hierarchical: bool = False
    """Node-aware expert all-to-all for ep groups that span nodes (DeepEP's layout): a token crosses
    the inter-node link at most once per destination node, to the rank with the same local index
    there, which forwards it inside the node to the ranks holding its experts (once per rank,
    whatever moe.dispatch_dedup says); the combine sums a node's partial outputs before the one row
    per token and node goes home. Cuts inter-node bytes whenever a token has several experts on
    one node (see ``moetrain plan``); adds intra-node hops. Needs each spanning ep group to be
    whole nodes (parallel.ep a multiple of the processes per node, checked by ``ParallelDims``).
    Where the ep group lies inside one node there is no inter-node traffic to save: the flat
    exchange runs, and the log says so."""

    tp: int = 1
    """Tensor-parallel degree of the dense part (attention heads, dense FFN hidden dim, embedding
    and LM-head vocabulary split over groups of `tp` consecutive ranks, norms sequence-parallel;
    the MoE layers take the sequence shard of their rank). Must divide the attention heads, the
    key/value heads and the dense hidden dim; keep it within a node. The tp ranks of one
    data-parallel index read the same batch."""

    pp: int = 1
    """Pipeline-parallel degree: stages of world / pp consecutive ranks (outermost in the rank
    order, so stages may span nodes)."""

    etp: int = 1
    """Expert tensor-parallel degree: groups of `etp` consecutive ranks (inside the ep layout) split
    every routed expert's hidden dim (w1/w3 column-wise, w2 row-wise). The group gathers its
    ranks' routed tokens before the all-to-all and reduce-scatters the partial outputs after it,
    so each rank computes 1/etp of the expert FLOPs of etp times the tokens and holds 1/etp of
    the expert weights. `ep * etp` must divide dp * tp; etp = tp puts the split on the tp ranks
    (Megatron-Core's expert tensor parallelism). Dropless routing only (moe.capacity_factor
    null), ZeRO stages 0/1."""

    pp_schedule: str = "1f1b"
    """Pipeline schedule at parallel.pp > 1 (``torch.distributed.pipelining``): "gpipe" (all
    forwards, then all backwards: every micro-batch's activations held at once), "1f1b" (one
    forward, one backward: at most pp micro-batches in flight on the first stage) or
    "interleaved_1f1b" (parallel.pp_virtual_stages stages per rank: a smaller bubble for more
    point-to-point messages). The micro-batches are the gradient-accumulation steps
    (train.global_batch_size / (train.micro_batch_size * data-parallel size)); see the bubble
    fraction and per-stage memory in ``moetrain plan``."""

    pp_virtual_stages: int = 1
    """Pipeline stages per rank: 1 for "gpipe" and "1f1b"; >= 2 for "interleaved_1f1b", where rank
    r holds stages r, r + pp, r + 2 pp, ... (model.num_layers must be at least pp * this)."""

    pp_split: str = "layers"
    """How the blocks are cut into pipeline stages (contiguous runs of blocks): "layers" (equal
    block counts, the first stages taking one more when they do not divide), "params" or "flops"
    (the cut that minimises the largest stage's parameters, or training FLOPs per token, counting
    the embedding on the first stage and the final norm and head on the last)."""

    zero_stage: int = 0
    """0 = replicated (DDP); 1 = optimizer states sharded over the data-parallel ranks (experts'
    over edp); 2 = gradients too (FSDP2, parameters kept gathered from forward to backward);
    3 = parameters too (FSDP2 ``fully_shard``). Check the cost first with ``moetrain plan``; do not
    use 3 when a lower stage fits (it gathers every block twice per step)."""

    hsdp_replicate: int = 1
    """Hybrid sharding at zero_stage 2/3: the dense parameters shard over groups of world /
    hsdp_replicate consecutive ranks (a node) and are replicated across the hsdp_replicate groups
    (an all-reduce of the shards crosses nodes instead of every all-gather). 1 = plain FSDP."""

    expert_slots_per_rank: int = 0
    """Expert slots on each ep rank with expert rebalancing (moe.rebalance_every > 0): its
    moe.num_experts / ep home experts plus spare slots, each holding a replica of a hot expert of
    another rank that takes a share of that expert's tokens (docs/routing.md, "Expert
    rebalancing"). Must be > num_experts / ep then (one spare slot per rank is usually enough)
    and <= num_experts;
    0 = no spare slots (rebalancing off). Each spare slot costs one expert's weights and gradient
    in memory and one expert's weights out and gradient back over ep per step."""

    backend: str = "auto"
    """torch.distributed backend: "auto" (nccl with CUDA, else gloo), "gloo" or "nccl"."""

    def __post_init__(self) -> None:
        require(self.dp == -1 or (isinstance(self.dp, int) and self.dp >= 1), "parallel.dp", self.dp,
                "must be -1 (auto) or >= 1")
        require_positive("parallel.ep", self.ep)
        require_bool("parallel.ep_hierarchical", self.ep_hierarchical)
        require(not self.ep_hierarchical or self.ep > 1, "parallel.ep_hierarchical", self.ep_hierarchical,
                f"needs parallel.ep > 1 (is {self.ep}): without expert parallelism nothing is exchanged")
        for name in ("tp", "pp", "etp"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, f"parallel.{name}", value,
                    "must be an int >= 1")
        require_choice("parallel.pp_schedule", self.pp_schedule, ("gpipe", "1f1b", "interleaved_1f1b"))
        require(isinstance(self.pp_virtual_stages, int) and not isinstance(self.pp_virtual_stages, bool)
                and self.pp_virtual_stages >= 1, "parallel.pp_virtual_stages", self.pp_virtual_stages,
                "must be an int >= 1")
        if self.pp_schedule == "interleaved_1f1b":
            require(self.pp_virtual_stages >= 2, "parallel.pp_virtual_stages", self.pp_virtual_stages,
                    "must be >= 2 with parallel.pp_schedule 'interleaved_1f1b' (stages per rank)")
        else:
            require(self.pp_virtual_stages == 1, "parallel.pp_virtual_stages", self.pp_virtual_stages,
                    f"must be 1 with parallel.pp_schedule {self.pp_schedule!r} (one stage per rank); "
                    "virtual stages need 'interleaved_1f1b'")
        require_choice("parallel.pp_split", self.pp_split, ("layers", "params", "flops"))
        require_choice("parallel.zero_stage", self.zero_stage, (0, 1, 2, 3))
        require(self.etp == 1 or self.zero_stage <= 1, "parallel.etp", self.etp,
                f"must be 1 with parallel.zero_stage {self.zero_stage}: FSDP2 does not shard experts split over "
                "two mesh axes (ep, etp); use ZeRO stage 0 or 1")
        require(isinstance(self.hsdp_replicate, int) and not isinstance(self.hsdp_replicate, bool)
                and self.hsdp_replicate >= 1, "parallel.hsdp_replicate", self.hsdp_replicate, "must be an int >= 1")
        require(self.hsdp_replicate == 1 or self.zero_stage >= 2, "parallel.hsdp_replicate", self.hsdp_replicate,
                f"needs parallel.zero_stage >= 2 (is {self.zero_stage}): stages 0/1 replicate the parameters anyway")
        require_choice("parallel.backend", self.backend, ("auto", "gloo", "nccl"))
        require(isinstance(self.expert_slots_per_rank, int) and not isinstance(self.expert_slots_per_rank, bool)
                and self.expert_slots_per_rank >= 0, "parallel.expert_slots_per_rank", self.expert_slots_per_rank,
                "must be an int >= 0")


def check_rebalancing(par: ParallelConfig, *, num_experts: int, rebalance_every: int, is_moe: bool,
                      expert_choice: bool, grad_compression: str) -> None:
    """The layouts expert rebalancing (parallel.expert_slots_per_rank, moe.rebalance_every) runs
    under; ValueError naming the field otherwise. A dense model ignores moe.rebalance_every."""
    slots = par.expert_slots_per_rank
    if slots == 0 and (rebalance_every == 0 or not is_moe):
        return
    require(is_moe, "parallel.expert_slots_per_rank", slots, "needs a model with MoE layers (this one has none)")
    require(slots > 0, "moe.rebalance_every", rebalance_every,
            "needs parallel.expert_slots_per_rank > moe.num_experts / parallel.ep (spare slots for the replicas)")
    require(rebalance_every > 0, "parallel.expert_slots_per_rank", slots,
            "needs moe.rebalance_every > 0: the spare slots hold replicas planned from the routed load")
    require(par.ep > 1, "parallel.expert_slots_per_rank", slots,
            f"needs parallel.ep > 1 (is {par.ep}): replicas share a hot expert's tokens across ep ranks")
    home = num_experts // par.ep
    require(slots > home, "parallel.expert_slots_per_rank", slots,
            f"must be > moe.num_experts / parallel.ep ({home} home experts per rank): the rest are spare slots")
    require(slots <= num_experts, "parallel.expert_slots_per_rank", slots,
            f"must be <= moe.num_experts ({num_experts}): a rank holds each expert at most once")
    require(grad_compression != "onebit", "dp.grad_compression", grad_compression,
            "must be 'none' or 'bf16' with expert rebalancing: replica gradients join their homes' before 1-bit "
            "Adam's per-rank compression, so the run would not be the one without replicas")
    unsupported = {"parallel.tp": (par.tp, 1), "parallel.etp": (par.etp, 1), "parallel.pp": (par.pp, 1),
                   "parallel.ep_hierarchical": (par.ep_hierarchical, False)}
    for name, (value, wanted) in unsupported.items():
        require(value == wanted, name, value, f"must be {wanted} with expert rebalancing (parallel."
                f"expert_slots_per_rank {slots}): replicas run on the flat all-to-all of one pipeline stage")
    require(par.zero_stage <= 1, "parallel.zero_stage", par.zero_stage,
            "must be 0 or 1 with expert rebalancing: FSDP2-sharded experts (ZeRO-2/3) have no whole home "
            "weight to copy into a replica")
    require(not expert_choice, "moe.rebalance_every", rebalance_every,
            "needs a token-choice router: expert choice is balanced by construction")
