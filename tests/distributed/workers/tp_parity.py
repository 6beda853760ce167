"""Tensor-parallel parity harness: the Transformer trained for a few AdamW steps on N gloo ranks at a
(tp, ep, ZeRO stage) layout, against one plain process holding the global batch.

The ranks of one dp index (tp consecutive ranks) read the same sequences: dp index d owns
sequences d*B:(d+1)*B of each global batch. Compared: the logits and every gradient of the first
step (gathered to full tensors), the loss and global gradient norm of every step, the norm of
chosen parameter groups alone (sequence-parallel norm weights, experts, routers: each counted
once), and every parameter after the last step.

Shape legend: B sequences per dp index, S sequence length.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.distributed import (
    ParallelDims,
    collect_comm_stats,
    global_grad_norm,
    no_sync,
    parallelize,
    wrap_optimizer,
)
from moetrain.distributed.data_parallel.grads import clip_global_grad_norm_
from moetrain.models.moe import MoELayer
from moetrain.models.transformer import Transformer
from moetrain.train.balancing import install_balancing
from moetrain.train.optim import build_optimizer

GLOBAL_BATCH = 4
NORM_GROUPS = {"norms": ("norm.weight",), "experts": ("experts.",), "routers": ("router.",)}
"""Parameter groups whose gradient norm is compared on its own: a copy counted twice shows here."""


@dataclass
class TpRun:
    name: str
    tp: int
    ep: int = 1
    etp: int = 1
    zero_stage: int = 0
    steps: int = 3
    micro_batches: int = 1
    seq_len: int = 8
    ac: str = "none"
    balancing: bool = False
    """Install the between-step balancing (``install_balancing``) on the optimizer, and record
    every MoE layer's selection bias after every step."""
    empty_experts: bool = False
    """Selection bias that sends every token to experts 0 and 1: at ep = 2 the second ep rank's
    experts (2 and 3) receive no tokens."""
    prev_step_routed: tuple[int, ...] | None = None
    """With ``moe.aux_loss_type="global_batch"``: the routed counts preset in every MoE layer's
    ``prev_step_routed_E``, so that the first step's f_e is this (as if a step before it had
    routed them) rather than uniform, which gives no balancing gradient."""
    model: dict = field(default_factory=dict)
    moe: dict = field(default_factory=dict)


def model_config(run: TpRun) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 64, "dim": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                          "max_seq_len": 16, "moe_every": 2, "tie_embeddings": True, **run.model})


