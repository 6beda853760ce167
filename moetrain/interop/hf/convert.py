"""Streaming conversion between Hugging Face folders and moetrain exports, both ways.

    import_hf(HF_DIR, OUT)        config.json + safetensors (per-expert or fused, one file or an
                                  index of shards) -> a moetrain export (model.safetensors + config.yaml),
                                  with HF_DIR's tokenizer.json and the files beside it, where
                                  ``moetrain generate OUT`` reads them
    export_hf(SRC, OUT)           a run, checkpoint or export -> config.json + safetensors that
                                  ``AutoModelForCausalLM.from_pretrained(OUT)`` loads, and the run's
                                  tokenizer files that ``AutoTokenizer.from_pretrained(OUT)`` loads

Every output tensor is planned first (name, shape, dtype: the safetensors headers come before
the data), then computed and written one at a time from lazily read inputs: memory holds one
output tensor and its inputs, at most one layer's expert stack (``benchmarks/hf_convert_memory.py``
measures it). Nothing from a checkpoint is executed: safetensors and JSON only, no pickle, no
``trust_remote_code``.

Every tensor is accounted for: an import lists every HF tensor with no moetrain place and every
one it needs but lacks, and checks the result against the model the configs build (names and
shapes, on the meta device); an export refuses moetrain state the family cannot hold.

Shape legend: E experts, D model dim, F expert hidden dim.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.data.tokenizer import SAVED_TOKENIZER, PretrainedTokenizer, load_saved_tokenizer, save_tokenizer
from moetrain.interop.export import (
    check_output_folder,
    export_metadata,
    model_configs,
    open_source,
    source_folder,
    write_config_yaml,
)
from moetrain.interop.hf.family import Copy, Entry, Family, has_fused_experts
from moetrain.interop.hf.registry import choose_family, family_of, hf_fingerprint, read_hf_config
from moetrain.interop.sources import CheckpointTensors, ExportTensors
from moetrain.utils.files import atomic_path, atomic_write_text
from moetrain.utils.safetensors_io import ShardedWriter, TensorSpec

RECORD = "moetrain_conversion.json"
"""What an export to Hugging Face cast and kept, written beside its config.json."""

Job = tuple[TensorSpec, Callable[[], torch.Tensor]]
TensorSource = ExportTensors | CheckpointTensors


@dataclass
class ConversionReport:
    out: Path
    family: str
    layout: str
    """"per-expert" or "fused"."""
    num_tensors: int
    num_bytes: int
    files: list[str]
    cast: list[str] = field(default_factory=list)
    """Tensors written in another dtype than their source's."""
    kept_fp32: list[str] = field(default_factory=list)
    """fp32 tensors a lower-precision conversion left in fp32: buffers (the router's selection
    bias) and what the family keeps in fp32 (``Family.keep_fp32``)."""
    tokenizer_files: list[str] = field(default_factory=list)
    """The tokenizer files a conversion wrote (also in ``files``)."""
    no_tokenizer: str = ""
    """Why a conversion wrote none, for the user who expects ``AutoTokenizer`` (export) or
    ``moetrain generate`` (import) to find one."""

    def lines(self) -> list[str]:
        out = [(f"{self.family} ({self.layout} experts): {self.num_tensors} tensors, {self.num_bytes / 2**20:.1f} MiB "
                f"in {len(self.files)} file(s) under {self.out}")]
        if self.cast:
            out.append(f"cast {len(self.cast)} tensors to the export dtype; kept in fp32: "
                       + (", ".join(self.kept_fp32) if self.kept_fp32 else "none"))
        if self.tokenizer_files:
            out.append(f"tokenizer files: {', '.join(self.tokenizer_files)}")
        elif self.no_tokenizer:
            out.append(f"no tokenizer files: {self.no_tokenizer}")
        return out


def _listed(names, what: str) -> list[str]:
    names = sorted(names)
    if not names:
        return []
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    return [f"{what}: {shown}"]


def model_state_specs(model: ModelConfig, moe: MoEConfig) -> tuple[dict[str, tuple], dict[str, torch.dtype]]:
    """``({name: shape} of the state dict, {name: dtype} of its persistent buffers)`` of the model
    the configs build, from a meta-device instance (no memory, no init)."""
    from moetrain.models.transformer import Transformer

    with torch.device("meta"):
        net = Transformer(model, moe=moe if model.is_moe else None)
    shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    params = {id(p) for p in net.parameters()}
    buffers = {k: v.dtype for k, v in net.state_dict(keep_vars=True).items() if id(v) not in params}
    return shapes, buffers


