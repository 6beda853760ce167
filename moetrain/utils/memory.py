"""Measured memory of one rank: model states exactly, and the peaks of a training step by category.

There is no CPU memory API in torch (``torch.cpu`` has no allocator statistics, the accelerator
API raises without an accelerator, ``tracemalloc`` sees nothing of tensor memory and the process
high-water mark also holds the Python interpreter and torch's libraries). So the bytes are
counted at the tensor level, the same way on CPU and CUDA:

* ``model_state_bytes`` adds up the distinct storages of the parameters, gradients and optimizer
  states this rank holds (with other optimizer-side states the caller names: a weight average):
  the local shards of DTensors, FSDP2's padded shard storage, DDP's gradient buckets. No hooks,
  no overhead: exact at the moment it is called.
* ``MemoryTracker`` is a ``TorchDispatchMode`` that sees every tensor an operator returns, keeps a
  weak reference to each new storage (freed storages drop out through the weakref callback) and
  follows ``UntypedStorage.resize_`` (FSDP2 frees and re-allocates gathered parameters that way,
  which no dispatch mode sees). Each storage gets a category:

  - ``param``: parameters, and everything FSDP2 allocates while gathering them (the all-gather
    buffer and the unsharded parameters);
  - ``grad``: gradients once they are a parameter's ``.grad``, DDP buckets, and FSDP2's
    reduce-scatter buffers;
  - ``optim``: optimizer states, other states the caller names (a weight average), and whatever
    ``optimizer.step`` allocates;
  - ``act``: everything else made by the forward and backward: saved activations, the
    all-to-all buffers, activation gradients, temporaries. Its peak is the "activation peak".

  The peaks are per category (each its own maximum over the step) plus the peak of their sum.
  Bytes are storage bytes, not allocator blocks (the CUDA caching allocator rounds up to 512 B
  and keeps freed blocks; ``torch.cuda.max_memory_allocated`` is the number to compare there).

Costs: a dispatch-mode step runs about 1.1-1.5x slower on the tiny preset (one Python call per
operator), so the trainer tracks log steps only.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = ("param", "grad", "optim", "act")


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``t``'s data: a DTensor's local tensor, a plain tensor's own."""
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        t = local
    if t.device.type == "meta":
        return []
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without one storage
        return []


