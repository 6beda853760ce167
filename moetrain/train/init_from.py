"""Start a run from the weights of a moetrain export (``checkpoint.init_from``): continued
pre-training or fine-tuning of a converted Hugging Face model at any parallel layout.

``load_initial_weights(model, path)`` runs on every rank after ``parallelize`` (and after the
model's own init, which it overwrites). Each tensor is read alone from the export's safetensors
(no pickle, no memory map of the whole file) and copied into its parameter or buffer; a DTensor
(experts sharded over ep, FSDP2 shards over dp) receives only its own shard, cut locally from the
full tensor every rank has read (``src_data_rank=None``: no communication). Memory holds one full
tensor at a time.

Before anything is copied the export is compared with the model: one ValueError lists every
missing, unexpected and mis-shaped name. Each tensor keeps its model dtype (``copy_`` casts): an
fp32 buffer (the router's selection bias) stays fp32 whatever the export stored.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from moetrain.models.lora import is_lora_name
from moetrain.utils.safetensors_io import SafetensorsFolder


def _listed(names, what: str) -> list[str]:
    names = sorted(names)
    if not names:
        return []
    return [f"{what}: " + ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")]


HEAD_NAMES = ("output.weight", "pool_query")
"""The task head's tensors: the output layer (an LM's vocabulary logits or a classifier's classes) and the
attention-pooling query. ``new_head`` leaves them out of the load on both sides."""

MTP_PREFIX = "mtp."
"""The multi-token prediction modules (``model.mtp_depth``): like the head they only train the language model,
so ``new_head`` leaves an export's out of the load when the model has none (a classifier)."""

NGRAM_NAME = "ngram_embeddings.weight"
"""The hashed n-gram table (``model.ngram_buckets``): loaded when the export has it; with ``new_head`` an
export without it (a language model's: they have none) leaves the classifier's zero table to train."""


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer by state-dict name; a tied weight under each name."""
    return dict(model.state_dict(keep_vars=True))


@torch.no_grad()
def load_initial_weights(model: nn.Module, path: str | os.PathLike, *, new_head: bool = False) -> int:
    """Copy the export at ``path`` into ``model`` (plain or parallelized: pass the unwrapped
    module whose state-dict names are moetrain's). Returns the number of tensors copied.
    ``new_head``: the head (``HEAD_NAMES``) keeps the model's own values and the export's is not read, nor
    are the export's multi-token modules (``MTP_PREFIX``) when the model has none; an n-gram table the
    export lacks (``NGRAM_NAME``) keeps its own too."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint.init_from ({str(path)!r}) must be a moetrain export folder (moetrain export / "
                         "moetrain convert --from-hf writes one)")
    src = SafetensorsFolder(path)
    targets = _targets(model)
    saved = set(src.names())
    if new_head:
        if any(t is targets.get("tok_embeddings.weight") for n, t in targets.items() if n in HEAD_NAMES):
            raise ValueError("checkpoint.init_from_new_head (True) cannot start a head tied to the token "
                             "embeddings fresh: set model.tie_embeddings=false, or load the head")
        targets = {n: t for n, t in targets.items() if n not in HEAD_NAMES}
        saved -= set(HEAD_NAMES)
        if not any(n.startswith(MTP_PREFIX) for n in targets):
            saved = {n for n in saved if not n.startswith(MTP_PREFIX)}
    # LoRA adapters added for fine-tuning are new: they keep their own init when the export lacks them.
    fresh = {NGRAM_NAME} if new_head else set()
    problems = (_listed({n for n in set(targets) - saved if not is_lora_name(n) and n not in fresh}, "missing")
                + _listed(saved - set(targets), "not in this model")
                + _listed([f"{n} (export {src.info(n).shape}, model {tuple(t.shape)})" for n, t in targets.items()
                           if n in saved and src.info(n).shape != tuple(t.shape)], "of another shape"))
    if problems:
        raise ValueError(f"checkpoint.init_from ({str(path)!r}) does not match the model: " + "; ".join(problems)
                         + ". Was it exported from a model with other model/moe settings?")
    done: set[int] = set()
    for name, target in targets.items():
        if id(target) in done or name not in saved:
            continue  # a tied weight (the same tensor under a second name), or a fresh adapter
        done.add(id(target))
        full = src.get(name)
        if isinstance(target, DTensor):
            full = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        target.copy_(full)
    return len(done)
