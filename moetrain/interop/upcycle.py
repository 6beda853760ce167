"""Sparse upcycling: a dense Hugging Face model (Llama, Qwen3) becomes a moetrain MoE whose experts
all start as its dense FFN.

    moetrain upcycle --from-hf DENSE_DIR --num-experts E --top-k K --to DIR
                     [--granularity G] [--noise STD] [--seed S] [--moe-every N] [--moe-layer-offset O]

Every block that ``--moe-every`` / ``--moe-layer-offset`` select (default: all) trades its SwiGLU
MLP (``gate``/``up`` ``[F, D]``, ``down`` ``[D, F]``) for E experts of hidden F/G and a router;
the other blocks, the attention, norms and embeddings are copied. Expert ``e = c * G + g`` (copy
c = 0..E/G-1, slice g = 0..G-1) holds hidden units ``g * F/G .. (g + 1) * F/G`` of the dense MLP:

    w1[e] = gate[slice g].T     w3[e] = up[slice g].T     w2[e] = G * down[:, slice g].T

The router ``[E, D]`` is drawn normal(model.init_std) from ``(seed, name)``, one row per copy,
repeated for the G slices of that copy ("virtual groups"). Gates are renormalised top-K
(``moe.renormalize``), dropless (``moe.capacity_factor`` None), no shared experts.

Identity (noise 0): the output equals the dense FFN's, up to rounding, whatever the router.
G = 1: every expert is the dense FFN and the K renormalised weights sum to 1. G > 1: the G slices
of a copy have equal router rows, so equal scores; the top K = G * K' are K' whole copies (tied
scores rank next to each other), each slice of copy c gets the weight p_c / (G * S) (S the sum of
the chosen copies' p), and since SwiGLU acts on each hidden unit alone, the dense FFN is the sum of
its G slices: sum over c, g of p_c / (G * S) * G * slice_g(x) = sum over c of p_c / S * FFN(x) =
FFN(x). The factor G on ``down`` is what cancels the 1/G each slice's weight carries. Hence K
must be >= 2 at G = 1: at top_k 1 moetrain keeps the raw router probability (``moe.renormalize``
acts from K = 2, so that the router keeps a gradient), which would scale the FFN by p < 1.

``noise`` adds ``noise * std(w) * N(0, 1)`` to every expert tensor ``w`` (std of that expert's
slice, drawn per tensor from ``(seed, name)``): the experts start apart and the identity holds
only approximately. Without noise they drift apart in training as the router sends them
different tokens.

Streamed like ``moetrain convert --from-hf``: the header is planned first, then one output
tensor at a time is computed from lazily read inputs; the largest is one layer's expert stack
``[E, D, F/G]`` (E/G times a dense MLP weight). DENSE_DIR's tokenizer.json and the files beside it
are saved into the export as ``convert --from-hf`` saves them (the end-of-text id kept), so
``moetrain generate DIR`` reads it and a run starts with

    moetrain train --config DIR/config.yaml --checkpoint.init_from=DIR --data.tokenizer=DIR/tokenizer.json ...

Shape legend: E experts, D model dim, F dense hidden dim, f = F/G expert hidden dim.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.interop.export import check_output_folder, export_metadata, write_config_yaml
from moetrain.interop.hf.convert import (
    Job,
    _check_against_model,
    _check_hf_names,
    _import_jobs,
    _import_tokenizer,
    _plain,
    _write,
    model_state_specs,
)
from moetrain.interop.hf.family import Copy
from moetrain.interop.hf.registry import family_of, read_hf_config
from moetrain.interop.sources import ExportTensors
from moetrain.utils.safetensors_io import TensorSpec
from moetrain.utils.seeds import seeded_generator

_FFN = re.compile(r"layers\.(\d+)\.feed_forward\.(w[123])\.weight")


@dataclass
class UpcycleReport:
    out: Path
    family: str
    moe_layers: list[int]
    num_experts: int
    top_k: int
    granularity: int
    expert_hidden_dim: int
    num_tensors: int
    num_bytes: int
    files: list[str]
    tokenizer_files: list[str] = field(default_factory=list)
    no_tokenizer: str = ""
    """Why no tokenizer was saved into the export (``convert``'s ``_import_tokenizer``)."""

    def lines(self) -> list[str]:
        split = (f", each dense FFN cut into {self.granularity} slices of hidden {self.expert_hidden_dim}"
                 if self.granularity > 1 else "")
        size = f"{self.num_tensors} tensors, {self.num_bytes / 2**20:.1f} MiB in {len(self.files)} file(s)"
        out = [f"{self.family}: MoE blocks {self.moe_layers}, {self.num_experts} experts top-{self.top_k}{split}",
               f"{size} under {self.out}"]
        if self.tokenizer_files:
            out.append(f"tokenizer files: {', '.join(self.tokenizer_files)}")
        elif self.no_tokenizer:
            out.append(f"no tokenizer files: {self.no_tokenizer}")
        return out


def upcycle_configs(dense: ModelConfig, *, num_experts: int, top_k: int, granularity: int = 1, moe_every: int = 1,
                    moe_layer_offset: int = 0) -> tuple[ModelConfig, MoEConfig]:
    """The model and moe sections of the upcycled model; one ValueError naming every option that
    breaks a rule (the rules between options are checked once each option is valid on its own)."""
    F, G = dense.resolved_dense_hidden_dim, granularity
    rules = [
        (isinstance(G, int) and G >= 1, "--granularity", G, "must be an int >= 1"),
        (isinstance(num_experts, int) and num_experts >= 1, "--num-experts", num_experts, "must be an int >= 1"),
        (isinstance(top_k, int) and top_k >= 2, "--top-k", top_k,
         ("must be >= 2: at top_k 1 moetrain keeps the raw router probability (moe.renormalize acts from 2, so "
          "that the router keeps a gradient), which would scale the dense FFN by p < 1")),
        (isinstance(moe_every, int) and moe_every >= 1, "--moe-every", moe_every, "must be an int >= 1"),
        (isinstance(moe_layer_offset, int) and 0 <= moe_layer_offset < dense.num_layers, "--moe-layer-offset",
         moe_layer_offset, f"must be in [0, {dense.num_layers}) (the model's blocks)"),
    ]
    bad = [f"{name} ({value!r}) {rule}" for ok, name, value, rule in rules if not ok]
    if not bad:
        rules = [
            (top_k <= num_experts, "--top-k", top_k, f"must be <= --num-experts ({num_experts})"),
            (F % G == 0, "--granularity", G, f"must divide the dense FFN's hidden size ({F})"),
            (num_experts % G == 0, "--num-experts", num_experts,
             f"must be a multiple of --granularity ({G}): E / G copies of the G slices"),
            (top_k % G == 0, "--top-k", top_k,
             f"must be a multiple of --granularity ({G}): a token takes whole copies (all G slices of each)"),
        ]
        bad = [f"{name} ({value!r}) {rule}" for ok, name, value, rule in rules if not ok]
    if bad:
        raise ValueError("cannot upcycle: " + "; ".join(bad))
    model = dataclasses.replace(dense, moe_every=moe_every, moe_layer_offset=moe_layer_offset, dense_hidden_dim=F)
    moe = MoEConfig(num_experts=num_experts, top_k=top_k, expert_hidden_dim=F // G, activation="swiglu",
                    capacity_factor=None, renormalize=True, router_init_std=dense.init_std, num_shared_experts=0)
    return model, moe


def _generator(seed: int, name: str) -> torch.Generator:
    return seeded_generator(f"upcycle/{seed}/{name}")


def _router(name: str, moe: MoEConfig, dim: int, *, granularity: int, seed: int) -> torch.Tensor:
    """``[E, D]``: one normal row per copy, repeated for its G slices (equal scores)."""
    rows_CD = torch.empty(moe.num_experts // granularity, dim).normal_(0.0, moe.router_init_std,
                                                                       generator=_generator(seed, name))
    return rows_CD.repeat_interleave(granularity, dim=0)


def _experts(name: str, dense: torch.Tensor, *, down: bool, num_experts: int, granularity: int, noise: float,
             seed: int) -> torch.Tensor:
    """The stacked expert tensor of one projection: ``[E, D, f]`` from a gate/up weight
    ``dense [F, D]``, or ``[E, f, D]`` (times G) from the down weight ``dense [D, F]``."""
    G = granularity
    w_FD = dense.float().t() if down else dense.float()
    slices_GfD = w_FD.reshape(G, w_FD.shape[0] // G, w_FD.shape[1])
    if down:
        slices_GfD = slices_GfD * G  # cancels the 1/G gate weight of each slice (module docstring)
    base = slices_GfD if down else slices_GfD.transpose(1, 2)  # [G, f, D] or [G, D, f]
    stack = base.repeat(num_experts // G, 1, 1)  # expert c * G + g = slice g
    if noise > 0:
        std_E = stack.flatten(1).std(dim=1)
        # In place (the stack is a fresh copy): memory holds the stack and its noise, no more.
        stack += torch.randn(stack.shape, generator=_generator(seed, name)).mul_(noise * std_E[:, None, None])
    return stack


def _moe_jobs(layer: int, src: ExportTensors, hf_of: dict[str, str], model: ModelConfig, moe: MoEConfig, *,
              granularity: int, noise: float, seed: int, dtype: torch.dtype) -> list[Job]:
    """The router and the three expert stacks of MoE block ``layer``, from its dense MLP
    (``hf_of``: moetrain name -> HF name of the dense model's tensors)."""
    mt = f"layers.{layer}.feed_forward"
    D, E, f = model.dim, moe.num_experts, moe.expert_hidden_dim
    kw: dict[str, Any] = {"num_experts": E, "granularity": granularity, "noise": noise, "seed": seed}
    router = f"{mt}.router.gate.weight"
    jobs: list[Job] = [(TensorSpec(router, (E, D), dtype), lambda: _router(router, moe, D, granularity=granularity,
                                                                           seed=seed).to(dtype))]
    for w, shape in (("w1", (E, D, f)), ("w3", (E, D, f)), ("w2", (E, f, D))):
        name = f"{mt}.experts.{w}"
        jobs.append((TensorSpec(name, shape, dtype), partial(_expert_stack, name, src, hf_of[f"{mt}.{w}.weight"],
                                                             down=w == "w2", dtype=dtype, **kw)))
    return jobs


def _expert_stack(name: str, src: ExportTensors, dense_name: str, *, down: bool, dtype: torch.dtype,
                  **kw: Any) -> torch.Tensor:
    """One job of ``_moe_jobs``: the stack ``name`` from the dense tensor ``dense_name``, read when written."""
    return _experts(name, src.get(dense_name), down=down, **kw).to(dtype)


def upcycle_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, num_experts: int, top_k: int,
               granularity: int = 1, noise: float = 0.0, seed: int = 0, moe_every: int = 1, moe_layer_offset: int = 0,
               dtype: torch.dtype = torch.float32, max_shard_bytes: int | None = None) -> UpcycleReport:
    """``moetrain upcycle``: write the MoE upcycled from the dense model in ``hf_dir`` as a
    moetrain export in ``out_dir`` (see the module docstring)."""
    if not (isinstance(noise, (int, float)) and math.isfinite(noise) and noise >= 0):
        raise ValueError(f"cannot upcycle: --noise ({noise!r}) must be a finite number >= 0 (a fraction of each "
                         "expert tensor's std)")
    hf_dir = Path(hf_dir)
    hf = read_hf_config(hf_dir)
    check_output_folder(hf_dir, out_dir, "--to")
    family = family_of(hf)
    dense, neutral = family.configs_from_hf(hf)
    if dense.is_moe:
        raise ValueError(f"--from-hf ({str(hf_dir)!r}) is a {family.title} model (model_type {family.model_type!r}), "
                         "already an MoE: upcycle takes a dense llama or qwen3 model (moetrain experts grow adds "
                         "experts to an MoE)")
    model, moe = upcycle_configs(dense, num_experts=num_experts, top_k=top_k, granularity=granularity,
                                 moe_every=moe_every, moe_layer_offset=moe_layer_offset)
    src = ExportTensors(hf_dir)
    entries = family.tensor_map(dense, neutral, fused=False)
    _check_hf_names(family, hf, src, entries, dense)
    shapes, buffers = model_state_specs(model, moe)
    hf_of = {e.mt: e.hf for e in entries if isinstance(e, Copy)}
    jobs: list[Job] = []
    for spec, produce in _import_jobs(entries, src, lambda name: buffers.get(name, dtype)):
        m = _FFN.fullmatch(spec.name)
        if m is None or not model.is_moe_layer(int(m[1])):
            jobs.append((spec, produce))
        elif m[2] == "w1":  # once per MoE block, where its dense MLP was
            jobs += _moe_jobs(int(m[1]), src, hf_of, model, moe, granularity=granularity, noise=noise, seed=seed,
                              dtype=dtype)
    _check_against_model(jobs, shapes, f"the model upcycled from {str(hf_dir)!r}")
    out = Path(out_dir)
    info = {"source": str(hf_dir), "upcycled_from": family.model_type, "granularity": granularity,
            "noise": noise, "seed": seed}
    files = _write(out, jobs, metadata=export_metadata(info), max_shard_bytes=max_shard_bytes)
    tokenizer_files, no_tokenizer = _import_tokenizer(hf_dir, out)
    # config.yaml last: an export folder with one is complete.
    write_config_yaml(out, {"model": _plain(model), "moe": _plain(moe)}, info)
    return UpcycleReport(out=out, family=family.title, moe_layers=model.moe_layer_ids, num_experts=num_experts,
                         top_k=top_k, granularity=granularity, expert_hidden_dim=moe.expert_hidden_dim,
                         num_tensors=len(jobs), num_bytes=sum(s.nbytes for s, _ in jobs),
                         files=[p.name for p in files], tokenizer_files=tokenizer_files,
                         no_tokenizer=no_tokenizer)