# --- HF -> moetrain ---------------------------------------------------------------------------------


def _import_jobs(entries: list[Entry], src: ExportTensors, dtype_of: Callable[[str], torch.dtype]) -> list[Job]:
    jobs: list[Job] = []
    for entry in entries:
        if isinstance(entry, Copy):
            if entry.load:
                spec = TensorSpec(entry.mt, src.shape(entry.hf), dtype_of(entry.mt))
                jobs.append((spec, partial(_read, src, entry.hf, spec.dtype, swap_halves=entry.swap_halves)))
            continue
        gate, up, down = entry.proj
        E = entry.num_experts
        if entry.fused:
            _, F2, D = src.shape(f"{entry.hf}.gate_up_proj")  # [E, 2F, D]: gate rows, then up rows
            F = F2 // 2
            halves = {"w1": slice(0, F), "w3": slice(F, F2)}
            for w in ("w1", "w3"):
                spec = TensorSpec(f"{entry.mt}.{w}", (E, D, F), dtype_of(f"{entry.mt}.{w}"))
                jobs.append((spec, partial(_read_swapped, src, f"{entry.hf}.gate_up_proj", spec.dtype, rows=halves[w])))
            spec = TensorSpec(f"{entry.mt}.w2", (E, F, D), dtype_of(f"{entry.mt}.w2"))
            jobs.append((spec, partial(_read_swapped, src, f"{entry.hf}.down_proj", spec.dtype)))
            continue
        F, D = src.shape(f"{entry.hf}.0.{gate}.weight")  # nn.Linear [out, in]
        for w, proj, shape in (("w1", gate, (E, D, F)), ("w3", up, (E, D, F)), ("w2", down, (E, F, D))):
            spec = TensorSpec(f"{entry.mt}.{w}", shape, dtype_of(f"{entry.mt}.{w}"))
            names = [f"{entry.hf}.{i}.{proj}.weight" for i in range(entry.num_experts)]
            jobs.append((spec, partial(_stack_transposed, src, names, spec.dtype)))
    return jobs


# Readers of one job each (bound with partial): a tensor is read only when the writer reaches it.

def _read(src: TensorSource, name: str, dtype: torch.dtype, *, swap_halves: bool = False) -> torch.Tensor:
    """``swap_halves``: the two halves of the last dim trade places (``Copy.swap_halves``)."""
    t = src.get(name)
    if swap_halves:
        first, second = t.chunk(2, dim=-1)
        t = torch.cat([second, first], dim=-1)
    return t.to(dtype)


def _read_swapped(src: TensorSource, name: str, dtype: torch.dtype, *, rows: slice = slice(None)) -> torch.Tensor:
    """``[E, A, B]`` (rows ``rows`` of dim 1) as ``[E, B, A]``: the fused HF expert layout <-> moetrain's."""
    return src.get(name)[:, rows, :].transpose(1, 2).to(dtype)


def _stack_transposed(src: TensorSource, names: list[str], dtype: torch.dtype) -> torch.Tensor:
    """Per-expert nn.Linear weights ``[out, in]`` stacked as ``[E, in, out]``."""
    return torch.stack([src.get(name).t().to(dtype) for name in names])


