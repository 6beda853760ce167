"""``checkpoint.init_from`` under ``--shrink auto``: the job's export cut to the shrunk model's shapes,
so that every layout still starts from the export through the trainer's loader.

The shrunk model has the job's experts, router and structure at smaller widths and depth. Each of
its tensors is the leading block of the export's tensor of the same role (``t[:n0, :n1, ...]``):
the first rows of the vocabulary, the first channels of every width, every expert (their number is
kept). Block ``i`` of the shrunk model takes the export's block of the same kind (dense or MoE) in
the same order: the shrunk model's first MoE block is the export's first MoE block, whatever the
export's leading dense blocks. A cut model is not the job's model (its outputs are not the
export's), but it starts from the export's weights, scales and router statistics rather than from
train.seed, and the loader shards them at each layout exactly as it would the full export.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from moetrain.config.convert import config_to_dict
from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig

PLACEHOLDER = "WORK/init_from"
"""checkpoint.init_from of a shrunk job until the verification's folder is known: the cut export
is written to ``WORK/init_from`` before the first run."""

_BLOCK = re.compile(r"^layers\.(\d+)\.")


def source_blocks(shrunk: ModelConfig, original: ModelConfig) -> dict[int, int]:
    """Block of the shrunk model -> block of the export's model it is cut from: the k-th dense
    (or MoE) block of one is the k-th dense (or MoE) block of the other."""
    kinds = {kind: [j for j in range(original.num_layers) if original.is_moe_layer(j) == kind]
             for kind in (False, True)}
    taken = {False: 0, True: 0}
    out = {}
    for i in range(shrunk.num_layers):
        kind = shrunk.is_moe_layer(i)
        if taken[kind] >= len(kinds[kind]):
            raise ValueError(f"checkpoint.init_from: the export's model has {len(kinds[kind])} "
                             f"{'MoE' if kind else 'dense'} blocks, the shrunk job needs more")
        out[i] = kinds[kind][taken[kind]]
        taken[kind] += 1
    return out


def shrunk_vocab_size(job: JobConfig) -> int:
    """The shrunk job's vocabulary: the byte tokenizer's 256, else data.vocab_size (the BPE the
    shrink trains on the shipped corpus)."""
    return 256 if job.data.tokenizer == "bytes" else job.data.vocab_size


def cut_export(source: str | Path, *, job: JobConfig, original: ModelConfig, out_dir: Path) -> Path:
    """Write the export at ``source`` cut to ``job``'s model (module docstring) into ``out_dir``.
    ValueError, naming every tensor, when the export lacks one or holds one smaller than the cut."""
    from moetrain.interop.export import write_export
    from moetrain.models.transformer import Transformer
    from moetrain.utils.safetensors_io import SafetensorsFolder

    model_cfg = job.model.with_vocab_size(shrunk_vocab_size(job))
    with torch.device("meta"):  # names and shapes only
        model = Transformer(model_cfg, moe=job.moe if model_cfg.is_moe else None)
    blocks = source_blocks(model_cfg, original)
    src = SafetensorsFolder(source)
    out: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for name, target in model.state_dict().items():
        src_name = _BLOCK.sub(lambda m: f"layers.{blocks[int(m.group(1))]}.", name)
        if src_name not in src:
            problems.append(f"{src_name} missing")
            continue
        full = src.get(src_name)
        if full.dim() != target.dim() or any(n > m for n, m in zip(target.shape, full.shape, strict=True)):
            problems.append(f"{src_name}: shape {tuple(full.shape)} cannot be cut to {tuple(target.shape)}")
            continue
        out[name] = full[tuple(slice(0, n) for n in target.shape)].clone()
    if problems:
        more = f" (+{len(problems) - 4} more)" if len(problems) > 4 else ""
        raise ValueError(f"checkpoint.init_from ({str(source)!r}) cannot be cut to the shrunk job: "
                         f"{'; '.join(problems[:4])}{more}; verify it with --shrink none")
    config = config_to_dict(job)
    config["model"]["vocab_size"] = model_cfg.vocab_size
    return write_export(out_dir, config=config, state_dict=out, info={"source": str(source), "cut": "moetrain verify"})
