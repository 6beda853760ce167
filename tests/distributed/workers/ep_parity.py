"""Parity harness: N ranks under a parallel layout against one plain process with the same global
batch and weights.

The reference (``run_reference``) builds the single-device model (``LocalDispatcher``, no process
group, no collectives) and trains it on the global batch, i.e. the ranks' batches concatenated in
rank order. The ranks (``parity_worker``) build the same model with the same seed, apply
``parallelize`` and train on their slices. ``assert_parity`` compares outputs, loss, aux loss and
every gradient (non-expert by name; expert shards reassembled by global expert index, separately
for each edp replica) at every step, and the parameters after the last optimizer step.

Shape legend: T tokens per rank, D model dim, W ranks.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from moetrain.config.moe import MoEConfig
from moetrain.distributed import (
    ParallelDims,
    clip_model_grad_norm_,
    collect_comm_stats,
    grad_norm,
    is_expert_shard,
    no_sync,
    parallelize,
)
from moetrain.distributed.data_parallel.ddp import unwrap
from moetrain.models.moe import MoELayer

RTOL = 1e-5


@dataclass
class Case:
    name: str
    moe: dict = field(default_factory=dict)
    """MoEConfig overrides (on top of E=8, K=2, F=32)."""
    dim: int = 16
    tokens_per_rank: int = 16
    steps: int = 3
    force: str | None = None
    """"first_experts": layer 0 routes every token to experts 0 and 1 (all on ep rank 0, so the
    other ep ranks receive nothing); "one_expert": layer 0 routes every token to expert 0 (K=1)."""
    micro_batches: int = 1
    activation_checkpointing: bool = False
    lr: float = 1e-2
    max_grad_norm: float | None = None
    """Clip the global gradient norm before each step (moetrain's clip vs torch's on one process)."""
    seed: int = 0

    def moe_config(self) -> MoEConfig:
        return MoEConfig(**{"num_experts": 8, "top_k": 2, "expert_hidden_dim": 32, **self.moe})


class TinyMoEModel(nn.Module):
    """Two residual MoE layers and a linear head: experts, routers and a plain dense parameter."""

    def __init__(self, dim: int, moe: MoEConfig, num_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoELayer(dim, moe) for _ in range(num_layers))
        self.head = nn.Linear(dim, dim, bias=False)

    def forward(self, x_TD: torch.Tensor):
        h_TD, auxes = x_TD, []
        for layer in self.layers:
            out_TD, aux = layer(h_TD)
            h_TD = h_TD + out_TD
            auxes.append(aux)
        return self.head(h_TD), auxes


def build_model(case: Case) -> TinyMoEModel:
    torch.manual_seed(case.seed)
    model = TinyMoEModel(case.dim, case.moe_config())
    if case.force is not None:
        # The data's feature 0 is 1.0 (see make_data), so these gate rows fix layer 0's logits.
        preferred = [0, 1] if case.force == "first_experts" else [0]
        with torch.no_grad():
            gate = model.layers[0].router.gate.weight
            gate.zero_()
            gate[preferred, 0] = 10.0
    return model


def make_data(case: Case, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of every step, ``[steps, W*T, D]`` each, rank r owning rows r*T:(r+1)*T."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    shape = (case.steps, world_size * case.tokens_per_rank, case.dim)
    x = torch.randn(shape, generator=g)
    if case.force is not None:
        x[..., 0] = 1.0
    return x, torch.randn(shape, generator=g)


def loss_fn(out_TD: torch.Tensor, target_TD: torch.Tensor, auxes) -> tuple[torch.Tensor, torch.Tensor]:
    aux = sum(a.loss for a in auxes)
    return (out_TD - target_TD).square().mean() + aux, aux


def _micro_slices(case: Case, rank: int, world_size: int) -> list[slice]:
    """Rows of the global step batch that this rank trains on, one slice per micro-batch.
    Micro-batch m of the reference is the concatenation of every rank's m-th slice."""
    T, n = case.tokens_per_rank, case.micro_batches
    Tm = T // n
    return [slice(rank * T + m * Tm, rank * T + (m + 1) * Tm) for m in range(n)]


