"""Reading routing traces (written by :mod:`moetrain.train.routing_trace`, which describes the
format): the index and its layouts, one step's rank files, and the per-expert and per-rank loads the
report (``rank_load.png``, ``routing_straggler.json``) and the skew planner take from them.

Shape legend: S recorded steps, L MoE layers, E experts, R ranks of a step's layout, G expert-parallel
groups, P ranks of an ep group, T tokens, K experts per token.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

from moetrain.utils.safetensors_io import DTYPES, read_header

TRACE_DIR = "routing_trace"
INDEX = "index.json"
FORMAT = 1


def step_file(step: int, rank: int) -> str:
    return f"step_{step:08d}.rank{rank:05d}.safetensors"


def trace_folder(path: str | os.PathLike) -> Path:
    """The trace folder of a run folder or the trace folder itself."""
    p = Path(path)
    return p / TRACE_DIR if (p / TRACE_DIR / INDEX).is_file() else p


def read_index(path: str | os.PathLike) -> tuple[Path, dict]:
    folder = trace_folder(path)
    index_path = folder / INDEX
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"routing trace {str(index_path)!r}: cannot read its index ({e})") from e
    required = ("format", "mode", "layers", "num_experts", "top_k", "tokens_per_step", "world_size", "steps")
    missing = [k for k in required if k not in index]
    if missing or index["format"] != FORMAT:
        raise ValueError(f"routing trace {str(index_path)!r}: not a format-{FORMAT} index (missing {missing})")
    return folder, index


def layouts(index: dict) -> list[dict]:
    """The index's ``layouts``; an index written before they were recorded has one, from its top-level
    ``world_size`` and ``ep`` (etp 1)."""
    if index.get("layouts"):
        return index["layouts"]
    return [{"from_step": 1, "world_size": index["world_size"], "ep": max(int(index.get("ep", 1)), 1), "etp": 1}]


def step_layout(index: dict, step: int) -> dict:
    """The layout (``world_size``, ``ep``, ``etp``) that recorded ``step``."""
    found = layouts(index)
    return next((lay for lay in reversed(found) if lay["from_step"] <= step), found[0])


def read_tensor(info, path: Path) -> torch.Tensor:
    """The tensor ``info`` (from ``read_header``) of the file at ``path``, in a fresh buffer."""
    with open(path, "rb") as f:
        f.seek(info.start)
        buf = bytearray(f.read(info.end - info.start))
    if len(buf) != info.end - info.start:
        raise ValueError(f"moe.routing_replay: trace file {str(path)!r} is truncated")
    if not buf:
        return torch.empty(info.shape, dtype=info.dtype)
    assert info.dtype in DTYPES.values()
    return torch.frombuffer(buf, dtype=info.dtype).reshape(info.shape)


def load_step_ids(folder: Path, index: dict, step: int, layer_names: list[str], *, num_tokens: int,
                  num_experts: int) -> dict[str, torch.Tensor]:
    """The global ``[T, K]`` int64 ids of each layer at ``step``, from every rank file of the trace."""
    out = {n: torch.full((num_tokens, index["top_k"]), -1, dtype=torch.int64) for n in layer_names}
    for rank in range(step_layout(index, step)["world_size"]):
        path = folder / step_file(step, rank)
        tensors, _ = read_header(path)
        blocks_A2 = read_tensor(tensors["blocks"], path)
        for name in layer_names:
            ids_TK = read_tensor(tensors[f"ids.{name}"], path).long()
            if int(blocks_A2[:, 1].sum()) != ids_TK.shape[0] or int((blocks_A2[:, 0] + blocks_A2[:, 1]).max()) > \
                    num_tokens or int(blocks_A2.min()) < 0:
                raise ValueError(f"moe.routing_replay: trace file {str(path)!r}: its blocks do not place its "
                                 f"{ids_TK.shape[0]} tokens inside the {num_tokens} of a step")
            if ids_TK.numel() and (int(ids_TK.min()) < 0 or int(ids_TK.max()) >= num_experts):
                raise ValueError(f"moe.routing_replay: trace file {str(path)!r}: expert ids of {name} outside "
                                 f"[0, {num_experts})")
            offset = 0
            for start, length in blocks_A2.tolist():
                out[name][start:start + length] = ids_TK[offset:offset + length]
                offset += length
    for name, ids_TK in out.items():
        if bool((ids_TK < 0).any()):
            raise ValueError(f"moe.routing_replay: trace {str(folder)!r} step {step}: layer {name} has tokens that "
                             "no rank file covers")
    return out


def _rank_counts(folder: Path, index: dict, step: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(counts_RLE, held_RL)`` of ``step``: each rank's routed copies per layer and expert (from counts
    or ids) and whether its file holds the layer (a pipeline stage holds its own); None when a rank's
    file is missing or unreadable."""
    layers, num_experts = index["layers"], index["num_experts"]
    world = step_layout(index, step)["world_size"]
    counts_RLE = torch.zeros(world, len(layers), num_experts, dtype=torch.float64)
    held_RL = torch.zeros(world, len(layers), dtype=torch.bool)
    for rank in range(world):
        file = folder / step_file(step, rank)
        try:
            tensors, _ = read_header(file)
            for i, name in enumerate(layers):
                if (info := tensors.get(f"counts.{name}")) is not None:
                    counts_RLE[rank, i] = read_tensor(info, file).double()
                elif (info := tensors.get(f"ids.{name}")) is not None:
                    ids = read_tensor(info, file).long().reshape(-1)
                    counts_RLE[rank, i] = torch.bincount(ids, minlength=num_experts).double()
                else:
                    continue
                held_RL[rank, i] = True
        except (OSError, ValueError):
            return None
    return counts_RLE, held_RL