class GroupCollectiveBytes(TorchDispatchMode):
    """Bytes this rank sends, as a ring moves them, in the functional all-gathers and reduce-scatters
    over one process group, forward and backward alike (autograd's collectives run under the mode)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group_name, self.sent = group.group_name, {"all_gather": 0, "reduce_scatter": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = str(func)
        if op.startswith("_c10d_functional.") and args[-1] == self.group_name:
            size, nbytes = args[-2], args[0].numel() * args[0].element_size()
            if "all_gather_into_tensor" in op:
                self.sent["all_gather"] += nbytes * (size - 1)
            elif "reduce_scatter_tensor" in op:
                self.sent["reduce_scatter"] += nbytes * (size - 1) // size
        return func(*args, **(kwargs or {}))


def build(run: TpRun) -> Transformer:
    """Two blocks (MoE with a shared expert, then dense), 4 query and 2 key/value heads, tied head."""
    model = model_config(run)
    moe = MoEConfig(**{"num_experts": 4, "top_k": 2, "expert_hidden_dim": 32, "num_shared_experts": 1,
                       "aux_loss_coef": 0.1, "z_loss_coef": 0.01, **run.moe})
    if run.empty_experts:
        moe = dataclasses.replace(moe, expert_bias=True)
    transformer = Transformer(model, moe=moe, seed=7)
    if run.empty_experts:
        with torch.no_grad():
            for layer in transformer.layers:
                if layer.is_moe:
                    layer.feed_forward.router.expert_bias.copy_(torch.tensor([100.0, 100.0, -100.0, -100.0]))
    if run.prev_step_routed is not None:
        for m in transformer.modules():
            if isinstance(m, MoELayer):
                m.prev_step_routed_E.copy_(torch.tensor(run.prev_step_routed))
    return transformer


def make_batches(run: TpRun) -> torch.Tensor:
    """Token ids ``[steps, GLOBAL_BATCH, S + 1]``: counting sequences with one random token in four."""
    g = torch.Generator().manual_seed(99)
    start = torch.randint(0, 64, (run.steps, GLOBAL_BATCH, 1), generator=g)
    tokens = (start + torch.arange(run.seq_len + 1)) % 64
    noise = torch.randint(0, 64, tokens.shape, generator=g)
    return torch.where(torch.rand(tokens.shape, generator=g) < 0.25, noise, tokens)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _group_norms(model) -> dict[str, float]:
    out = {}
    for group, keys in NORM_GROUPS.items():
        params = [p for n, p in model.named_parameters() if any(k in n for k in keys)]
        out[group] = global_grad_norm(params).item()
    return out


def _expert_bias(model) -> torch.Tensor | None:
    biases = [m.router.expert_bias for m in model.modules() if isinstance(m, MoELayer)]
    return None if biases[0] is None else torch.stack([b.detach().clone() for b in biases])


def _prev_step_routed(model) -> torch.Tensor | None:
    counts = [m.prev_step_routed_E.clone() for m in model.modules()
              if isinstance(m, MoELayer) and m.config.aux_loss_type == "global_batch"]
    return torch.stack(counts) if counts else None


def _train(run: TpRun, model, train_model, opt, batches: torch.Tensor, rows: slice,
           dims: ParallelDims | None = None) -> dict:
    n = run.micro_batches
    losses, norms, out = [], [], {"expert_bias": [], "prev_step_routed": [], "dropped": 0}
    if run.balancing:
        install_balancing(opt, model, dims)
    for s in range(run.steps):
        mine = batches[s][rows]
        loss_sum = 0.0
        for m in range(n):
            tokens = mine[m::n]
            ctx = no_sync(train_model) if m < n - 1 else contextlib.nullcontext()
            with ctx:
                o = train_model(tokens[:, :-1], tokens[:, 1:])
                (o.total_loss / n).backward()
            loss_sum += o.total_loss.item() / n
            out["dropped"] += sum(int(a.num_dropped) for a in o.moe_aux)
            if s == 0 and m == 0:
                out["logits"] = o.logits.detach().clone()
                out["aux"] = o.aux_loss.item()
                out["mtp"] = None if o.mtp_losses is None else o.mtp_losses.detach().clone()
                out["routed"] = [a.num_routed_per_expert.clone() for a in o.moe_aux]  # global counts
        if s == 0:
            out["grads"] = {k: _full(p.grad).detach().clone() for k, p in model.named_parameters()}
            out["group_norms"] = _group_norms(model)
        params = [p for p in model.parameters() if p.grad is not None]
        norms.append(clip_global_grad_norm_(params, 1.0).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss_sum)
        out["expert_bias"].append(_expert_bias(model))
        out["prev_step_routed"].append(_prev_step_routed(model))
    out.update(loss=losses, grad_norm=norms,
               params={k: _full(v).detach().clone() for k, v in model.named_parameters()})
    return out


def run_reference(run: TpRun) -> dict:
    model = build(run)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    return _train(run, model, model, opt, make_batches(run), slice(None))


def tp_worker(rank: int, world_size: int, runs: list[TpRun]) -> dict:
    out = {}
    for run in runs:
        dims = ParallelDims(world_size=world_size, tp=run.tp, ep=run.ep, etp=run.etp, num_experts=4)
        dims.build_mesh("cpu")
        model = build(run)
        train_model = parallelize(model, dims, zero_stage=run.zero_stage, activation_checkpointing=run.ac)
        opt = wrap_optimizer(build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8),
                             dims, zero_stage=run.zero_stage)
        B = GLOBAL_BATCH // dims.dp
        rows = slice(dims.dp_rank * B, (dims.dp_rank + 1) * B)
        w1 = next(m for m in model.modules() if isinstance(m, MoELayer)).experts.w1
        local_w1 = tuple(getattr(w1, "_local_tensor", w1).shape)
        res = _train(run, model, train_model, opt, make_batches(run), rows, dims)
        res["local_w1"] = local_w1
        res["etp_bytes"] = collect_comm_stats(model).etp_bytes
        if run.etp > 1:  # every all-gather and reduce-scatter over the etp group of a forward and backward
            tokens = make_batches(run)[0][rows]
            with GroupCollectiveBytes(dims.group("etp")) as counted, no_sync(train_model):
                train_model(tokens[:, :-1], tokens[:, 1:]).total_loss.backward()
            res["etp_group_sent"] = counted.sent
        # The loss and aux loss of the global batch: the means over dp of the dp indices' values.
        losses = torch.tensor(res["loss"] + [res["aux"]])
        dist.all_reduce(losses, group=dims.group("dp"))
        *res["loss"], res["aux"] = (losses / dims.dp).tolist()
        res["rows"] = (dims.dp_rank * B, (dims.dp_rank + 1) * B)
        if rank != 0:
            res["params"] = res["grads"] = None
        out[run.name] = res
        del model, train_model, opt
    return out
