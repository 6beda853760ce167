"""Batches drawn from several token sources by weight: deterministic, rank-sharded and resumable.

Shapes as in moetrain.data.loader: ``G`` sequences per optimizer step over all ranks, taken as ``A``
micro-batches of ``B = G / (A * dp_size)`` per rank; ``S`` = seq_len; ``n`` sources.

Windows. Every file of a source is cut into windows of S + 1 tokens like TokenLoader's (a window
never spans two files); a source's W_s windows are those of its files in order. Source s visits its
windows in a permutation seeded by (seed, s, epoch) (stream order when not shuffled), whatever the
other sources do.

Epochs. A source's epoch is whole steps, as TokenLoader's: the step whose share of source s would
run past the end of the permutation starts the next epoch instead, and the windows the old epoch
had left are dropped (fewer than that step's share: W mod G for a single source, as TokenLoader),
so no step holds a window twice: the constructor refuses sizes and weights with which a step could
draw more than W_s windows of source s (its mean share per step, w_s / sum(w) * G, near W_s or
above). The k-th window the source gives (k counts every step's share) is at position k - B_e of
epoch e, where B_0 = 0 and B_{e+1} is the source's count at the start of the step that draws its
window number B_e + W_s. Like the mixing, this depends only on the weights, G and the W_s: not on
the number of ranks or micro-batches, nor on where a run resumed.

Mixing. The k-th window source s contributes (k = 0, 1, ...) gets the key (k + 1/2) / w_s, and the
samples of the run take the keys of all sources in increasing order, ties to the lower source
index: the Sainte-Lague divisor sequence (as Megatron's blended datasets, no sampling noise). After
T samples each source has given close to its quota T * w_s / sum(w), and the next G samples are
the G smallest keys among each source's next G candidates, so they depend only on the counts c_s
consumed so far. Worked example, weights (3, 1): source 0 has keys 1/6, 1/2, 5/6, 7/6, 3/2, ...,
source 1 has 1/2, 3/2, 5/2, ...; the samples come from sources 0, 0, 1, 0, 0, 0, 1, 0, ...

Position. The state is c (windows taken from each source before the current step) and the
micro-batch within the step. At micro-batch j, rank r takes samples [j*G/A + r*B, ... + B) of the
step's G, so, as with TokenLoader, the ranks' batches concatenate to the one-process batch, every
step covers the same G samples whatever A and dp_size are, and a state saved between steps
resumes at another data-parallel size with the same global batches.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from fractions import Fraction

import numpy as np
import torch

from moetrain.data.loader import check_batch_geometry, eval_rows, resumed_micro


class MixtureLoader:
    """Batches of (input_ids, labels), int64 tensors [B, S], mixed from ``sources`` by ``weights``.

    Args:
        sources: per source, its token files [N_f] (numpy arrays or memmaps), in order.
        weights: per source, its share of the samples (> 0; normalised by their sum).
        names: per source, a name for messages and the state (the configured path).
        seq_len, global_batch_size, micro_steps, dp_rank, dp_size, seed: as for TokenLoader.
        shuffle: False visits each source's windows in stream order (validation); such a loader
            needs one window per source, and only evaluates where steps would repeat a window.
        name: "train" / "val", for messages.
    """

    def __init__(self, sources: Sequence[Sequence[np.ndarray]], weights: Sequence[float], *, names: Sequence[str],
                 seq_len: int, global_batch_size: int, micro_steps: int = 1, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, shuffle: bool = True, name: str = "train") -> None:
        check_batch_geometry(seq_len=seq_len, global_batch_size=global_batch_size, micro_steps=micro_steps,
                             dp_rank=dp_rank, dp_size=dp_size, seed=seed)
        assert len(sources) == len(weights) == len(names) >= 1, "one weight and one name per source"
        self.files = [list(files) for files in sources]
        self.weights = np.asarray(weights, dtype=np.float64)
        assert np.all(self.weights > 0) and np.all(np.isfinite(self.weights)), self.weights
        self.names = [str(n) for n in names]
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.micro_steps = micro_steps
        self.micro_batch_size = global_batch_size // micro_steps
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.local_batch_size = self.micro_batch_size // dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.name = name
        # First window of each file within its source: window w of source s is in the file i with
        # starts[s][i] <= w < starts[s][i + 1].
        self._starts = [np.concatenate([[0], np.cumsum([max(len(t) - 1, 0) // seq_len for t in files])])
                        for files in self.files]
        self.num_windows = [int(starts[-1]) for starts in self._starts]
        for s, num in enumerate(self.num_windows):
            if num == 0:
                num_tokens = sum(len(t) for t in self.files[s])
                raise ValueError(f"the {name} part of data source {self.names[s]!r} has {num_tokens} tokens in "
                                 f"{len(self.files[s])} file(s), not one window of data.seq_len + 1 = "
                                 f"{seq_len + 1} tokens in any file; use more data or a smaller seq_len"
                                 + (", or a larger data.val_fraction" if name == "val" else ""))
        self.steps_per_epoch = self._steps_before_a_source_repeats()
        self._step_error = self._step_problem()
        if self._step_error is not None and shuffle:
            raise ValueError(self._step_error + "; use more data, a smaller batch or seq_len, other weights")
        # An unshuffled (validation) loader evaluates through eval_batches, which pads a partial batch:
        # a window per source is enough, so sources that evaluate at dp 1 do at any dp.
        self._consumed = np.zeros(len(self.files), dtype=np.int64)
        self._micro = 0
        self._plan: tuple[np.ndarray, np.ndarray] | None = None
        self._orders: dict[tuple[int, int], np.ndarray] = {}
        self._epoch_starts: list[list[int]] = [[0] for _ in self.files]
        """Per source, B_0, B_1, ...: the count of windows given when each epoch starts (grown lazily)."""

    def __len__(self) -> int:
        """Steps before any source repeats a window (an epoch of the smallest share)."""
        return self.steps_per_epoch

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        return int(self._consumed.sum()) // self.global_batch_size

    def _step_problem(self) -> str | None:
        """Why this loader cannot take steps (only evaluate), or None."""
        if self.steps_per_epoch == 0:
            counts = ", ".join(f"{n!r}: {w} windows" for n, w in zip(self.names, self.num_windows, strict=True))
            return (f"the {self.name} part of a data source is smaller than its share of one global batch of "
                    f"{self.global_batch_size} sequences ({counts}; shares {self._shares()})")
        for s in range(len(self.files)):
            if self._may_overflow(s):
                drawn = self._most_drawn_in_a_step(s)
                if drawn is not None and drawn <= self.num_windows[s]:
                    continue
                share = float(self.weights[s] / self.weights.sum())
                draws = f"draws {drawn} windows" if drawn is not None else "may draw more than that"
                return (f"the {self.name} part of data source {self.names[s]!r} has {self.num_windows[s]} windows, "
                        f"and a step of {self.global_batch_size} sequences {draws} from it (its share per step "
                        f"is {share:.3g} * {self.global_batch_size} = {share * self.global_batch_size:.3g}): a "
                        "window would repeat within the step")
        return None

    def _may_overflow(self, s: int) -> bool:
        """Whether ``global_batch_size`` consecutive samples can hold W_s + 1 windows of source s,
        which no epoch boundary could keep apart (a bound: steps start at multiples of G). Those
        windows' keys span m / w_s (m = W_s); a source t has at least floor(m * w_t / w_s) keys in
        any half-open interval of that length, all between them in the sample order (exact ties
        fall on one side; float keys keep exact ties, so a ratio just above a whole counts one less)."""
        w = [Fraction(float(x)) for x in self.weights]
        m = self.num_windows[s]
        between = 0
        for t in range(len(w)):
            if t != s:
                ratio = m * w[t] / w[s]
                whole = math.floor(ratio)
                between += whole - (1 if 0 < ratio - whole < Fraction(1, 10**9) else 0)
        return m + 1 + between <= self.global_batch_size

    def _most_drawn_in_a_step(self, s: int, max_samples: int = 1 << 16, max_steps: int = 1 << 10) -> int | None:
        """The most windows of source s that one step draws, or None when that costs more than
        ``max_samples`` samples or ``max_steps`` steps to find. Shifting every key by X, with
        X * w_t whole for all t, maps the sample order onto itself Q = sum(X * w_t) samples later,
        so the steps' draws repeat every lcm(Q, G) samples: weights of small ratio (3:1, 1.75:1:8)
        have a short period, and this count is then exact where `_may_overflow` is a bound."""
        w = [Fraction(float(x)) for x in self.weights]
        shift = Fraction(math.lcm(*(f.denominator for f in w)), math.gcd(*(f.numerator for f in w)))
        period = int(sum(shift * f for f in w))
        samples = math.lcm(period, self.global_batch_size)
        if samples > max_samples or samples // self.global_batch_size > max_steps:
            return None
        consumed, most = np.zeros(len(w), dtype=np.int64), 0
        for _ in range(samples // self.global_batch_size):
            drawn = np.bincount(self._next_samples(consumed)[0], minlength=len(w))
            most, consumed = max(most, int(drawn[s])), consumed + drawn
        return most

    def _shares(self) -> str:
        return ", ".join(f"{w:.3g}" for w in self.weights / self.weights.sum())

    def _steps_before_a_source_repeats(self) -> int:
        """Whole steps from the start before some source needs its window number W_s (its first
        repeat): the samples ordered before that window's key, divided by G."""
        w, num = self.weights, self.num_windows
        # The first window past the end of a source in the sample order: least (key, source).
        first = min(range(len(num)), key=lambda s: ((num[s] + 0.5) / w[s], s))
        return self._rank(first, num[first]) // self.global_batch_size

    def _rank(self, source: int, k: int) -> int:
        """The place of the k-th window of ``source`` in the run's sample order: the windows of all
        sources ordered before it by (key, source)."""
        w = self.weights
        key = (k + 0.5) / w[source]

        def before(s: int, j: int) -> bool:  # same float expression as _next_samples' keys
            j_key = (j + 0.5) / w[s]
            return j_key < key or (j_key == key and s < source)

        total = 0
        for s in range(len(w)):
            j = max(int(key * w[s] - 0.5), 0)  # estimate, then settle on the exact count
            while before(s, j):
                j += 1
            while j > 0 and not before(s, j - 1):
                j -= 1
            total += j
        return total

    def _count_before(self, source: int, num_samples: int) -> int:
        """Windows ``source`` gives among the run's first ``num_samples`` samples."""
        lo, hi = 0, num_samples  # the least k whose rank is >= num_samples: ranks increase with k
        while lo < hi:
            mid = (lo + hi) // 2
            if self._rank(source, mid) < num_samples:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _epoch_of(self, source: int, k: int) -> tuple[int, int]:
        """(epoch, position in its permutation) of the k-th window ``source`` gives (see Epochs in
        the module docstring)."""
        starts, num = self._epoch_starts[source], self.num_windows[source]
        while starts[-1] <= k:
            step = self._rank(source, starts[-1] + num) // self.global_batch_size
            start = self._count_before(source, step * self.global_batch_size)
            # A step whose share alone exceeds W_s cannot avoid a repeat: the constructor refuses
            # such a mixture (_step_problem), and an unshuffled one only evaluates; kept as a guard.
            starts.append(start if start > starts[-1] else starts[-1] + num)
        epoch = bisect.bisect_right(starts, k) - 1
        return epoch, k - starts[epoch]

    def _next_samples(self, consumed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source [G], k [G]): the next global batch after ``consumed`` windows per source; k is
        the index of the window among all the source has given (epoch * W_s + position)."""
        g = self.global_batch_size
        k_nG = consumed[:, None] + np.arange(g)
        keys_nG = (k_nG + 0.5) / self.weights[:, None]
        source_nG = np.broadcast_to(np.arange(len(consumed))[:, None], k_nG.shape)
        order = np.lexsort((source_nG.ravel(), keys_nG.ravel()))[:g]  # by key, then by source
        return source_nG.ravel()[order], k_nG.ravel()[order]

    def _order(self, source: int, epoch: int) -> np.ndarray:
        """Window indices [W_s] in the order ``epoch`` of ``source`` visits them."""
        if not self.shuffle:
            return np.arange(self.num_windows[source])
        if (source, epoch) not in self._orders:
            # A step straddles at most two epochs of a source: keep those, drop older ones.
            for key in [key for key in self._orders if key[0] == source and key[1] < epoch - 1]:
                del self._orders[key]
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, source, epoch])))
            self._orders[source, epoch] = rng.permutation(self.num_windows[source])
        return self._orders[source, epoch]

    def _window(self, source: int, k: int) -> np.ndarray:
        """The S + 1 tokens of the k-th window ``source`` gives, read from its memmap."""
        epoch, position = self._epoch_of(source, int(k))
        return self._read_window(source, int(self._order(source, epoch)[position]))

    def _read_window(self, source: int, window: int) -> np.ndarray:
        """The S + 1 tokens of window number ``window`` of ``source`` (in stream order)."""
        starts = self._starts[source]
        i = int(np.searchsorted(starts, window, side="right")) - 1
        offset = (window - int(starts[i])) * self.seq_len
        return np.asarray(self.files[source][i][offset:offset + self.seq_len + 1], dtype=np.int64)

    def _batch(self, samples: tuple[np.ndarray, np.ndarray], micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        source_G, k_G = samples
        start = micro * self.micro_batch_size + self.dp_rank * self.local_batch_size
        rows = [self._window(s, k) for s, k in zip(source_G[start:start + self.local_batch_size],
                                                   k_G[start:start + self.local_batch_size], strict=True)]
        chunk_BS1 = torch.from_numpy(np.stack(rows))
        return chunk_BS1[:, :-1].contiguous(), chunk_BS1[:, 1:].contiguous()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch (input_ids [B, S], labels [B, S]); the position moves to the
        next step after ``micro_steps`` of them."""
        if self._step_error is not None:
            raise ValueError(f"{self._step_error} (this loader only evaluates: eval_batches)")
        if self._plan is None:
            self._plan = self._next_samples(self._consumed)
        batch = self._batch(self._plan, self._micro)
        self._micro += 1
        if self._micro == self.micro_steps:
            self._consumed = self._consumed + np.bincount(self._plan[0], minlength=len(self.files))
            self._micro, self._plan = 0, None
        return batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless: the trainer decides when to stop."""
        while True:
            yield self.next_batch()

    def eval_samples(self) -> tuple[np.ndarray, np.ndarray]:
        """(source [N], window [N]): the samples of the mixing order (see Mixing) up to the first
        that would repeat a window of its source, each source's windows in stream order. They depend
        on the weights and the W_s only, not on the batch: the same at every data-parallel size."""
        keys = [(np.arange(num) + 0.5) / w for num, w in zip(self.num_windows, self.weights, strict=True)]
        # The first repeat: the smallest (key, source) among each source's window number W_s.
        firsts = [((num + 0.5) / w, s) for s, (num, w) in enumerate(zip(self.num_windows, self.weights, strict=True))]
        limit, first = min(firsts)
        source_N = np.concatenate([np.full(len(k), s) for s, k in enumerate(keys)])
        window_N, key_N = np.concatenate([np.arange(len(k)) for k in keys]), np.concatenate(keys)
        order = np.lexsort((source_N, key_N))  # by key, then by source, as the mixing order
        key_O, source_O = key_N[order], source_N[order]
        order = order[(key_O < limit) | ((key_O == limit) & (source_O < first))]
        return source_N[order], window_N[order]

    def eval_batches(self, max_windows: int | None = None
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """As ``TokenLoader.eval_batches``, over the first ``max_windows`` of ``eval_samples``."""
        source_N, window_N = self.eval_samples()
        num = len(source_N) if max_windows is None else min(max_windows, len(source_N))
        for rows_B, valid_B in eval_rows(num, local_batch_size=self.local_batch_size, dp_rank=self.dp_rank,
                                         dp_size=self.dp_size):
            chunk_BS1 = torch.from_numpy(np.stack([self._read_window(int(source_N[i]), int(window_N[i]))
                                                   for i in rows_B]))
            yield chunk_BS1[:, :-1].contiguous(), chunk_BS1[:, 1:].contiguous(), torch.from_numpy(valid_B)

    def metrics(self) -> dict:
        """Input tokens drawn from each source so far (whole steps), by source name."""
        return {"source_tokens": {n: int(c) * self.seq_len for n, c in zip(self.names, self._consumed, strict=True)}}

    def _sources_state(self) -> list[dict]:
        return [{"name": n, "weight": float(w), "num_windows": int(num)}
                for n, w, num in zip(self.names, self.weights, self.num_windows, strict=True)]

    def state_dict(self) -> dict:
        """The position (windows taken per source, micro-batch) plus what must match on resume."""
        return {"consumed": [int(c) for c in self._consumed], "step": self.step, "micro": self._micro,
                "micro_steps": self.micro_steps, "seed": self.seed, "shuffle": self.shuffle,
                "seq_len": self.seq_len, "global_batch_size": self.global_batch_size,
                "sources": self._sources_state()}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s position: the next batches equal those the saved loader would give.

        dp_size/dp_rank and micro_steps may differ from the saved run's (between steps); the
        sources (names, weights, sizes), seed, sequence length and global batch may not.
        """
        current = {**self.state_dict(), "sources": self._sources_state()}
        for key in ("seed", "shuffle", "seq_len", "global_batch_size", "sources"):
            if state.get(key) != current[key]:
                raise ValueError(f"cannot resume the {self.name} loader: saved {key} ({state.get(key)!r}) "
                                 f"differs from this run's ({current[key]!r}); the data or batch settings "
                                 "changed since the checkpoint")
        consumed = state.get("consumed")
        if not (isinstance(consumed, list) and len(consumed) == len(self.files)
                and all(isinstance(c, int) and c >= 0 for c in consumed)
                and sum(consumed) % self.global_batch_size == 0):
            raise ValueError(f"loader state consumed ({consumed!r}) must be {len(self.files)} ints >= 0 "
                             f"summing to a multiple of the global batch ({self.global_batch_size})")
        micro = resumed_micro(state, micro_steps=self.micro_steps, name=self.name)
        self._consumed = np.asarray(consumed, dtype=np.int64)
        self._micro, self._plan = micro, None
