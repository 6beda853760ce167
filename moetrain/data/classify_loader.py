"""Deterministic, rank-sharded, resumable batches of padded classification examples.

Shapes: ``N`` examples of ``S`` tokens (right-padded), ``G`` examples per optimizer step over all
ranks, taken as ``A`` micro-batches of ``B = G / (A * dp_size)`` examples per rank.

Training (`ClassificationLoader`) follows ``TokenLoader``'s contract with examples in place of
windows: each epoch visits an order seeded by (seed, epoch), ``G`` at a time (the last ``N mod G`` are
dropped so every step is a full global batch); at micro-batch j of step t, rank r takes positions
[t*G + j*G/A + r*B, ... + B) of the order. The ranks' batches are disjoint and, concatenated in rank
order, equal the micro-batch one process gets; the position (epoch, step) counts optimizer steps, so a
state saved at one data-parallel size resumes at another on the same global batches. With balanced
sampling an epoch's order is N draws with replacement, each class equally likely. Token dropout
(an augmentation: each real token of a training example is deleted with probability p, the end token
kept, the rest shifted left and re-padded) draws from (seed, epoch, position in the epoch's order), so
an example is cut the same way whatever the layout, and a resumed run repeats it.

Evaluation (`eval_batches`) covers every example exactly once, in order: global batches of ``B *
dp_size``, rank r taking rows [r*B, (r+1)*B) of each; the last batch is filled with placeholder rows
whose ``valid_B`` is False. Every rank runs the same number of batches (the expert-parallel
all-to-all needs every rank in every forward).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from moetrain.data.loader import check_batch_geometry, resumed_micro


@dataclass
class EncodedSplit:
    """One split, tokenised and right-padded."""

    ids_NS: np.ndarray
    """Token ids [N, S], int32; positions past ``lengths_N`` hold the pad id."""
    lengths_N: np.ndarray
    """Real tokens of each example [N], int32, in [1, S]."""
    labels_N: np.ndarray
    """Class ids [N], int64."""
    pad_id: int = 0
    """The id right-padding fills in."""
    ends_with_end_token: bool = True
    """Whether each example's last real token is the tokenizer's end token (token dropout keeps it)."""

    def __len__(self) -> int:
        return len(self.labels_N)

    def rows(self, index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids [B, S] int64, labels [B] int64, padding_mask [B, S] bool, True = real token)."""
        ids_BS = torch.from_numpy(self.ids_NS[index].astype(np.int64))
        lengths_B = torch.from_numpy(self.lengths_N[index].astype(np.int64))
        mask_BS = torch.arange(ids_BS.shape[1])[None, :] < lengths_B[:, None]
        return ids_BS, torch.from_numpy(self.labels_N[index]), mask_BS


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class ClassificationLoader:
    """Training micro-batches (input_ids [B, S], labels [B], padding_mask [B, S]) of ``split``.

    Args:
        split: the encoded train split.
        global_batch_size: G; micro_steps: A; dp_rank, dp_size: this rank and the data-parallel degree.
        seed: seeds each epoch's order.
        balanced: draw classes equally often (with replacement) instead of a permutation.
        num_classes: C, for the balanced draw.
        token_dropout: p of the token dropout (0 = none).
    """

    def __init__(self, split: EncodedSplit, *, global_batch_size: int, micro_steps: int = 1, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, balanced: bool = False, num_classes: int = 0,
                 token_dropout: float = 0.0) -> None:
        check_batch_geometry(seq_len=split.ids_NS.shape[1], global_batch_size=global_batch_size,
                             micro_steps=micro_steps, dp_rank=dp_rank, dp_size=dp_size, seed=seed)
        self.split = split
        self.num_examples = len(split)
        self.seq_len = split.ids_NS.shape[1]
        self.global_batch_size, self.micro_steps = global_batch_size, micro_steps
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.micro_batch_size = global_batch_size // micro_steps
        self.local_batch_size = self.micro_batch_size // dp_size
        self.seed, self.balanced, self.token_dropout = seed, balanced, token_dropout
        self.steps_per_epoch = self.num_examples // global_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"the train split has {self.num_examples} examples, fewer than one global batch of "
                             f"{global_batch_size}; use a smaller train.global_batch_size")
        if balanced:
            counts_C = np.bincount(split.labels_N, minlength=num_classes)
            weight_N = 1.0 / counts_C[split.labels_N]
            self._p_N = weight_N / weight_N.sum()
        self._epoch = self._step = self._micro = 0
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    def __len__(self) -> int:
        return self.steps_per_epoch

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order_epoch != epoch:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            if self.balanced:
                self._order = rng.choice(self.num_examples, size=self.num_examples, replace=True, p=self._p_N)
            else:
                self._order = rng.permutation(self.num_examples)
            self._order_epoch = epoch
        return self._order

    def _batch(self, epoch: int, step: int, micro: int) -> Batch:
        start = step * self.global_batch_size + micro * self.micro_batch_size + self.dp_rank * self.local_batch_size
        ids_BS, labels_B, mask_BS = self.split.rows(self._epoch_order(epoch)[start:start + self.local_batch_size])
        if self.token_dropout > 0:
            self._drop_tokens(ids_BS, mask_BS, epoch=epoch, positions=range(start, start + self.local_batch_size))
        return ids_BS, labels_B, mask_BS

    def _drop_tokens(self, ids_BS: torch.Tensor, mask_BS: torch.Tensor, *, epoch: int, positions) -> None:
        """Token dropout in place (see the module docstring); at least one droppable token survives."""
        num_end = int(self.split.ends_with_end_token)
        for b, position in enumerate(positions):
            n = int(mask_BS[b].sum())
            droppable = n - num_end
            if droppable <= 1:
                continue
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch, position, 1])))
            keep = rng.random(droppable) >= self.token_dropout
            if not keep.any():
                keep[rng.integers(droppable)] = True
            kept = torch.cat([ids_BS[b, :droppable][torch.from_numpy(keep)], ids_BS[b, droppable:n]])
            ids_BS[b] = self.split.pad_id
            ids_BS[b, :len(kept)] = kept
            mask_BS[b] = torch.arange(ids_BS.shape[1]) < len(kept)

    def next_batch(self) -> Batch:
        """This rank's next micro-batch; rolls over into the next step after ``micro_steps`` of them and
        into the next epoch after its last step."""
        batch = self._batch(self._epoch, self._step, self._micro)
        self._micro += 1
        if self._micro == self.micro_steps:
            self._micro, self._step = 0, self._step + 1
            if self._step == self.steps_per_epoch:
                self._epoch, self._step = self._epoch + 1, 0
        return batch

    def state_dict(self) -> dict:
        """The global position plus what must match on resume (plain values)."""
        return {"epoch": self._epoch, "step": self._step, "micro": self._micro, "micro_steps": self.micro_steps,
                "seed": self.seed, "balanced": self.balanced, "token_dropout": self.token_dropout,
                "seq_len": self.seq_len,
                "global_batch_size": self.global_batch_size, "num_examples": self.num_examples}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s position (saved at any data-parallel size, between steps)."""
        for key in ("seed", "balanced", "token_dropout", "seq_len", "global_batch_size", "num_examples"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"cannot resume the classification loader: saved {key} ({state.get(key)!r}) differs "
                                 f"from this run's ({getattr(self, key)!r}); the data or batch settings changed")
        epoch, step = state["epoch"], state["step"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(step, int) and 0 <= step < self.steps_per_epoch):
            raise ValueError(f"loader state epoch ({epoch!r}) / step ({step!r}) must be ints with epoch >= 0 and "
                             f"0 <= step < {self.steps_per_epoch}")
        micro = resumed_micro(state, micro_steps=self.micro_steps, name="classification")
        self._epoch, self._step, self._micro = epoch, step, micro


def eval_batches(split: EncodedSplit, *, batch_size: int, dp_rank: int = 0, dp_size: int = 1
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids [B, S], labels [B], padding_mask [B, S], valid [B] bool) covering ``split`` once over
    all ranks; see the module docstring. Placeholder rows repeat example 0 and are not valid."""
    global_batch = batch_size * dp_size
    num_batches = -(-len(split) // global_batch)
    for b in range(num_batches):
        index_B = b * global_batch + dp_rank * batch_size + np.arange(batch_size)
        valid_B = index_B < len(split)
        ids_BS, labels_B, mask_BS = split.rows(np.where(valid_B, index_B, 0))
        yield ids_BS, labels_B, mask_BS, torch.from_numpy(valid_B)