def _optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The optimizer's states, then the tensors it steps: those are the model's parameters (or
    views of them, counted there already) except for copies of its own, such as the host
    master slices of an offloading ZeRO-1 optimizer."""
    if optimizer is None:
        return []
    out = []
    for state in optimizer.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for group in optimizer.param_groups:
        out += list(group["params"])
    return out


def _sum_distinct(tensors, seen: set[int]) -> int:
    total = 0
    for t in tensors:
        for st in _storages(t):
            key = st.data_ptr() if st.nbytes() > 0 else id(st)
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
    return total


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                      states: Sequence[torch.Tensor] = ()) -> dict[str, int]:
    """Bytes of the distinct storages of this rank's parameters, gradients (those that exist now),
    optimizer states plus ``states`` (a weight average: optimizer memory, as the planner counts it),
    and buffers. A storage shared by several tensors (a tied embedding, a
    DDP bucket holding many gradients, a shard view) counts once, in the first category that holds
    it (parameters first). Under FSDP2 the parameters are the sharded ones between steps."""
    seen: set[int] = set()
    params = list(model.parameters())
    return {
        "param_bytes": _sum_distinct(params, seen),
        "grad_bytes": _sum_distinct([p.grad for p in params if p.grad is not None], seen),
        "optim_bytes": _sum_distinct([*_optimizer_tensors(optimizer), *states], seen),
        "buffer_bytes": _sum_distinct(list(model.buffers()), seen),
    }


@dataclass
class MemoryReport:
    """Peaks of one tracked region, bytes on this rank."""

    param_bytes: int
    """Peak of parameter memory: the shards plus, under FSDP2, the gathered parameters."""
    grad_bytes: int
    """Peak of gradient memory (gradients, DDP buckets, FSDP reduce-scatter buffers)."""
    optim_bytes: int
    """Peak of optimizer states and optimizer-step temporaries."""
    activation_peak_bytes: int
    """Peak of everything else the forward and backward allocate (see the module docstring)."""
    peak_bytes: int
    """Peak of the sum of the four categories (the categories peak at different times)."""

    def as_metrics(self, prefix: str = "mem/") -> dict[str, int]:
        return {prefix + k: v for k, v in asdict(self).items()}


class _Info:
    __slots__ = ("category", "nbytes")

    def __init__(self, nbytes: int, category: str) -> None:
        self.nbytes, self.category = nbytes, category


class MemoryTracker(TorchDispatchMode):
    """Track the tensor memory of a region (usually one training step) by category.

        tracker = MemoryTracker(model, optimizer)
        with tracker:
            loss = model(x).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
        tracker.report()          # MemoryReport of the peaks in the region

    ``model`` (the module that trains: the DDP wrapper, the FSDP root or a plain model) and
    ``optimizer`` give the storages that exist before the region (their parameters, gradients
    and states) and the hooks that label gradients and optimizer allocations; ``states`` are
    other optimizer-side tensors that live through the region (a weight average), counted as
    ``optim``. Works with plain,
    DDP and FSDP2 models and DTensor (expert-parallel) parameters. Not re-entrant.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 states: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self.model, self.optimizer, self.states = model, optimizer, list(states)
        self._info = WeakIdKeyDictionary()
        self._refs: list[weakref.ref] = []
        self.current = dict.fromkeys((*CATEGORIES, "pre"), 0)
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self._labels: list[str] = []
        self._undo: list = []

    # --- bookkeeping ------------------------------------------------------------------------------

    def _add(self, st: torch.UntypedStorage, category: str) -> None:
        info = self._info.get(st)
        if info is not None:
            if info.category in ("act", "pre") and category not in ("act", "pre"):
                # A storage changes hands only from the activation phase (or from the unknown
                # pre-existing pool) to a model state, e.g. a backward output becoming a .grad;
                # a parameter stays a parameter when the optimizer lists it too.
                self.current[info.category] -= info.nbytes
                info.category = category
                self.current[category] += info.nbytes
                self._update_peak()
            return
        info = _Info(st.nbytes(), category)
        self._info[st] = info
        self._refs.append(weakref.ref(st, lambda _ref: self._free(info)))
        self.current[category] += info.nbytes
        self._update_peak()

    def _free(self, info: _Info) -> None:
        self.current[info.category] -= info.nbytes
        info.nbytes = 0

    def _resized(self, st: torch.UntypedStorage) -> None:
        info = self._info.get(st)
        if info is None:
            self._add(st, self._label())
            return
        new = st.nbytes()
        self.current[info.category] += new - info.nbytes
        info.nbytes = new
        self._update_peak()

    def _update_peak(self) -> None:
        for c in CATEGORIES:
            self.peak[c] = max(self.peak[c], self.current[c])
        # Pre-existing storages ("pre") join the total at exit, once their role is known.
        self.peak_total = max(self.peak_total, sum(self.current[c] for c in CATEGORIES))

    def _label(self) -> str:
        return self._labels[-1] if self._labels else "act"

    def _track(self, t: torch.Tensor, category: str, *, new_only: bool = False) -> None:
        for st in _storages(t):
            if new_only and st in self._info:
                continue
            self._add(st, category)

    # --- the mode ---------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Let DTensor run first and come back with its local ops (their outputs hold the storage).
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        # An in-place or out= op returns storage it was given. Seen here for the first time, that
        # storage existed before the region (e.g. DDP's gradient buckets, allocated at wrap
        # time, first touched by the backward's copy into them): it goes to the "pre" pool, not
        # to the activations, and is sorted out at exit.
        label = "pre" if func._schema.is_mutable else self._label()
        # Outputs only add storages: a view of a gradient taken inside the optimizer step must not
        # turn the gradient into optimizer memory. Labels change only through the hooks.
        tree_map_only(torch.Tensor, lambda t: self._track(t, label, new_only=True), out)
        return out

    def __enter__(self):
        # 1. What already exists: model states (parameters first, so a shared storage is a param).
        params = list(self.model.parameters())
        for p in params:
            self._track(p, "param")
        for p in params:
            if p.grad is not None:
                self._track(p.grad, "grad")
        for t in [*_optimizer_tensors(self.optimizer), *self.states]:
            self._track(t, "optim")
        # 2. Gradients: relabel a parameter's .grad as it is accumulated (the first one is the
        #    backward's own output tensor, allocated in the "act" phase).
        for p in params:
            if p.requires_grad:
                self._undo.append(p.register_post_accumulate_grad_hook(
                    lambda p: self._track(p.grad, "grad") if p.grad is not None else None).remove)
        # 3. Optimizer step: its allocations are optimizer memory.
        if self.optimizer is not None:
            def pre_step(*args):
                self._claim_gradients()  # before a zero_grad(set_to_none) can hide them
                self._labels.append("optim")

            self._undo.append(self.optimizer.register_step_pre_hook(pre_step).remove)
            self._undo.append(self.optimizer.register_step_post_hook(lambda *a: self._pop_label()).remove)
        # 4. FSDP2 gathers and reduces inside its own hooks; label what they allocate. DDP
        #    (re)allocates its gradient buckets before a forward (the second one rebuilds them).
        self._patch_fsdp()
        pre_forward = getattr(self.model, "_pre_forward", None)
        if pre_forward is not None and hasattr(self.model, "reducer"):
            def ddp_pre_forward(*args, **kwargs):
                self._labels.append("grad")
                try:
                    return pre_forward(*args, **kwargs)
                finally:
                    self._pop_label()

            # nn.Module.__setattr__ takes any value; its stub allows only Tensor | Module.
            self.model._pre_forward = ddp_pre_forward  # type: ignore[assignment]
            self._undo.append(lambda: delattr(self.model, "_pre_forward"))
        # 5. Storage resizes (FSDP2 frees gathered parameters by resizing to 0).
        orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            out = orig_resize(st, size)
            tracker._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]  # undone in __exit__
        self._undo.append(lambda: setattr(torch.UntypedStorage, "resize_", orig_resize))
        self._update_peak()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        while self._undo:
            self._undo.pop()()
        self._claim_gradients()
        return out

    def _claim_gradients(self) -> None:
        """Pre-existing storages that turn out to hold gradients (DDP buckets) were alive for the
        whole region: their bytes add to every moment of the gradient curve, so to its peak."""
        for p in self.model.parameters():
            if p.grad is None:
                continue
            for st in _storages(p.grad):
                info = self._info.get(st)
                if info is not None and info.category == "pre":
                    self.peak["grad"] += info.nbytes
                    self.peak_total += info.nbytes
                    self.current["pre"] -= info.nbytes
                    info.category = "grad"
                    self.current["grad"] += info.nbytes

    def _pop_label(self) -> None:
        if self._labels:
            self._labels.pop()

    def _patch_fsdp(self) -> None:
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
        except ImportError:  # pragma: no cover - torch without FSDP2
            return
        for name, label in (("unshard", "param"), ("wait_for_unshard", "param"), ("post_backward", "grad")):
            orig = getattr(FSDPParamGroup, name, None)
            if orig is None:
                continue

            def wrapped(group, *args, _orig=orig, _label=label, **kwargs):
                self._labels.append(_label)
                try:
                    return _orig(group, *args, **kwargs)
                finally:
                    self._pop_label()

            setattr(FSDPParamGroup, name, wrapped)
            self._undo.append(lambda name=name, orig=orig: setattr(FSDPParamGroup, name, orig))

    # --- results ----------------------------------------------------------------------------------

    def report(self) -> MemoryReport:
        return MemoryReport(param_bytes=self.peak["param"], grad_bytes=self.peak["grad"],
                            optim_bytes=self.peak["optim"], activation_peak_bytes=self.peak["act"],
                            peak_bytes=self.peak_total)


@contextlib.contextmanager
def track_memory(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, enabled: bool = True):
    """``with track_memory(model, opt) as tracker: ...`` then ``tracker.report()``; yields None
    (and costs nothing) when ``enabled`` is False."""
    if not enabled:
        yield None
        return
    tracker = MemoryTracker(model, optimizer)
    with tracker:
        yield tracker