def _fuse_gate_up(src: TensorSource, w1: str, w3: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([src.get(w1).transpose(1, 2), src.get(w3).transpose(1, 2)], dim=1).to(dtype)


def _expert_linear(src: TensorSource, name: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``expert`` of a stacked ``[E, in, out]`` weight as an nn.Linear weight ``[out, in]``."""
    return src.get_rows(name, expert, expert + 1)[0].t().to(dtype)


def _hf_names(entries: list[Entry], *, loaded_only: bool = False) -> list[str]:
    out = []
    for entry in entries:
        if isinstance(entry, Copy):
            if entry.load or not loaded_only:
                out.append(entry.hf)
        else:
            out.extend(entry.hf_names())
    return out


def _check_hf_names(family: Family, hf: dict, src: ExportTensors, entries: list[Entry], model: ModelConfig) -> None:
    """ValueError naming every missing and unexpected HF tensor of ``family``'s model of ``hf``
    (config.json) and ``model``."""
    wanted = set(_hf_names(entries, loaded_only=True))
    present = set(src.names())
    # Copies of other tensors (DeepSeek's MTP embedding and head) and rotary tables are not read.
    ignored = set(_hf_names(entries)) - wanted | {n for n in present if n.endswith("rotary_emb.inv_freq")}
    if model.tie_embeddings:
        ignored.add("lm_head.weight")  # transformers may write the tied copy too
    problems = (_listed(wanted - present, "tensors it lacks")
                + _listed(present - wanted - ignored, "tensors with no moetrain place"))
    if problems:
        raise ValueError(f"{str(src.folder)!r} does not hold the {family.title} model its config.json describes: "
                         + "; ".join(problems))


def _check_against_model(jobs: list[Job], shapes: dict[str, tuple], what: str) -> None:
    planned = {spec.name: spec.shape for spec, _ in jobs}
    reshaped = [f"{n} {planned[n]} vs {shapes[n]}" for n in planned if n in shapes and planned[n] != shapes[n]]
    problems = (_listed(set(shapes) - set(planned), "moetrain tensors it does not fill")
                + _listed(set(planned) - set(shapes), "tensors the moetrain model lacks")
                + _listed(reshaped, "tensors of another shape"))
    if problems:
        raise ValueError(f"{what} does not match the moetrain model its configs build: " + "; ".join(problems))


def _write(out: Path, jobs: list[Job], *, metadata: dict, max_shard_bytes: int | None) -> list[Path]:
    with ShardedWriter(out, [spec for spec, _ in jobs], metadata=metadata, max_shard_bytes=max_shard_bytes) as w:
        for spec, produce in jobs:
            w.write(spec.name, produce())
        return w.close()


def import_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
              max_shard_bytes: int | None = None) -> ConversionReport:
    """``moetrain convert --from-hf HF_DIR --to OUT``: the family comes from config.json's
    ``model_type``. Parameters are written in ``dtype`` (fp32 by default: moetrain trains fp32
    master weights), except fp32 ones the family keeps in fp32 (``Family.keep_fp32``); buffers keep
    the model's dtype (the fp32 selection bias). The tokenizer goes
    with them where there is a tokenizer.json (``_import_tokenizer``)."""
    hf_dir = Path(hf_dir)
    hf = read_hf_config(hf_dir)
    check_output_folder(hf_dir, out_dir, "--to")
    family = family_of(hf)
    model, moe = family.configs_from_hf(hf)
    src = ExportTensors(hf_dir)
    model = family.fit_to_tensors(model, hf, set(src.names()))
    fused = has_fused_experts(src.names())
    entries = family.tensor_map(model, moe, fused=fused)
    _check_hf_names(family, hf, src, entries, model)
    shapes, buffers = model_state_specs(model, moe)
    fp32 = _kept_in_fp32(family, entries, lambda e: src.dtype(e.hf))
    jobs = _import_jobs(entries, src, lambda name: torch.float32 if name in fp32 else buffers.get(name, dtype))
    _check_against_model(jobs, shapes, f"{str(hf_dir)!r}")
    out = Path(out_dir)
    info = {"source": str(hf_dir), "hf_family": family.model_type, "source_fingerprint": hf_fingerprint(hf_dir)}
    files = _write(out, jobs, metadata=export_metadata(info), max_shard_bytes=max_shard_bytes)
    tokenizer_files, no_tokenizer = _import_tokenizer(hf_dir, out)
    # config.yaml last: an export folder with one is complete.
    write_config_yaml(out, {"model": _plain(model), "moe": _plain(moe)}, info)
    return ConversionReport(out=out, family=family.title, layout="fused" if fused else "per-expert",
                            num_tensors=len(jobs), num_bytes=sum(s.nbytes for s, _ in jobs),
                            files=[p.name for p in files] + tokenizer_files, tokenizer_files=tokenizer_files,
                            no_tokenizer=no_tokenizer,
                            kept_fp32=[] if dtype == torch.float32 else sorted(
                                s.name for s, _ in jobs if s.dtype == torch.float32))


def _kept_in_fp32(family: Family, entries: list[Entry], source_dtype: Callable[[Copy], torch.dtype]) -> set[str]:
    """moetrain names of the tensors ``family`` keeps in fp32 (``Family.keep_fp32``) that are fp32
    in the source (``source_dtype`` of their entry)."""
    return {e.mt for e in entries if isinstance(e, Copy) and e.hf.endswith(family.keep_fp32)
            and source_dtype(e) == torch.float32}


def _import_tokenizer(hf_dir: Path, out: Path) -> tuple[list[str], str]:
    """``hf_dir``'s tokenizer saved into the export ``out`` as a run saves its own (``save_tokenizer``:
    tokenizer.json and the files beside it byte for byte), where ``moetrain generate`` and
    ``load_saved_tokenizer`` find it with the same ids and end-of-text id; ``(files written, why
    none)``. An end-of-text id named only by hf_dir's config.json (not copied: the export has
    config.yaml) is written into tokenizer_config.json. A tokenizer moetrain cannot read is left
    behind with the reason: the weights convert without it."""
    path = hf_dir / SAVED_TOKENIZER
    tokenizer, why = None, ""
    if not path.is_file():
        unread = [n for n in ("tokenizer.model", "vocab.json", "merges.txt") if (hf_dir / n).is_file()]
        why = (f"{str(hf_dir)!r} has no tokenizer.json"
               + (f" (only {', '.join(unread)}, which moetrain does not read)" if unread else "")
               + ": moetrain generate needs --tokenizer PATH/tokenizer.json")
    else:
        try:
            tokenizer = PretrainedTokenizer.from_file(path)
        except ValueError as e:
            why = f"{e}: moetrain generate needs --tokenizer PATH/tokenizer.json"
    # With None, a tokenizer.json an earlier conversion left in ``out`` is removed, not read as this model's.
    return save_tokenizer(tokenizer, out, durable=True), why


def _plain(cfg) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}


# --- moetrain -> HF ---------------------------------------------------------------------------------


def _export_jobs(entries: list[Entry], src: TensorSource, dtype_of: Callable[[str], torch.dtype]) -> list[Job]:
    jobs: list[Job] = []
    for entry in entries:
        if isinstance(entry, Copy):
            if entry.export:
                spec = TensorSpec(entry.hf, src.shape(entry.mt), dtype_of(entry.mt))
                jobs.append((spec, partial(_read, src, entry.mt, spec.dtype, swap_halves=entry.swap_halves)))
            continue
        E, D, F = src.shape(f"{entry.mt}.w1")
        dts = {w: dtype_of(f"{entry.mt}.{w}") for w in ("w1", "w3", "w2")}
        if entry.fused:
            assert dts["w1"] == dts["w3"], "gate and up stacks of one layer in different dtypes"
            jobs.append((TensorSpec(f"{entry.hf}.gate_up_proj", (E, 2 * F, D), dts["w1"]),
                         partial(_fuse_gate_up, src, f"{entry.mt}.w1", f"{entry.mt}.w3", dts["w1"])))
            jobs.append((TensorSpec(f"{entry.hf}.down_proj", (E, D, F), dts["w2"]),
                         partial(_read_swapped, src, f"{entry.mt}.w2", dts["w2"])))
            continue
        for i in range(E):
            for w, proj, shape in (("w1", entry.proj[0], (F, D)), ("w3", entry.proj[1], (F, D)),
                                   ("w2", entry.proj[2], (D, F))):
                jobs.append((TensorSpec(f"{entry.hf}.{i}.{proj}.weight", shape, dts[w]),
                             partial(_expert_linear, src, f"{entry.mt}.{w}", i, dts[w])))
    return jobs


def _mt_names(entries: list[Entry]) -> set[str]:
    return {n for e in entries for n in ([e.mt] if isinstance(e, Copy) else e.mt_names())}


def export_hf(source: str | os.PathLike, out_dir: str | os.PathLike, *, family: str | None = None,
              fused: bool = False, dtype: torch.dtype | None = None,
              max_shard_bytes: int | None = None) -> ConversionReport:
    """``moetrain convert SRC --to-hf OUT``: the family the run's config can be expressed in
    (``family`` names one where several could), per-expert tensors unless ``fused``. ``dtype``
    casts every tensor except the fp32 buffers (the router's selection bias, which bf16 would
    round) and the fp32 tensors the family keeps in fp32 (DeepSeek-V3's router, as transformers
    does); None keeps the source dtypes."""
    config, src, _ = open_source(source)
    check_output_folder(source, out_dir, "--to-hf", writes="hf")
    model, moe = model_configs(config)
    fam = choose_family(model, moe, family)
    hf_config = fam.hf_config_from(model, moe)
    entries = fam.tensor_map(model, moe, fused=fused)
    wanted, present = _mt_names(entries), set(src.names())
    problems = (_listed(wanted - present, "tensors it lacks")
                + _listed(present - wanted, f"tensors {fam.title} has no place for"))
    if problems:
        raise ValueError(f"{str(source)!r} cannot be written as {fam.title}: " + "; ".join(problems))
    _, buffers = model_state_specs(model, moe)
    fp32 = set(buffers) | _kept_in_fp32(fam, entries, lambda e: src.dtype(e.mt))
    cast, kept = [], []

    def dtype_of(name: str) -> torch.dtype:
        have = src.dtype(name)
        if dtype is None or not have.is_floating_point or have == dtype:
            return have
        if name in fp32 and have == torch.float32:
            kept.append(name)
            return have
        cast.append(name)
        return dtype

    jobs = _export_jobs(entries, src, dtype_of)
    bulk = Counter(s.dtype for s, _ in jobs if s.dtype.is_floating_point).most_common(1)
    hf_config["dtype"] = hf_config["torch_dtype"] = str(bulk[0][0] if bulk else torch.float32).removeprefix("torch.")
    out = Path(out_dir)
    files = _write(out, jobs, metadata={"format": "pt"}, max_shard_bytes=max_shard_bytes)
    tokenizer_files = _copy_tokenizer(config, source, out, hf_config)
    atomic_write_text(out / "config.json", json.dumps(hf_config, indent=2, sort_keys=True) + "\n", durable=True)
    report = ConversionReport(out=out, family=fam.title, layout="fused" if fused else "per-expert",
                              num_tensors=len(jobs), num_bytes=sum(s.nbytes for s, _ in jobs),
                              files=[p.name for p in files] + tokenizer_files, cast=sorted(set(cast)),
                              kept_fp32=sorted(set(kept)), tokenizer_files=tokenizer_files,
                              no_tokenizer="" if tokenizer_files else _why_no_tokenizer(config))
    record = {"source": str(source), "family": fam.model_type, "layout": report.layout,
              "dtype": hf_config["dtype"], "cast": report.cast, "kept_fp32": report.kept_fp32}
    atomic_write_text(out / RECORD, json.dumps(record, indent=2) + "\n", durable=True)
    return report


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
"""The files of a Hugging Face tokenizer folder that travel with an export."""


def _copy_tokenizer(config: dict, source: str | os.PathLike, out: Path, hf_config: dict) -> list[str]:
    """The run's tokenizer as Hugging Face tokenizer files in ``out``; the files written.

    A run that tokenised with a Hugging Face ``tokenizer.json`` (``--init-from-hf``) goes back with
    it: the tokenizer files beside it are copied, and the special-token ids of the config.json
    beside it (the model it came from) are written into ``hf_config``. Otherwise the tokenizer the
    run saved beside its config.yaml (a trained BPE: ``save_tokenizer``) is copied and its
    end-of-text id written. None for the byte tokenizer, which has no tokenizer.json."""
    tokenizer = str((config.get("data") or {}).get("tokenizer") or "")
    if tokenizer.endswith(".json") and Path(tokenizer).is_file():
        copied = _copy_tokenizer_files(Path(tokenizer), out)
        if (Path(tokenizer).parent / "config.json").is_file():
            origin = json.loads((Path(tokenizer).parent / "config.json").read_text())
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if origin.get(key) is not None:
                    hf_config[key] = origin[key]
        return copied
    folder = source_folder(source)
    saved = load_saved_tokenizer(folder) if folder is not None else None
    if folder is None or saved is None:
        return []
    copied = _copy_tokenizer_files(folder / SAVED_TOKENIZER, out)
    if saved.eos_id is not None:  # transformers' generate stops on the config's eos_token_id
        hf_config["eos_token_id"] = saved.eos_id
    return copied


def _copy_tokenizer_files(tokenizer: Path, out: Path) -> list[str]:
    """``tokenizer`` and the TOKENIZER_FILES beside it, copied byte for byte into ``out``."""
    copied = []
    for name in TOKENIZER_FILES:
        src = tokenizer if name == "tokenizer.json" else tokenizer.parent / name
        if src.is_file():
            with atomic_path(out / name, durable=True) as tmp:
                tmp.write_bytes(src.read_bytes())
            copied.append(name)
    return copied


def _why_no_tokenizer(config: dict) -> str:
    if "data" not in config:
        return ("the source has no data config and no tokenizer.json beside its config.yaml (imported from a "
                "Hugging Face folder without one?): copy its tokenizer files")
    if (config["data"] or {}).get("tokenizer") == "bytes":
        return "the byte tokenizer (ids 0-255 are the UTF-8 bytes) has no tokenizer.json"
    return "the run saved no tokenizer.json beside its config.yaml (pre-tokenised data, or an older run)"
