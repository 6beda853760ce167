"""A deterministic, rank-sharded, resumable loader over a flat token stream.

Shapes: ``G`` sequences per optimizer step over all ranks (the global batch), taken as ``A``
micro-batches (gradient accumulation) of ``B = G / (A * dp_size)`` sequences per rank; ``S`` = seq_len.

The stream of N tokens is cut into W = (N - 1) // S fixed windows; window w covers tokens
[w*S, w*S + S] (S + 1 tokens: inputs and the labels shifted by one, so neighbouring windows share one
token). Each epoch visits the windows in a permutation seeded by (seed, epoch), G at a time; the last
W mod G windows of an epoch are dropped so every step has a full global batch. At micro-batch j of
step t, rank r takes positions [t*G + j*G/A + r*B, ... + B) of the permutation. Hence:

- the ranks' batches are disjoint, and concatenated in rank order they are exactly the micro-batch
  that one process (dp_size=1, same seed, G and A) gets -- what the parity tests rely on;
- every step covers the same G windows whatever A and dp_size are, and the position (epoch, step)
  counts steps: a state saved at one data-parallel size resumes at another (elastic restarts),
  the accumulation absorbing the difference, with the same global batches from there on.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


def check_batch_geometry(*, seq_len: int, global_batch_size: int, micro_steps: int, dp_rank: int, dp_size: int,
                         seed: int) -> None:
    """The loader arguments' rules (shared by every loader), as ValueErrors naming the argument."""
    for field, value in (("seq_len", seq_len), ("global_batch_size", global_batch_size),
                         ("micro_steps", micro_steps), ("dp_size", dp_size)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{field} ({value!r}) must be an int >= 1")
    if global_batch_size % (micro_steps * dp_size):
        raise ValueError(f"global_batch_size ({global_batch_size}) must be divisible by "
                         f"micro_steps * dp_size ({micro_steps} * {dp_size})")
    if not (isinstance(dp_rank, int) and 0 <= dp_rank < dp_size):
        raise ValueError(f"dp_rank ({dp_rank!r}) must be in [0, dp_size={dp_size})")
    if not (isinstance(seed, int) and seed >= 0):
        raise ValueError(f"seed ({seed!r}) must be an int >= 0")


def resumed_micro(state: dict, *, micro_steps: int, name: str) -> int:
    """The micro-batch a saved loader state stopped at (the rule shared by every loader): a state
    between steps resumes at any accumulation, one in the middle of a step only at its own."""
    micro = state.get("micro", 0)
    if micro != 0 and state.get("micro_steps") != micro_steps:
        raise ValueError(f"cannot resume the {name} loader: saved in the middle of a step (micro-batch "
                         f"{micro} of {state.get('micro_steps')}); only a state between steps resumes at "
                         f"another accumulation ({micro_steps} micro-batches per step now)")
    return micro


def eval_rows(num_windows: int, *, local_batch_size: int, dp_rank: int, dp_size: int
              ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(window numbers [B], valid [B]) of this rank for each global batch over windows
    [0, num_windows) in order: global batches of ``local_batch_size * dp_size``, rank r taking rows
    [r * B, (r + 1) * B). The last one may be partial: its rows past the end repeat window 0, marked
    invalid, so that every rank runs the same number of forwards (their collectives pair up)."""
    step = local_batch_size * dp_size
    for start in range(0, num_windows, step):
        rows_B = start + dp_rank * local_batch_size + np.arange(local_batch_size)
        valid_B = rows_B < num_windows
        yield np.where(valid_B, rows_B, 0), valid_B


class TokenLoader:
    """Batches of (input_ids, labels), int64 tensors [B, S], from ``tokens``.

    Args:
        tokens: the token stream [N] (a numpy array or memmap of unsigned ints).
        seq_len: S, tokens per sequence.
        global_batch_size: G, sequences per optimizer step summed over the data-parallel ranks.
        micro_steps: A, micro-batches per step (gradient accumulation); A * dp_size must divide G.
        dp_rank, dp_size: this rank and the data-parallel degree.
        seed: seeds the epoch permutations (ignored when ``shuffle`` is False).
        shuffle: False visits windows in stream order (validation: the same batches every time);
            such a loader needs one window, not one global batch, and with fewer only evaluates.
        name: "train" / "val", for messages.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, global_batch_size: int, micro_steps: int = 1,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, shuffle: bool = True,
                 name: str = "train") -> None:
        check_batch_geometry(seq_len=seq_len, global_batch_size=global_batch_size, micro_steps=micro_steps,
                             dp_rank=dp_rank, dp_size=dp_size, seed=seed)
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.micro_steps = micro_steps
        self.micro_batch_size = global_batch_size // micro_steps
        """Sequences of one micro-batch over all ranks."""
        self.local_batch_size = self.micro_batch_size // dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.name = name
        self.num_windows = max(len(tokens) - 1, 0) // seq_len
        self.steps_per_epoch = self.num_windows // global_batch_size
        self._step_error: str | None = None
        if self.steps_per_epoch == 0:
            # An unshuffled (validation) loader evaluates through eval_batches, which pads a partial
            # batch: one window is enough, so a split that evaluates at dp 1 does at any dp.
            short = f"the {name} split has {len(tokens)} tokens = {self.num_windows} windows of data.seq_len={seq_len}"
            batch = f"fewer than one global batch of {global_batch_size}"
            advice = "; use more data, a smaller batch or seq_len" + (", or a larger data.val_fraction"
                                                                      if name == "val" else "")
            if shuffle or self.num_windows == 0:
                raise ValueError(f"{short}, {batch if shuffle else 'not one window'}{advice}")
            self._step_error = f"{short}, {batch}"
        self._epoch = 0
        self._step = 0
        self._micro = 0
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    def __len__(self) -> int:
        """Steps per epoch."""
        return self.steps_per_epoch

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step(self) -> int:
        """Steps taken in the current epoch."""
        return self._step

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """Window indices [W] in the order epoch ``epoch`` visits them."""
        if not self.shuffle:
            return np.arange(self.num_windows)
        if self._order is None or self._order_epoch != epoch:
            # SeedSequence mixes (seed, epoch) into independent streams: seed s epoch 1 and seed s+1
            # epoch 0 do not share an order.
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._order, self._order_epoch = rng.permutation(self.num_windows), epoch
        return self._order

    def _batch(self, epoch: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        start = step * self.global_batch_size + micro * self.micro_batch_size + self.dp_rank * self.local_batch_size
        windows_B = self._epoch_order(epoch)[start:start + self.local_batch_size]
        offsets_BS1 = windows_B[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        # Fancy indexing reads just these B*(S+1) tokens from the memmap.
        chunk_BS1 = torch.from_numpy(np.asarray(self.tokens[offsets_BS1], dtype=np.int64))
        return chunk_BS1[:, :-1].contiguous(), chunk_BS1[:, 1:].contiguous()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch (input_ids [B, S], labels [B, S]); rolls over into the next
        step after ``micro_steps`` of them, and into the next epoch after its last step."""
        if self._step_error is not None:
            raise ValueError(f"{self._step_error} (this loader only evaluates: eval_batches)")
        batch = self._batch(self._epoch, self._step, self._micro)
        self._micro += 1
        if self._micro < self.micro_steps:
            return batch
        self._micro, self._step = 0, self._step + 1
        if self._step == self.steps_per_epoch:
            self._epoch, self._step = self._epoch + 1, 0
        return batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless: the trainer decides when to stop."""
        while True:
            yield self.next_batch()

    def eval_batches(self, max_windows: int | None = None
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(input_ids [B, S], labels [B, S], valid [B] bool) over the first ``max_windows`` windows
        of the stream (all of them when None), in ``eval_rows``' batches of this loader's
        micro-batch. The same windows at every data-parallel size: nothing of the tail is dropped,
        and the caller weighs each row by its validity."""
        num = self.num_windows if max_windows is None else min(max_windows, self.num_windows)
        for windows_B, valid_B in eval_rows(num, local_batch_size=self.local_batch_size, dp_rank=self.dp_rank,
                                            dp_size=self.dp_size):
            offsets_BS1 = self._epoch_order(0)[windows_B][:, None] * self.seq_len + np.arange(self.seq_len + 1)
            chunk_BS1 = torch.from_numpy(np.asarray(self.tokens[offsets_BS1], dtype=np.int64))
            yield chunk_BS1[:, :-1].contiguous(), chunk_BS1[:, 1:].contiguous(), torch.from_numpy(valid_B)

    def metrics(self) -> dict:
        """Loader figures for the metrics log: none for a single stream (a mixture reports the
        tokens drawn from each source)."""
        return {}

    def state_dict(self) -> dict:
        """The global position plus what must match on resume (plain ints/bools)."""
        return {"epoch": self._epoch, "step": self._step, "micro": self._micro, "micro_steps": self.micro_steps,
                "seed": self.seed, "shuffle": self.shuffle,
                "seq_len": self.seq_len, "global_batch_size": self.global_batch_size,
                "num_windows": self.num_windows}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s position: the next batches equal those the saved loader would give.

        dp_size/dp_rank and micro_steps may differ from the saved run's (between steps); the data,
        seed, sequence length and global batch may not.
        """
        for key in ("seed", "shuffle", "seq_len", "global_batch_size", "num_windows"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"cannot resume the {self.name} loader: saved {key} ({state.get(key)!r}) "
                                 f"differs from this run's ({getattr(self, key)!r}); the data or "
                                 "batch settings changed since the checkpoint")
        epoch, step = state["epoch"], state["step"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(step, int)
                and 0 <= step < self.steps_per_epoch):
            raise ValueError(f"loader state epoch ({epoch!r}) / step ({step!r}) must be ints with "
                             f"epoch >= 0 and 0 <= step < {self.steps_per_epoch}")
        micro = resumed_micro(state, micro_steps=self.micro_steps, name=self.name)
        self._epoch, self._step, self._micro = epoch, step, micro
