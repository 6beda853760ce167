"""The Hugging Face families moetrain converts, by ``config.json`` ``model_type``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.interop.hf.deepseek_v3 import DeepseekV3
from moetrain.interop.hf.family import Family
from moetrain.interop.hf.llama import Llama
from moetrain.interop.hf.mixtral import Mixtral
from moetrain.interop.hf.olmoe import Olmoe
from moetrain.interop.hf.qwen3 import Qwen3
from moetrain.interop.hf.qwen_moe import Qwen2Moe, Qwen3Moe

FAMILIES: dict[str, Family] = {f.model_type: f for f in (Mixtral(), Qwen2Moe(), Qwen3Moe(), Olmoe(), DeepseekV3(),
                                                         Llama(), Qwen3())}
"""model_type -> family, in the order ``choose_family`` lists them."""


def read_hf_config(hf_dir: str | Path) -> dict:
    """``hf_dir``'s config.json, with its family's ``hf_defaults`` for the keys it lacks."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{str(hf_dir)!r} has no config.json: not a Hugging Face model folder")
    try:
        hf = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{str(path)!r} is not JSON: {e}") from e
    if not isinstance(hf, dict):
        raise ValueError(f"{str(path)!r} is not a JSON object")
    return {**family_of(hf).hf_defaults, **hf}


def family_of(hf: dict) -> Family:
    """The family of a ``config.json`` (its ``model_type``, else its ``architectures``)."""
    kind = hf.get("model_type")
    if kind in FAMILIES:
        return FAMILIES[kind]
    archs = hf.get("architectures") or []
    for family in FAMILIES.values():
        if family.architecture in archs:
            return family
    raise ValueError(f"config.json model_type ({kind!r}, architectures {archs}) is not a family moetrain converts: "
                     f"{', '.join(FAMILIES)}")


def choose_family(model: ModelConfig, moe: MoEConfig, name: str | None = None) -> Family:
    """``name``'s family, or the one family that can express the configs; ValueError listing
    what each family lacks when none can, or the candidates when several can."""
    if name is not None:
        if name not in FAMILIES:
            raise ValueError(f"--family ({name!r}) must be one of {', '.join(FAMILIES)}")
        return FAMILIES[name]
    problems = {k: f.problems(model, moe) for k, f in FAMILIES.items()}
    fits = [k for k, p in problems.items() if not p]
    if len(fits) == 1:
        return FAMILIES[fits[0]]
    if fits:
        raise ValueError(f"this model can be written as any of {', '.join(fits)}: pass --family NAME")
    detail = "; ".join(f"{k}: {p[0]}" + (f" (and {len(p) - 1} more)" if len(p) > 1 else "")
                       for k, p in problems.items())
    raise ValueError(f"no Hugging Face family can express this model ({detail})")


def hf_fingerprint(hf_dir: str | Path) -> str:
    """sha256 of what identifies the model in ``hf_dir``: config.json and the weight index bytes,
    and each weight file's name, size and modification time (a model saved again at the same path
    changes them; hashing the weights themselves would read the whole checkpoint)."""
    folder = Path(hf_dir)
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
    for path in sorted(folder.glob("*.safetensors")):
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()
