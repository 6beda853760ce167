"""Where replicas of hot experts go (``parallel.expert_slots_per_rank``, ``moe.rebalance_every``):
a pure function of the routed load per expert, computed the same on every rank.

Each of the P ranks of an ep group holds S slots: its L = E/P *home* experts (expert ``e`` on rank
``e // L``, as without rebalancing: the weights, their optimizer state and checkpoints stay there)
and R = S - L *spare* slots, each holding a replica of some expert. An expert's routed copies are
shared among its home and its replicas in fixed proportions (``Placement.copies``: units out of
``SHARE_UNITS``), so a rank's load is the sum of the shares it serves.

The plan (``plan_placement``), greedy and deterministic (ties by the lower rank, then expert id):

1. Start from the home layout (every share 1).
2. For each spare slot, P * R times: take the most loaded rank and, among the experts it serves,
   the one it serves most tokens of; put a replica of it on the least loaded rank that has a
   spare slot free and no copy of it yet; then water-fill that expert over its copies (its load
   split so that its copies' ranks end as level as the other loads on them allow).
3. Water-fill every replicated expert again, twice, in id order (later replicas moved the levels).

Why not EPLB's own packing (replicate the experts with the highest load per copy, then pack all
copies onto ranks with longest-processing-time first): it moves home experts between ranks, so
every rebalance would migrate weights *and* optimizer state and checkpoints would need a logical
re-ordering. Homes fixed, only replicas move, and their weights are refreshed from home every step
anyway (``rebalance.py``); unequal shares make up for the fixed homes (one spare slot per rank
takes zipf:1.2 at ep=4 from max/mean 2.4 to about 1.0, ``benchmarks/skew.py --rebalance``).

Shape legend: E experts, P ranks of the ep group, C copies of an expert, R spare
slots per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

SHARE_UNITS = 1 << 16
"""An expert's routed copies are split in units of 1/SHARE_UNITS (integers: every rank splits
alike, no float rounding across ranks)."""


@dataclass(frozen=True)
class Placement:
    """Replicas per spare slot and every expert's copies with their shares."""

    num_ranks: int
    slots_per_rank: int
    num_experts: int
    replicas: tuple[tuple[int, ...], ...]
    """``[p][r]``: the expert whose replica spare slot r of rank p holds."""
    copies: tuple[tuple[tuple[int, int], ...], ...]
    """``[e]``: (global slot, share units) of each copy of expert e (its home and its replicas), by
    global slot; the units sum to SHARE_UNITS. Global slot ``p * S + s``: rank p's slot s (s < L: its
    home expert ``p * L + s``)."""

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    def to_json(self) -> dict:
        return {"num_ranks": self.num_ranks, "slots_per_rank": self.slots_per_rank, "num_experts": self.num_experts,
                "replicas": [list(r) for r in self.replicas],
                "copies": [[list(c) for c in copies] for copies in self.copies]}

    @classmethod
    def from_json(cls, saved: dict) -> Placement:
        """A placement ``to_json`` wrote (a checkpoint's), checked before use: ValueError unless every
        copy sits on a slot of the expert (its home, or a spare slot holding its replica) and each
        expert's shares sum to SHARE_UNITS."""
        try:
            P, S, E = (int(saved[k]) for k in ("num_ranks", "slots_per_rank", "num_experts"))
            replicas = tuple(tuple(int(e) for e in r) for r in saved["replicas"])
            copies = tuple(tuple((int(slot), int(units)) for slot, units in c) for c in saved["copies"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"expert placement {saved!r}: not a saved placement ({error})") from None
        L = E // P if P > 0 else 0
        ok = P > 0 and E % P == 0 and S >= L and len(replicas) == P and len(copies) == E
        ok = ok and all(len(r) == S - L and all(0 <= e < E for e in r) for r in replicas)
        for e, c in enumerate(copies if ok else ()):
            spare = [(slot // S, slot % S - L) for slot, _ in c if slot != e // L * S + e % L]
            ok = ok and sum(u for _, u in c) == SHARE_UNITS and all(u >= 0 for _, u in c) and \
                len(spare) == len(c) - 1 and all(0 <= q < P and 0 <= r < S - L and replicas[q][r] == e
                                                 for q, r in spare)
        if not ok:
            raise ValueError(f"expert placement {saved!r}: its copies do not sit on their experts' slots "
                             f"with shares summing to {SHARE_UNITS}")
        return cls(P, S, E, replicas, copies)

    def rank_loads(self, load_E: Sequence[float]) -> list[float]:
        """Load served by each rank when expert e receives ``load_E[e]`` copies."""
        out = [0.0] * self.num_ranks
        for e, copies in enumerate(self.copies):
            for slot, units in copies:
                out[slot // self.slots_per_rank] += load_E[e] * units / SHARE_UNITS
        return out

    def tables(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot_EC, end_EC)``, int64: each expert's copies' global slots and cumulative share
        ends, padded to the most copies (slot: the last copy; end: SHARE_UNITS). A copy whose
        position ``q`` (in units) satisfies ``end[c-1] <= q < end[c]`` goes to copy c."""
        width = max(len(c) for c in self.copies)
        slot_EC = torch.empty(self.num_experts, width, dtype=torch.int64)
        end_EC = torch.full((self.num_experts, width), SHARE_UNITS, dtype=torch.int64)
        for e, copies in enumerate(self.copies):
            end = 0
            for c in range(width):
                slot_EC[e, c] = copies[min(c, len(copies) - 1)][0]
                if c < len(copies):
                    end += copies[c][1]
                    end_EC[e, c] = end
        return slot_EC.to(device), end_EC.to(device)


def home_placement(num_experts: int, *, num_ranks: int, slots_per_rank: int) -> Placement:
    """The plan for a uniform load (before any routing is known)."""
    return plan_placement([1.0] * num_experts, num_ranks=num_ranks, slots_per_rank=slots_per_rank)


def plan_placement(load_E: Sequence[float], *, num_ranks: int, slots_per_rank: int) -> Placement:
    """The plan of the module docstring for routed load ``load_E`` (copies per expert, >= 0)."""
    E, P, S = len(load_E), num_ranks, slots_per_rank
    assert E % P == 0 and S >= E // P, (E, P, S)  # the config validates it for the user
    L = E // P
    load = [float(x) for x in load_E]
    holders: list[list[int]] = [[e // L] for e in range(E)]  # ranks holding a copy, home first
    shares: list[list[float]] = [[1.0] for _ in range(E)]
    rank_load = [0.0] * P
    for e in range(E):
        rank_load[e // L] += load[e]
    replicas: list[list[int]] = [[] for _ in range(P)]

    def served(p: int) -> list[tuple[float, int]]:
        """(-tokens of e that rank p serves, e) for the experts it holds a copy of, most first."""
        return sorted((-load[e] * shares[e][holders[e].index(p)], e) for e in range(E) if p in holders[e])

    for _ in range(P * (S - L)):
        picked = None
        for p in sorted(range(P), key=lambda q: (-rank_load[q], q)):
            for _, e in served(p):
                free = [q for q in range(P) if len(replicas[q]) < S - L and q not in holders[e]]
                if free:
                    picked = (e, min(free, key=lambda q: (rank_load[q], q)))
                    break
            if picked is not None:
                break
        if picked is None:  # every expert is on every rank with a free slot: fill with the hottest
            q = min((q for q in range(P) if len(replicas[q]) < S - L), key=lambda q: (rank_load[q], q))
            picked = (min(range(E), key=lambda e: (-load[e] / len(holders[e]), e)), q)
        e, q = picked
        replicas[q].append(e)
        holders[e].append(q)
        shares[e].append(0.0)
        _water_fill(e, load, holders, shares, rank_load)
    for _ in range(2):
        for e in range(E):
            if len(holders[e]) > 1:
                _water_fill(e, load, holders, shares, rank_load)
    return _placement(P, S, E, replicas, holders, shares)


def _water_fill(e: int, load: list[float], holders: list[list[int]], shares: list[list[float]],
                rank_load: list[float]) -> None:
    """Re-split expert e over its copies so its ranks end as level as possible: the level λ with
    ``sum_c max(0, λ - other_c) = load[e]``, ``other_c`` the rest of copy c's rank load. Updates
    ``shares[e]`` and ``rank_load`` in place."""
    ranks = holders[e]
    other = [rank_load[p] - load[e] * s for p, s in zip(ranks, shares[e], strict=True)]
    if load[e] <= 0:
        new = [1.0 / len(ranks)] * len(ranks)
    else:
        base = sorted(other)
        level = base[0] + load[e]
        for n in range(1, len(base) + 1):  # the lowest n ranks fill up to the level
            level = (sum(base[:n]) + load[e]) / n
            if n == len(base) or level <= base[n]:
                break
        new = [max(0.0, level - o) / load[e] for o in other]
        total = sum(new)
        new = [s / total for s in new]
    for p, o, s in zip(ranks, other, new, strict=True):
        rank_load[p] = o + load[e] * s
    shares[e] = new


def _placement(P: int, S: int, E: int, replicas: list[list[int]], holders: list[list[int]],
               shares: list[list[float]]) -> Placement:
    """Freeze the plan: global slots for every copy, shares rounded to units (largest remainder,
    ties to the earlier copy) so that each expert's units sum to SHARE_UNITS."""
    L = E // P
    copies = []
    for e in range(E):
        slots = [e // L * S + e % L] + [q * S + L + replicas[q].index(e) for q in holders[e][1:]]
        order = sorted(range(len(slots)), key=lambda c: slots[c])
        raw = [shares[e][c] * SHARE_UNITS for c in order]
        units = [int(x) for x in raw]
        by_remainder = sorted(range(len(raw)), key=lambda c: (-(raw[c] - units[c]), c))
        for c in by_remainder[:SHARE_UNITS - sum(units)]:
            units[c] += 1
        copies.append(tuple((slots[c], u) for c, u in zip(order, units, strict=True)))
    return Placement(P, S, E, tuple(tuple(r) for r in replicas), tuple(copies))
