"""Expert rebalancing changes no number: on every rank, the same case trained twice from the same
seed on the same batches, once with the plain all-to-all dispatcher and once with replicas in
spare slots (``Rebalancer``, re-planned after every step so that the placement keeps moving),
must give the same loss, aux loss and drops at every step, and the same home expert weights,
gradients and optimizer state (ZeRO-1's shards included) after the last step; and every replica
must equal its home expert after every step. Layer 0 routes all its tokens to experts 0 and 1
(ep_parity's "first_experts"), so the replicas carry most of its tokens.

Shape legend: T tokens per rank, D model dim.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moetrain.distributed import ParallelDims, no_sync, parallelize
from moetrain.distributed.data_parallel.ddp import wrap_optimizer
from moetrain.distributed.data_parallel.finalize import finalize_grads
from moetrain.distributed.expert_parallel.rebalance import Rebalancer
from moetrain.distributed.expert_parallel.replicated import ReplicatedDispatcher
from moetrain.models.moe import MoELayer
from moetrain.utils.tensors import local_tensor
from tests.distributed.workers.ep_parity import (
    Case,
    _micro_slices,
    assert_rel_close,
    build_model,
    loss_fn,
    make_data,
)

RTOL = 1e-5


@dataclass
class RebalanceCase:
    name: str
    ep: int
    zero_stage: int
    slots_per_rank: int
    moe: dict = field(default_factory=dict)
    micro_batches: int = 1
    steps: int = 3
    lora: bool = False
    """Adapters on the routed experts (rank 2), base expert weights frozen."""
    skip_step: int | None = None
    """A step (0-based) whose update is skipped, as the trainer skips a non-finite one, in both runs."""

    def case(self) -> Case:
        return Case(self.name, moe=self.moe, tokens_per_rank=16, steps=self.steps, force="first_experts",
                    micro_batches=self.micro_batches)


def _train(rc: RebalanceCase, dims: ParallelDims, rank: int, world_size: int, *, rebalance: bool) -> dict:
    case = rc.case()
    model = build_model(case)
    if rc.lora:
        for layer in model.modules():
            if isinstance(layer, MoELayer):
                layer.experts.add_lora(rank=2, scale=1.0)
                for name in layer.experts.projection_names():
                    getattr(layer.experts, name).requires_grad_(False)
    train_model = parallelize(model, dims, zero_stage=rc.zero_stage)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = wrap_optimizer(torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01), dims,
                         zero_stage=rc.zero_stage)
    reb = Rebalancer(model, dims, slots_per_rank=rc.slots_per_rank, every=1 if rebalance else 0)
    x, target = make_data(case, world_size)
    slices = _micro_slices(case, rank, world_size)
    rec: dict = {"loss": [], "aux": [], "dropped": [], "replica_gap": [], "recv": [], "replanned": [],
                 "load_after": []}
    for s in range(case.steps):
        opt.zero_grad()
        loss_sum = aux_sum = 0.0
        dropped = []
        for m, rows in enumerate(slices):
            with contextlib.nullcontext() if m == len(slices) - 1 else no_sync(train_model):
                out_TD, auxes = train_model(x[s, rows])
                loss, aux = loss_fn(out_TD, target[s, rows], auxes)
                (loss / len(slices)).backward()
            loss_sum += loss.item() / len(slices)
            aux_sum += aux.item() / len(slices)
            dropped.append([int(a.num_dropped) for a in auxes])
        finalize_grads(train_model, dims)
        reb.sum_replica_grads()
        rec["grads"] = _expert_tensors(model, grads=True)
        taken = s != rc.skip_step
        if taken:
            opt.step()
        rec["recv"].append([d.recv_copies for _, d in reb.layers])
        before = [d.placement for _, d in reb.layers]
        reb.after_step(s + 1, taken=taken)
        rec["replanned"].append(any(d.placement is not p for (_, d), p in zip(reb.layers, before, strict=True)))
        rec["load_after"].append(sum(int(d.load_E.sum()) for _, d in reb.layers))
        rec["loss"].append(loss_sum)
        rec["aux"].append(aux_sum)
        rec["dropped"].append(dropped)
        reb.wait_refresh()  # the replicas as the next forward reads them
        rec["replica_gap"].append(_replica_gap(model))
    rec["params"] = _expert_tensors(model, grads=False)
    rec["state_shapes"] = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    rec["opt"] = _flat_state(opt.state_dict())
    return rec


def _expert_tensors(model, *, grads: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        if t is not None:
            out[name] = local_tensor(t).detach().clone()
    return out


def _replica_gap(model) -> float:
    """Largest |replica - home| over every replica of every layer (0.0 without replicas)."""
    gap = 0.0
    for layer in model.modules():
        if isinstance(layer, MoELayer) and isinstance(layer.dispatcher, ReplicatedDispatcher):
            d = layer.dispatcher
            for name, bank in d.bank.items():
                full = _gather_experts(local_tensor(getattr(layer.experts, name)).detach(), d.ep_group)
                for r, e in enumerate(d.placement.replicas[d.ep_rank]):
                    gap = max(gap, (bank[r] - full[e]).abs().max().item())
    return gap


def _gather_experts(local_LX: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(local_LX) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local_LX.contiguous(), group=group)
    return torch.cat(parts)


def _flat_state(state) -> list[torch.Tensor]:
    """Every tensor of an optimizer state dict, in its (deterministic) walk order."""
    if isinstance(state, torch.Tensor):
        return [local_tensor(state).detach().clone().reshape(-1).double()]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in _flat_state(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _flat_state(v)]
    return [torch.tensor([float(state)], dtype=torch.float64)] if isinstance(state, (int, float)) else []


def rebalance_worker(rank: int, world_size: int, cases: list[RebalanceCase]) -> dict:
    """Train each case with and without rebalancing and compare on this rank; returns per case the
    received copies per rank and layer of the last step, both ways, for the caller's load check."""
    out = {}
    for rc in cases:
        dims = ParallelDims(world_size=world_size, ep=rc.ep, num_experts=8)
        dims.build_mesh()
        plain = _train(rc, dims, rank, world_size, rebalance=False)
        rebal = _train(rc, dims, rank, world_size, rebalance=True)
        what = f"{rc.name} rank {rank}"
        for s in range(rc.steps):
            assert abs(rebal["loss"][s] - plain["loss"][s]) <= RTOL * abs(plain["loss"][s]), \
                f"{what} step {s + 1}: loss {rebal['loss'][s]} != {plain['loss'][s]}"
            assert abs(rebal["aux"][s] - plain["aux"][s]) <= RTOL * abs(plain["aux"][s]) + 1e-9, f"{what} aux"
            assert rebal["dropped"][s] == plain["dropped"][s], f"{what} step {s + 1}: drops differ"
            assert rebal["replica_gap"][s] == 0.0, f"{what} step {s + 1}: replica != home"
        for key in ("grads", "params"):
            for name, t in plain[key].items():
                assert_rel_close(rebal[key][name], t, f"{what} {key} {name}", rtol=RTOL)
        assert rebal["state_shapes"] == plain["state_shapes"], f"{what}: the model's state dict differs"
        assert len(rebal["opt"]) == len(plain["opt"]) > 0, f"{what}: optimizer state layout differs"
        for i, (a, b) in enumerate(zip(rebal["opt"], plain["opt"], strict=True)):
            assert_rel_close(a, b, f"{what} optimizer state tensor {i}", rtol=1e-4)
        if rc.skip_step is not None:
            # The skipped step's routing leaves no load behind, and its re-plan waits for the next step.
            skip = rc.skip_step
            assert rebal["replanned"] == [s != skip for s in range(rc.steps)], f"{what}: {rebal['replanned']}"
            assert rebal["load_after"][skip] == 0, f"{what}: the skipped step's load {rebal['load_after'][skip]}"
        out[rc.name] = {"recv": rebal["recv"], "dropped": plain["dropped"]}
    return out
