"""Lazy tensor sources: the weights of a moetrain export folder or of a training checkpoint,
read one tensor at a time, so that an export or a conversion never holds the whole model.

Both answer ``names()``, ``shape(name)``, ``dtype(name)``, ``get(name)`` (the full tensor) and
``get_rows(name, start, stop)`` (rows of the first dim: one expert of a stacked ``[E, ...]``).
A LoRA fine-tuning run is seen through ``MergedLoRATensors``: its plain model, adapters merged.
A checkpoint is read through DCP, one entry per read: DCP assembles each full tensor from the
shards of whatever (world, ep, zero) layout wrote it, so expert e is the same tensor whichever
rank held it.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moetrain.config.finetune import FinetuneConfig
from moetrain.models.lora import is_lora_name, lora_pairs, merge_one
from moetrain.train.checkpoint.files import CheckpointError, verify_local
from moetrain.train.checkpoint.index import SafeReader, tensor_text
from moetrain.utils.safetensors_io import SafetensorsFolder


class ExportTensors(SafetensorsFolder):
    """A safetensors folder as a tensor source (an export, or a Hugging Face model folder)."""

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self.info(name).dtype


class CheckpointTensors:
    """The model tensors of one moetrain checkpoint (``model.<fqn>`` entries), read lazily in one
    process without a process group; ``trainer_state`` holds the step and the resolved config. A run
    with optim.ema_decay is read with its averaged weights (the ``ema.<fqn>`` entries, what it
    evaluated) in place of the raw ones."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        verify_local(self.path)  # sizes and sha256 of every file, before reading any
        metadata = SafeReader(self.path).read_metadata()
        entries = metadata.state_dict_metadata
        self._meta = {k[len("model."):]: md for k, md in entries.items()
                      if k.startswith("model.") and isinstance(md, TensorStorageMetadata)}
        self.averaged = {k[len("ema."):] for k in entries if k.startswith("ema.")} & set(self._meta)
        trainer_md = entries.get("trainer")
        if not isinstance(trainer_md, TensorStorageMetadata):  # absent, or not the tensor a trainer writes
            raise CheckpointError(f"checkpoint {str(self.path)!r} has no trainer entry")
        trainer = torch.empty(trainer_md.size, dtype=torch.uint8)
        self._load({"trainer": trainer})
        try:
            self.trainer_state = json.loads(tensor_text(trainer))
        except ValueError as e:
            raise CheckpointError(f"checkpoint {str(self.path)!r}: entry trainer is not JSON text ({e})") from e
        self._cached: dict[str, torch.Tensor] = {}

    def _load(self, state: dict) -> None:
        try:
            with warnings.catch_warnings():
                # "torch.distributed is ... uninitialized, assuming ... a single process": intended.
                warnings.filterwarnings("ignore", message="torch.distributed is", category=UserWarning)
                dcp.load(state, storage_reader=SafeReader(self.path), no_dist=True)
        except Exception as e:
            raise CheckpointError(f"reading checkpoint {str(self.path)!r} failed: {type(e).__name__}: {e}") from e

    def __contains__(self, name: str) -> bool:
        return name in self._meta

    def names(self) -> list[str]:
        return list(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._meta[name].size)

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name].properties.dtype

    CACHED = 3
    """Tensors kept, the most recently read: the per-expert export reads expert e of the gate, up and
    down stacks in turn for every e, so with fewer than 3 kept each read loads a whole stack again."""

    def get(self, name: str) -> torch.Tensor:
        if name in self._cached:
            self._cached[name] = self._cached.pop(name)  # most recent last
            return self._cached[name]
        tensor = torch.empty(self.shape(name), dtype=self.dtype(name))
        self._load({"ema" if name in self.averaged else "model": {name: tensor}})
        self._cached[name] = tensor
        while len(self._cached) > self.CACHED:
            del self._cached[next(iter(self._cached))]
        return tensor

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.get(name)[start:stop]


class MergedLoRATensors:
    """A LoRA fine-tuning run's tensors as its plain model's, still lazy: each adapted base weight
    is read with its two adapters and merged (``base + alpha / r * product``) when asked for, the
    adapters are not listed. Every pairing problem is reported when it is opened."""

    def __init__(self, src, finetune: FinetuneConfig) -> None:
        self._src, self._scale = src, finetune.scale
        self._pairs = lora_pairs({n: src.shape(n) for n in src.names()}, finetune)
        self._cached: tuple[str, torch.Tensor] | None = None

    def __contains__(self, name: str) -> bool:
        return name in self._src and not is_lora_name(name)

    def names(self) -> list[str]:
        return [n for n in self._src.names() if not is_lora_name(n)]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._src.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self._src.dtype(name)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._pairs:
            return self._src.get(name)
        if self._cached is None or self._cached[0] != name:
            a, b = self._pairs[name]
            base = self._src.get(name).clone()  # a checkpoint source keeps its reads: merge into a copy
            lora_a = self._src.get(a).clone()
            self._cached = (name, merge_one(name, base, lora_a, self._src.get(b), self._scale))
        return self._cached[1]

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name not in self._pairs:
            return self._src.get_rows(name, start, stop)
        return self.get(name)[start:stop]