def _complete_steps(path: str | os.PathLike) -> tuple[dict, list[tuple[int, torch.Tensor, torch.Tensor]]]:
    """``(index, [(step, counts_RLE, held_RL)])`` of the listed steps whose every rank file reads. Rank 0
    lists a step once its own file is written, so the others' may still be missing (or a rank died):
    those steps are left out, with one warning naming them."""
    folder, index = read_index(path)
    found, incomplete = [], []
    for step in sorted(index["steps"]):
        got = _rank_counts(folder, index, step)
        if got is None:
            incomplete.append(step)
        else:
            found.append((step, *got))
    if incomplete:
        warnings.warn(f"routing trace {str(folder)!r}: steps {incomplete} left out: a rank file is missing or "
                      "unreadable (a rank still writing it, or one that stopped)", stacklevel=3)
    return index, found


def expert_loads(path: str | os.PathLike) -> tuple[list[int], list[str], torch.Tensor, dict]:
    """``(steps, layers, load_SLE, index)``: the routed copies (before capacity drops) each expert
    received at each recorded step, per MoE layer, over the global batch; from counts or ids."""
    index, found = _complete_steps(path)
    load_SLE = torch.zeros(len(found), len(index["layers"]), index["num_experts"], dtype=torch.float64)
    for s, (_, counts_RLE, _) in enumerate(found):
        load_SLE[s] = counts_RLE.sum(0)
    return [step for step, _, _ in found], index["layers"], load_SLE, index


def rank_loads(path: str | os.PathLike) -> tuple[list[int], list[str], torch.Tensor]:
    """``(steps, layers, load_SLGP)`` of a trace: the routed copies the experts of each expert-parallel
    rank received at each recorded step, per MoE layer, within each expert-parallel group. G groups:
    blocks of ``ep * etp`` consecutive ranks (the etp ranks of a block gather their tokens, so each of
    its ep groups sees the block's); P = ep ranks, rank p holding experts ``p * E/ep ... (p + 1) * E/ep
    - 1``, the order the expert-parallel sharding uses. NaN where a group does not exist at that step
    (a resume at another layout: G and P are the largest over the steps) or holds no copy of the layer
    (another pipeline stage's)."""
    index, found = _complete_steps(path)
    num_experts, num_layers = index["num_experts"], len(index["layers"])
    shapes = [_group_shape(step_layout(index, step)) for step, _, _ in found]
    max_g, max_p = max((g for g, _ in shapes), default=1), max((p for _, p in shapes), default=1)
    load_SLGP = torch.full((len(found), num_layers, max_g, max_p), float("nan"), dtype=torch.float64)
    for s, ((_, counts_RLE, held_RL), (groups, ep)) in enumerate(zip(found, shapes, strict=True)):
        block = counts_RLE.shape[0] // groups
        load_LGP = counts_RLE.view(groups, block, num_layers, ep, num_experts // ep).sum((1, 4)).permute(1, 0, 2)
        held_LG = held_RL.view(groups, block, num_layers).any(1).T
        load_SLGP[s, :, :groups, :ep] = torch.where(held_LG[..., None], load_LGP, float("nan"))
    return [step for step, _, _ in found], index["layers"], load_SLGP


def _group_shape(layout: dict) -> tuple[int, int]:
    """(groups, ep) of a layout: ``world_size / (ep * etp)`` blocks of consecutive ranks."""
    ep, block = layout["ep"], layout["ep"] * layout.get("etp", 1)
    return layout["world_size"] // block, ep


def straggler_factors(load: torch.Tensor, *, per_group: bool = False) -> torch.Tensor:
    """Max rank load / mean rank load over the last dim: how much longer the hottest rank's experts
    run than a balanced split would (1 = balanced). ``load``: ``[S, L, P]`` or ``[S, L, G, P]`` (NaN
    for a missing rank or group, see :func:`rank_loads`); the result ``[S, L]`` is the worst group's
    factor, or ``[S, L, G]`` (NaN for a missing group) with ``per_group``."""
    present = ~load.isnan()
    peak = load.nan_to_num(nan=float("-inf")).amax(-1)
    mean = load.nan_to_num(nan=0.0).sum(-1) / present.sum(-1).clamp(min=1)
    factor = torch.where(present.any(-1), peak / mean.clamp(min=1e-12), float("nan"))
    if per_group or factor.dim() == 2:
        return factor
    return factor.nan_to_num(nan=float("-inf")).amax(-1).nan_to_num(neginf=float("nan"))
