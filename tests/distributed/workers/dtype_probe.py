"""Records the dtypes an MoE step actually uses, for the precision tests.

``DtypeRecorder`` is a ``TorchDispatchMode``: it sees every op below autograd and autocast, so what
it records is what the kernels received, not what the Python code meant. It keeps

* ``payload``: every all-to-all (the functional collective with autograd of the token exchange and
  the plain ``c10d`` one of counts and row ids), forward and backward;
* ``gemm``: every ``torch._grouped_mm``, and every matmul inside the routed experts (the
  per-expert loop path), forward and backward;
* ``shared`` / ``router``: the matmuls inside the shared experts' and the router's forward, scoped
  by forward hooks on those modules (public ``nn.Module`` hooks; nothing in the code under test is
  replaced), and ``router_weight`` / ``router_logits``: the gate weight as the router reads it
  (after FSDP's gather) and the logits it returns.

``dtype_worker`` runs one training step of the ZeRO harness (``zero_parity``) per run under the
recorder on real gloo ranks and returns the records plus the dtypes of the master weights,
their gradients and the optimizer states; ``bytes_worker`` compares the ``CommStats`` byte
counters of one MoE layer under fp32 and under bf16 autocast on the same input.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moetrain.models.moe import MoELayer
from moetrain.utils.tensors import local_tensor

_ALL_TO_ALL = ("all_to_all", "alltoall")
_MATMULS = ("mm", "bmm", "addmm", "matmul", "linear", "_grouped_mm")


@dataclass(frozen=True)
class Seen:
    """One op the recorder kept: where, which op, forward or backward, its tensor inputs."""

    where: str
    op: str
    backward: bool
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]


@dataclass
class DtypeRecorder(TorchDispatchMode):
    """Records payload, GEMM, shared-expert and router op dtypes (see the module docstring)."""

    seen: list[Seen] = field(default_factory=list)
    _scope: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def watch(self, layer: MoELayer) -> list:
        """Scope the matmuls of ``layer``'s router, experts and shared experts; returns the hook
        handles (remove them when done)."""
        handles = []
        for where, module in (("router", layer.router), ("experts", layer.experts),
                              ("shared", layer.shared_experts)):
            if module is None:
                continue
            handles.append(module.register_forward_pre_hook(lambda *_, w=where: self._enter(w)))
            handles.append(module.register_forward_hook(lambda *_: self._leave()))
        handles.append(layer.router.register_forward_hook(self._record_logits))
        handles.append(layer.router.register_forward_pre_hook(self._record_gate))
        return handles

    def _record_gate(self, module, args) -> None:
        # The gate weight as the router's forward reads it (FSDP has gathered it by now).
        weight = local_tensor(module.gate.weight)
        self.seen.append(Seen("router_weight", "gate", False, (weight.dtype,), (tuple(weight.shape),)))

    # Hooks return None: a forward hook's return value would replace the module's output.
    def _enter(self, where: str) -> None:
        self._scope.append(where)

    def _leave(self) -> None:
        self._scope.pop()

    def _record_logits(self, module, args, output) -> None:
        logits_TE = output.logits_TE
        self.seen.append(Seen("router_logits", "output", False, (logits_TE.dtype,), (tuple(logits_TE.shape),)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        where = None
        if any(k in name for k in _ALL_TO_ALL):
            where = "payload"
        elif name == "_grouped_mm":
            where = "gemm"
        elif name in _MATMULS and self._scope:
            where = "gemm" if self._scope[-1] == "experts" else self._scope[-1]
        if where is not None:
            tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            if where == "payload":
                # The send buffer: c10d's alltoall_base_ takes (output, input, ...), the functional
                # collective (input, ...).
                tensors = tensors[1:2] if name.startswith("alltoall") else tensors[:1]
            self.seen.append(Seen(where, name, torch._C._current_graph_task_id() != -1,
                                  tuple(t.dtype for t in tensors), tuple(tuple(t.shape) for t in tensors)))
        return func(*args, **kwargs)


COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _leaks(seen: list[Seen], where: str, expected: torch.dtype) -> list[Seen]:
    return [s for s in seen if s.where == where and any(d.is_floating_point and d != expected for d in s.dtypes)]


def check_recorded_dtypes(run, res: dict, tag: str) -> None:
    """The dtypes one training step of ``run`` (a ``zero_parity.Run`` with a shared expert) must
    use, read from ``res`` (one run's entry of ``dtype_worker``'s result): the rules listed in
    tests/distributed/test_precision_dtypes.py."""
    compute = COMPUTE_DTYPES[run.dtype]
    seen = res["seen"]
    # Token rows: 2-D floating payloads. Gate weights (1-D, dedup only) keep the router's fp32.
    rows = [s for s in seen if s.where == "payload" and len(s.shapes[0]) == 2 and s.dtypes[0].is_floating_point]
    assert {s.backward for s in rows} == {False, True}, f"{tag}: token all-to-alls seen {rows}"
    leaks = [s for s in rows if s.dtypes[0] != compute]
    assert not leaks, f"{tag}: token rows sent in the wrong dtype: {leaks}"
    gates = [s for s in seen if s.where == "payload" and len(s.shapes[0]) == 1 and s.dtypes[0].is_floating_point]
    assert all(s.dtypes[0] == torch.float32 for s in gates), f"{tag}: gate weights not fp32: {gates}"
    assert bool(gates) == run.moe.get("dispatch_dedup", False), f"{tag}: gate-weight exchanges {gates}"
    for where, expected in (("gemm", compute), ("shared", compute), ("router", torch.float32),
                            ("router_weight", torch.float32), ("router_logits", torch.float32)):
        assert any(s.where == where for s in seen), f"{tag}: no {where} op recorded"
        leaks = _leaks(seen, where, expected)
        assert not leaks, f"{tag}: {where} not in {expected}: {leaks[:4]}"
    grouped = run.moe.get("expert_impl", "grouped") == "grouped"
    assert any(s.op == "_grouped_mm" for s in seen) == grouped, f"{tag}: grouped path used: {not grouped}"
    # Backward GEMMs are recorded for the grouped path (its op is seen wherever it runs); the
    # loop's backward matmuls have no module scope to tell them from the attention's.
    gemm_phases = {s.backward for s in seen if s.where == "gemm"}
    assert gemm_phases == ({False, True} if grouped else {False}), f"{tag}: expert GEMM phases {gemm_phases}"
    for what in ("params", "grads"):
        wrong = {n: d for n, d in res[what].items() if d != torch.float32}
        assert not wrong, f"{tag}: {what} not fp32: {wrong}"
    assert set(res["grads"]) == set(res["params"]), f"{tag}: parameters without a gradient"
    assert res["optimizer_states"] == {torch.float32}, f"{tag}: optimizer states {res['optimizer_states']}"


def moe_layers(model: torch.nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def state_dtypes(model, optimizer) -> dict:
    """Dtypes of the master weights, the gradients the optimizer reads and its states."""
    params = {n: p for n, p in model.named_parameters()}
    states = set()
    for state in optimizer.state.values():
        states |= {local_tensor(v).dtype for v in state.values()
                   if isinstance(v, torch.Tensor) and v.is_floating_point()}
    return {"params": {n: local_tensor(p).dtype for n, p in params.items()},
            "grads": {n: local_tensor(p.grad).dtype for n, p in params.items() if p.grad is not None},
            "optimizer_states": states}


def dtype_worker(rank: int, world_size: int, runs: list) -> dict:
    """One training step per run (``zero_parity.Run``) with the recorder on; per run: the
    records and the dtypes of weights, gradients and optimizer states
    (gradients read before the step, states after it)."""
    from moetrain.train.precision import DynamicLossScaler, autocast_context
    from tests.distributed.workers.zero_parity import GLOBAL_BATCH, make_batches, setup_run

    out = {}
    B = GLOBAL_BATCH // world_size
    for run in runs:
        _, model, train_model, opt = setup_run(run, world_size)
        scaler = DynamicLossScaler(enabled=run.dtype == "fp16")
        tokens = make_batches(run, 1)[0][rank * B:(rank + 1) * B]
        recorder = DtypeRecorder()
        handles = [h for layer in moe_layers(model) for h in recorder.watch(layer)]
        with recorder:
            with autocast_context(torch.device("cpu"), run.dtype):
                output = train_model(tokens[:, :-1], tokens[:, 1:])
            scaler.scale_loss(output.total_loss).backward()
        for h in handles:
            h.remove()
        before = state_dtypes(model, opt)
        opt.step()
        after = state_dtypes(model, opt)
        out[run.name] = {"seen": recorder.seen, "params": after["params"],
                         "grads": before["grads"], "optimizer_states": after["optimizer_states"]}
        del model, train_model, opt
    return out


def bytes_worker(rank: int, world_size: int, dim: int = 32) -> dict:
    """One MoE layer at ep = world: the same input once in fp32 and once under bf16 autocast;
    returns each run's ``CommStats`` and the payload records."""
    from moetrain.config.moe import MoEConfig
    from moetrain.distributed import ParallelDims, apply_expert_parallel, collect_comm_stats

    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=32)
    dims = ParallelDims(world_size=world_size, ep=world_size, num_experts=cfg.num_experts)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    layer = apply_expert_parallel(torch.nn.Sequential(MoELayer(dim, cfg)), dims)[0]
    x_TD = torch.randn(16, dim, generator=torch.Generator().manual_seed(rank))
    out = {}
    for dtype in ("fp32", "bf16"):
        ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext())
        recorder = DtypeRecorder()
        with recorder:
            with ctx:
                y_TD, _ = layer(x_TD)
            y_TD.float().sum().backward()
        stats = collect_comm_stats(layer)
        out[dtype] = {"bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
                      "min_bytes": stats.min_bytes, "seen": recorder.seen,
                      "num_local_experts": layer.dispatcher.num_local_experts}
    return out
