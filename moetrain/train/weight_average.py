"""An exponential moving average (EMA, Polyak averaging) of a model's trainable weights.

    ema = WeightAverage(model, decay=0.999)     # after parallelize: each rank averages what it holds
    optimizer.step(); ema.update()              # after every step taken
    with ema.applied():                         # the averaged weights in place of the raw ones,
        evaluate(model)                         #   the raw ones back afterwards
    state["ema"] = ema.state_dict()             # keyed like the model's state dict, DTensors kept

The average is elementwise, so each rank keeps exactly the part of each weight it holds (an expert
shard, an FSDP shard, a tensor-parallel slice, a replica) and nothing crosses the wire; a replicated
weight's average is the same on every replica because its updates are. Saved with the DTensor
placements of the weights, it reshards through DCP exactly as they do. Memory: one more copy of the
rank's trainable weights, in their dtype (fp32 masters under mixed precision).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from moetrain.utils.tensors import local_tensor


class WeightAverage:
    def __init__(self, model: nn.Module, *, decay: float) -> None:
        """Average ``model``'s parameters that require a gradient, starting from their current values.
        Frozen parameters and buffers (router biases, capacity factors) are not averaged: an averaged
        model runs with the live buffers."""
        if not 0 <= decay < 1:
            raise ValueError(f"optim.ema_decay ({decay!r}) must be in [0, 1)")
        self.decay = decay
        self.num_updates = 0
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        self._live: list[torch.Tensor] = []
        self._avg: list[torch.Tensor] = []
        # State-dict names (the checkpoint's) -> index; a tied weight has several names and one average.
        self._index: dict[str, int] = {}
        seen: dict[int, int] = {}
        with torch.no_grad():
            for name, t in model.state_dict(keep_vars=True).items():
                if id(t) not in trainable:
                    continue
                if id(t) not in seen:
                    seen[id(t)] = len(self._live)
                    self._live.append(t)
                    self._avg.append(t.detach().clone())
                self._index[name] = seen[id(t)]

    def tensors(self) -> list[torch.Tensor]:
        """The averages, one per distinct weight, placed and sharded as the weights are (for memory
        accounting)."""
        return list(self._avg)

    def next_decay(self) -> float:
        """The decay of the next update: ``decay``, lowered early on so that the first updates
        replace most of the (random or pretrained) initial weights."""
        t = self.num_updates
        return min(self.decay, (1 + t) / (10 + t))

    def _locals(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [local_tensor(t) for t in self._live], [local_tensor(t) for t in self._avg]

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current weights in: ``avg += (1 - d) * (w - avg)``."""
        weight = 1.0 - self.next_decay()
        self.num_updates += 1
        live, avg = self._locals()
        torch._foreach_lerp_(avg, live, weight)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The averaged weights in the model for the duration of the block (an evaluation, a sample);
        the raw weights, bit for bit, afterwards. Holds one temporary copy of the raw weights."""
        live, avg = self._locals()
        with torch.no_grad():
            raw = [t.clone() for t in live]
            torch._foreach_copy_(live, avg)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(live, raw)

    @torch.no_grad()
    def restart(self) -> None:
        """Start the average again from the current weights (a resume from a checkpoint without one)."""
        live, avg = self._locals()
        torch._foreach_copy_(avg, live)
        self.num_updates = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averages under the model's state-dict names (the live tensors: for saving, or as the
        shapes and placements a checkpoint is read into)."""
        return {name: self._avg[i] for name, i in self._index.items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor], *, num_updates: int) -> None:
        missing = sorted(set(self._index) - set(state))
        if missing:
            raise ValueError(f"the weight average to load lacks {len(missing)} weights: "
                             f"{', '.join(missing[:4])}")
        for name, i in self._index.items():
            local_tensor(self._avg[i]).copy_(local_tensor(state[name]))
        self.num_updates = num_updates
