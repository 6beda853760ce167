"""Parity harness for the routers and the between-step balancing: N gloo ranks under a parallel
layout against one plain process holding the global batch (ep_parity.py's reference), both with
``install_balancing`` on their optimizer.

On top of ep_parity's checks (outputs, losses, drops, every gradient, parameters after the last
step) it compares, after every step, the balancing state each rank holds with the reference's:
selection biases, dynamic capacity factors, per-expert learning-rate scales, aux-loss
coefficients, and the expert-health metrics of the whole run.

Shape legend: T tokens per rank, D model dim, S sequence length.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from moetrain.distributed import ParallelDims, collect_comm_stats, grad_norm, no_sync, parallelize
from moetrain.models.moe import MoELayer
from moetrain.train.balancing import install_balancing
from tests.distributed.workers.ep_parity import (
    Case,
    _grads,
    _micro_slices,
    _params,
    assert_rel_close,
    build_model,
    loss_fn,
    make_data,
)


@dataclass
class RoutingCase(Case):
    seq_len: int | None = None
    """Feed the model ``[T / S, S, D]`` instead of ``[T, D]`` (for the sequence-level aux loss)."""
    bias_std: float = 0.0
    """> 0: after building, each router's ``expert_bias`` (moe.expert_bias) is drawn from
    normal(0, bias_std) with a fixed seed, as an imported DeepSeek-V3 bias would be set."""


def build_routing_model(case: RoutingCase):
    """ep_parity's model, with the case's fixed selection bias: the same on every rank and in
    the reference."""
    model = build_model(case)
    if case.bias_std > 0:
        g = torch.Generator().manual_seed(2000 + case.seed)
        for layer in model.modules():
            if isinstance(layer, MoELayer):
                layer.router.expert_bias.normal_(0.0, case.bias_std, generator=g)
    return model


def _balance_state(model) -> dict:
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    state = {"capacity_factor": [float(layer.capacity_factor) if layer.capacity_factor is not None else None
                                 for layer in layers],
             "aux_loss_coef": [layer.aux_loss_coef for layer in layers]}
    if layers[0].router.expert_bias is not None:
        state["expert_bias"] = torch.stack([layer.router.expert_bias.clone() for layer in layers])
    if layers[0].config.expert_lr_scale_max > 1:
        state["expert_lr_scale"] = torch.stack([layer.expert_lr_scale.clone() for layer in layers])
    return state


def train_balanced(model, train_model, case: RoutingCase, x, target, slices, dims) -> dict:
    """ep_parity's loop (micro-batches, backward of loss / micro_batches, AdamW step) with the
    balancing hooks installed on the optimizer."""
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr, weight_decay=0.01)
    balancer = install_balancing(opt, model, dims)
    D = x.shape[-1]
    steps = []
    for s in range(case.steps):
        opt.zero_grad()
        rec = {"out": [], "loss": 0.0, "aux": 0.0, "dropped": [], "routed": [], "sends": []}
        for m, rows in enumerate(slices):
            final = m == len(slices) - 1
            x_in, t_in = x[s, rows], target[s, rows]
            if case.seq_len is not None:
                x_in, t_in = x_in.view(-1, case.seq_len, D), t_in.view(-1, case.seq_len, D)
            with contextlib.nullcontext() if final else no_sync(train_model):
                out, auxes = train_model(x_in)
                loss, aux = loss_fn(out, t_in, auxes)
                (loss / len(slices)).backward()
            rec["out"].append(out.detach().reshape(-1, D).clone())
            rec["loss"] += loss.item() / len(slices)
            rec["aux"] += aux.item() / len(slices)
            rec["dropped"].append([int(a.num_dropped) for a in auxes])
            rec["routed"].append([a.num_routed_per_expert.tolist() for a in auxes])
            rec["sends"].append([None if a.num_token_rank_sends is None else int(a.num_token_rank_sends)
                                 for a in auxes])
        rec["grads"] = _grads(model, dims)
        if dims is not None:
            rec["grad_norm"] = grad_norm(train_model).item()
            rec["comm"] = collect_comm_stats(train_model)
        else:
            rec["grad_norm"] = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().norm().item()
        opt.step()
        rec["balance"] = _balance_state(model)
        steps.append(rec)
    return {"steps": steps, "params": _params(model, dims), "metrics": balancer.metrics(),
            "alarms": balancer.total_alarms}


def run_reference(case: RoutingCase, world_size: int) -> dict:
    model = build_routing_model(case)
    x, target = make_data(case, world_size)
    n, T = case.micro_batches, case.tokens_per_rank
    slices = [torch.cat([torch.arange(r * T + m * (T // n), r * T + (m + 1) * (T // n)) for r in range(world_size)])
              for m in range(n)]
    return train_balanced(model, model, case, x, target, slices, None)


def routing_worker(rank: int, world_size: int, layouts: list[tuple[int, list[RoutingCase]]]) -> dict:
    results = {}
    for ep, cases in layouts:
        dims = ParallelDims(world_size=world_size, ep=ep, num_experts=8)
        dims.build_mesh()
        for case in cases:
            model = build_routing_model(case)
            train_model = parallelize(model, dims, activation_checkpointing=case.activation_checkpointing)
            x, target = make_data(case, world_size)
            results[f"ep{ep}/{case.name}"] = train_balanced(model, train_model, case, x, target,
                                                            _micro_slices(case, rank, world_size), dims)
    return results


def assert_balance_parity(case: RoutingCase, ranks: list[dict], ref: dict, *, ep: int) -> None:
    """Every rank holds the reference's balancing state after every step, and reports its
    expert-health metrics."""
    for s, ref_step in enumerate(ref["steps"]):
        want = ref_step["balance"]
        for r, rank in enumerate(ranks):
            got = rank["steps"][s]["balance"]
            at = f"[{case.name}, ep={ep}, step {s}, rank {r}]"
            assert got.keys() == want.keys(), at
            assert got["capacity_factor"] == want["capacity_factor"], f"{at} capacity factors"
            assert got["aux_loss_coef"] == want["aux_loss_coef"], f"{at} aux-loss coefficients"
            for key in ("expert_bias", "expert_lr_scale"):
                if key in want:
                    assert_rel_close(got[key], want[key], f"{at} {key}", rtol=1e-6)
    for r, rank in enumerate(ranks):
        assert rank["alarms"] == ref["alarms"], f"[{case.name}] rank {r} alarms"
        got, want = rank["metrics"], ref["metrics"]
        assert got.keys() == want.keys(), (case.name, r)
        for key, value in want.items():
            if key in ("routing_entropy", "expert_bias", "expert_lr_scale"):
                # Sums of floats in another order: equal to the rounding of the report.
                assert torch.allclose(torch.tensor(got[key], dtype=torch.float64),
                                      torch.tensor(value, dtype=torch.float64), atol=2e-5), (case.name, key)
            else:
                assert got[key] == value, (case.name, r, key, got[key], value)