def _grads(model: nn.Module, dims: ParallelDims | None) -> dict:
    """name -> (global expert offset or None, local gradient)."""
    out = {}
    for name, p in unwrap(model).named_parameters():
        if is_expert_shard(p):
            local = p.grad.to_local()
            out[name] = (dims.ep_rank * local.shape[0], local.detach().clone())
        else:
            out[name] = (None, p.grad.detach().clone())
    return out


def _params(model: nn.Module, dims: ParallelDims | None) -> dict:
    out = {}
    for name, p in unwrap(model).named_parameters():
        if is_expert_shard(p):
            local = p.to_local()
            out[name] = (dims.ep_rank * local.shape[0], local.detach().clone())
        else:
            out[name] = (None, p.detach().clone())
    return out


def _train(model, train_model, case: Case, x, target, slices, dims) -> dict:
    """The loop both sides run: micro-batches, backward of loss / micro_batches, optimizer step."""
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr, weight_decay=0.01)
    steps = []
    for s in range(case.steps):
        opt.zero_grad()
        rec = {"out": [], "loss": 0.0, "aux": 0.0, "dropped": [], "routed": []}
        for m, rows in enumerate(slices):
            final = m == len(slices) - 1
            ctx = contextlib.nullcontext() if final else no_sync(train_model)
            with ctx:
                out_TD, auxes = train_model(x[s, rows])
                loss, aux = loss_fn(out_TD, target[s, rows], auxes)
                (loss / len(slices)).backward()
            rec["out"].append(out_TD.detach().clone())
            rec["loss"] += loss.item() / len(slices)
            rec["aux"] += aux.item() / len(slices)
            rec["dropped"].append([int(a.num_dropped) for a in auxes])
            rec["routed"].append([a.num_routed_per_expert.tolist() for a in auxes])
        rec["grads"] = _grads(model, dims)
        if dims is not None:
            rec["grad_norm"] = grad_norm(train_model).item()
            rec["comm"] = collect_comm_stats(train_model)
            if case.max_grad_norm is not None:
                clip_model_grad_norm_(train_model, case.max_grad_norm)
        else:
            rec["grad_norm"] = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().norm().item()
            if case.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), case.max_grad_norm)
        steps.append(rec)
        opt.step()
    return {"steps": steps, "params": _params(model, dims)}


