"""A trained model ready to generate: the model of a run folder, checkpoint or moetrain export
(whatever parallel layout wrote it: ``load_source`` assembles full tensors), made dropless, and the
tokenizer it was trained with. ``moetrain generate`` decodes with it
(``moetrain.train.generation.generate``).

A model trained with a capacity factor generates dropless: capacity drops depend on every token of
a forward, later positions included, so they are not causal and no token-by-token decoding can
reproduce a full forward's; a token-choice router without a capacity is per token, so cached and
uncached decoding agree. An expert-choice model is refused: its experts pick tokens from the whole
batch.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from moetrain.config.convert import build_section
from moetrain.config.data import DataConfig
from moetrain.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer, load_saved_tokenizer
from moetrain.interop.export import build_model, load_source, model_configs, source_folder
from moetrain.models.transformer import Transformer


def load_generation_model(source: str) -> tuple[Transformer, dict]:
    """The model of ``source`` (fp32, CPU) and its config, made dropless (module docstring); a
    model that cannot generate is refused before any tokenizer work."""
    config, state_dict, _ = load_source(source)
    model_cfg, moe_cfg = model_configs(config)
    if model_cfg.is_moe and moe_cfg.capacity_factor is not None and not moe_cfg.is_expert_choice:
        print(f"moetrain generate: moe.capacity_factor {moe_cfg.capacity_factor} -> None: generation routes "
              "dropless (capacity drops look at later positions)", file=sys.stderr)
        config = {**config, "moe": {**config["moe"], "capacity_factor": None, "dynamic_capacity": False}}
        # The dynamic factor's buffer exists only with a capacity; it holds no weight.
        state_dict = {k: v for k, v in state_dict.items() if not k.endswith(".capacity_factor_now")}
    model = build_model(config, state_dict)
    model.check_generative()
    return model, config


def load_tokenizer(config: dict, tokenizer: str | None, *, source: str) -> Tokenizer:
    """``tokenizer`` (a tokenizer.json path or "bytes"), else the run's own: the tokenizer.json saved
    beside the config.yaml of ``source`` (its run folder or export; no corpus needed), else the
    one the data section names: "bytes" by name, any other prepared from the run's corpus (a
    run saved before runs carried their tokenizer)."""
    if tokenizer is not None:
        if tokenizer != "bytes" and not tokenizer.endswith(".json"):
            raise ValueError(f'--tokenizer ({tokenizer!r}) must be a tokenizer.json or "bytes"')
        if tokenizer != "bytes" and not Path(tokenizer).is_file():
            raise ValueError(f"--tokenizer ({tokenizer!r}) does not exist")
        return build_tokenizer(tokenizer)
    folder = source_folder(source)
    saved = load_saved_tokenizer(folder) if folder is not None else None
    if saved is not None:
        return saved
    if "data" not in config:
        raise ValueError(f"{source!r} holds no data config and no tokenizer.json (a Hugging Face model imported "
                         "without one?): pass --tokenizer PATH/tokenizer.json")
    if (config["data"] or {}).get("tokenizer") == "bytes":
        return ByteTokenizer()
    from moetrain.data.prepare import prepare_data

    # A BPE is read from the data cache (trained and cached on first use).
    data = prepare_data(build_section(DataConfig, "data", config["data"]))
    if data.tokenizer is None:
        raise ValueError(f"{source!r} trained on pre-tokenised data (no tokenizer): pass --tokenizer "
                         "PATH/tokenizer.json")
    return data.tokenizer


def apply_document_mask(model: Transformer, config: dict, tokenizer: Tokenizer) -> None:
    """A model trained with ``data.document_mask`` attends within each document, split at the end-of-text
    id of its data's tokenizer, which the trainer resolves when it builds the model and the saved
    config does not hold: the same separator here, so that a prompt or continuation holding one
    is read as in training."""
    data = config.get("data") or {}
    if data.get("document_mask") and model.config.document_separator is None and tokenizer.eos_id is not None:
        model.config = dataclasses.replace(model.config, document_separator=tokenizer.eos_id)


def require_vocab(tokenizer: Tokenizer, model: Transformer) -> None:
    if tokenizer.vocab_size > model.config.resolved_vocab_size:
        raise ValueError(f"the tokenizer's vocab_size ({tokenizer.vocab_size}) must be <= model.vocab_size "
                         f"({model.config.resolved_vocab_size}): it is not the tokenizer this model was trained with")