def run_reference(case: Case, world_size: int) -> dict:
    """One plain process, the global batch, no process group."""
    model = build_model(case)
    x, target = make_data(case, world_size)
    n, T = case.micro_batches, case.tokens_per_rank
    slices = [torch.cat([torch.arange(r * T + m * (T // n), r * T + (m + 1) * (T // n)) for r in range(world_size)])
              for m in range(n)]
    return _train(model, model, case, x, target, slices, None)


def _count_dispatches(model: nn.Module) -> list[int]:
    """Spy on the dispatchers: shows that activation checkpointing really recomputes the layer
    (all-to-all included) in backward. The returned list fills in as the model runs."""
    calls = [0]
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            inner = layer.dispatcher.run_experts

            def run_experts(*args, _inner=inner, **kwargs):
                calls[0] += 1
                return _inner(*args, **kwargs)

            layer.dispatcher.run_experts = run_experts
    return calls


def parity_worker(rank: int, world_size: int, layouts: list[tuple[int, list[Case]]],
                  checkpoint: tuple[str, str] | None = None) -> dict:
    """Runs on every rank: for each (ep, cases) layout, build the mesh and train every case.
    ``checkpoint=(case name, directory)`` saves that case's final model with DCP."""
    results = {}
    for ep, cases in layouts:
        dims = ParallelDims(world_size=world_size, ep=ep, num_experts=8)
        dims.build_mesh()
        results[f"ep{ep}/groups"] = {
            "ep": dist.get_process_group_ranks(dims.group("ep")),
            "edp": dist.get_process_group_ranks(dims.group("edp")),
            "dp": dist.get_process_group_ranks(dims.group("dp")),
            "node": int(os.environ.get("GROUP_RANK", "0")),
        }
        for case in cases:
            assert case.tokens_per_rank % case.micro_batches == 0, case.name
            model = build_model(case)
            train_model = parallelize(model, dims, activation_checkpointing=case.activation_checkpointing)
            calls = _count_dispatches(model)
            x, target = make_data(case, world_size)
            results[f"ep{ep}/{case.name}"] = _train(model, train_model, case, x, target,
                                                    _micro_slices(case, rank, world_size), dims)
            results[f"ep{ep}/{case.name}"]["dispatch_calls"] = calls
            if checkpoint is not None and checkpoint[0] == case.name:
                dcp.save(model.state_dict(), checkpoint_id=checkpoint[1])
    return results


# ----- comparison -------------------------------------------------------------------------------


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    """Norm-wise relative error: robust to individual near-zero entries, strict on the tensor."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    assert err <= rtol * scale + 1e-12, f"{what}: relative error {err / max(scale, 1e-30):.3e} > {rtol:g}"


def _assemble(per_rank: list[dict], name: str, ep: int) -> list[torch.Tensor]:
    """One full tensor per edp replica (ep group) from the per-rank (offset, local) pieces."""
    full = []
    for g in range(len(per_rank) // ep):
        pieces = sorted((per_rank[r][name] for r in range(g * ep, (g + 1) * ep)), key=lambda p: p[0])
        offsets = [o for o, _ in pieces]
        sizes = [t.shape[0] for _, t in pieces]
        assert offsets == [sum(sizes[:i]) for i in range(ep)], f"{name}: shard offsets {offsets} leave gaps"
        full.append(torch.cat([t for _, t in pieces]))
    return full


def _compare_tensors(per_rank: list[dict], expected: dict, ep: int, what: str) -> None:
    assert set(per_rank[0]) == set(expected), f"{what}: parameter names differ"
    for name, (_, exp) in expected.items():
        if per_rank[0][name][0] is None:  # replicated: every rank must hold the reference value
            for r, d in enumerate(per_rank):
                assert_rel_close(d[name][1], exp, f"{what} {name} on rank {r}")
        else:
            for g, full in enumerate(_assemble(per_rank, name, ep)):
                assert_rel_close(full, exp, f"{what} {name} (experts of ep group {g})")


def assert_parity(case: Case, ranks: list[dict], ref: dict, *, ep: int) -> None:
    W, n = len(ranks), case.micro_batches
    for s, ref_step in enumerate(ref["steps"]):
        steps = [r["steps"][s] for r in ranks]
        at = f"[{case.name}, ep={ep}, step {s}]"
        for m in range(n):
            assert_rel_close(torch.cat([st["out"][m] for st in steps]), ref_step["out"][m], f"{at} output (micro {m})")
            dropped = [sum(st["dropped"][m][i] for st in steps) for i in range(len(ref_step["dropped"][m]))]
            assert dropped == ref_step["dropped"][m], \
                f"{at} dropped copies per layer {dropped} != {ref_step['dropped'][m]}"
        # The single-process loss of the global batch is the mean of the per-rank losses.
        for key, what in (("loss", "loss"), ("aux", "aux loss")):
            mean = sum(st[key] for st in steps) / W
            assert_rel_close(torch.tensor(mean), torch.tensor(ref_step[key]), f"{at} {what}")
        for r, st in enumerate(steps):
            assert_rel_close(torch.tensor(st["grad_norm"]), torch.tensor(ref_step["grad_norm"]),
                             f"{at} grad norm rank {r}")
        _compare_tensors([st["grads"] for st in steps], ref_step["grads"], ep, f"{at} grad")
    _compare_tensors([r["params"] for r in ranks], ref["params"], ep, f"[{case.name}, ep={ep}] params after "
                     f"{case.steps} steps")
