"""``moetrain train --init-from-hf HF_DIR``: continued pre-training or fine-tuning of a Hugging
Face model, at any parallel layout.

1. HF_DIR is converted once into a moetrain export cached under the run folder
   (``<log.run_dir>/hf_init``; reused while it was made from the same folder holding the same
   model, by ``hf_fingerprint``, so a resumed run does not convert again). Under torchrun the
   first process of each node converts, the others of that node wait for it.
2. The run's ``model`` and ``moe`` sections become the checkpoint's: every field of them, so the
   ``--config`` file's own model/moe values do not apply. Command-line overrides of those
   sections are allowed for training settings (``TRAINING_FIELDS``: capacity, balancing losses
   and their coefficients, routing noise, dispatch settings, ``max_seq_len``, ...) and must
   otherwise equal the checkpoint's value: a different ``--model.dim`` or ``--moe.top_k`` would
   contradict the weights, and is a ValueError naming the field and both values. Overrides of
   every other section (train, optim, data, parallel, ...) apply as usual.
3. ``checkpoint.init_from`` points at the export (the trainer loads it after building and
   sharding the model), and ``data.tokenizer`` at HF_DIR/tokenizer.json when there is one (a
   ``--data.tokenizer`` on the command line wins). A tokenizer.json is checked against the
   checkpoint: its vocabulary (added tokens included) must fit the embedding
   (``vocab_size``), and its end-of-text and the config's bos/eos/pad ids must lie inside it.

The run's saved config.yaml holds the resolved model/moe sections and ``checkpoint.init_from``:
``moetrain train --config RUN/config.yaml`` reproduces it without HF_DIR's conversion.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from moetrain.config.loader import load_config, parse_overrides
from moetrain.interop.export import CONFIG, check_output_folder, is_export
from moetrain.interop.hf.convert import import_hf
from moetrain.interop.hf.registry import hf_fingerprint, read_hf_config
from moetrain.interop.sources import ExportTensors

CACHE = "hf_init"
"""Folder of the converted checkpoint, under the run folder."""

TRAINING_FIELDS = {
    "model": {"max_seq_len", "init_std", "document_separator", "dropout", "mtp_loss_weight"},
    "moe": {"capacity_factor", "drop_policy", "aux_loss_coef", "z_loss_coef", "expert_impl", "dispatch_dedup",
            "dispatch_dtype", "dispatch_chunks", "router_bias_update_rate", "router_jitter", "router_noise_std",
            "force_balance", "aux_loss_type", "dynamic_capacity", "dynamic_capacity_base", "dynamic_capacity_scale",
            "dynamic_capacity_shift", "balance_interval", "expert_lr_scale_max", "collapse_threshold",
            "collapse_warmup_steps", "collapse_consecutive_checks", "collapse_aux_increase", "collapse_aux_max",
            "unused_expert_steps", "router_init_std", "routing_replay", "force_skew", "rebalance_every"},
}
"""model/moe fields a run from a Hugging Face checkpoint may set: they change how it trains, not
what its weights mean."""

_WAIT_S = 1800.0


def _run_dir(config: str | None, items: list) -> Path:
    for section, name, value in reversed(items):
        if (section, name) == ("log", "run_dir"):
            return Path(value)
    return Path(load_config(config).log.run_dir)


def _converted(export: Path, hf_dir: Path) -> bool:
    # config.yaml is written last: an export with one is complete. The fingerprint tells another
    # model saved at the same path since (whose old conversion would be trained from) from the same one.
    if not is_export(export):
        return False
    meta = ExportTensors(export).metadata
    return meta.get("source") == str(hf_dir) and meta.get("source_fingerprint") == hf_fingerprint(hf_dir)


def convert_once(hf_dir: Path, export: Path) -> None:
    """Convert ``hf_dir`` into ``export`` unless that was done: by this process, or (under
    torchrun, LOCAL_RANK > 0) by waiting for the node's first process to do it."""
    if _converted(export, hf_dir):
        return
    if int(os.environ.get("LOCAL_RANK", "0")) > 0:
        deadline = time.monotonic() + _WAIT_S
        while not _converted(export, hf_dir):
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {_WAIT_S:.0f} s for local rank 0 to convert {hf_dir} into {export}")
            time.sleep(1.0)
        return
    check_output_folder(hf_dir, export, f"the --init-from-hf conversion (log.run_dir/{CACHE})")
    (export / CONFIG).unlink(missing_ok=True)  # a stale conversion is incomplete until rewritten
    import_hf(hf_dir, export)


def check_tokenizer(tokenizer_path: str, hf: dict, hf_dir: Path) -> None:
    """The tokenizer against the checkpoint: ValueError for a vocabulary larger than the
    embedding, or a special-token id outside it."""
    from moetrain.data.tokenizer import PretrainedTokenizer

    tok = PretrainedTokenizer.from_file(tokenizer_path)
    vocab = int(hf["vocab_size"])
    if tok.vocab_size > vocab:
        raise ValueError(f"data.tokenizer ({tokenizer_path!r}) has {tok.vocab_size} tokens (added tokens included): "
                         f"more than the embedding of {hf_dir} holds (config.json vocab_size {vocab})")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = hf.get(key)
        for i in ids if isinstance(ids, list) else [ids]:
            if i is not None and not 0 <= int(i) < min(vocab, tok.vocab_size):
                raise ValueError(f"config.json {key} ({i}) of {hf_dir} is outside the vocabulary of {tokenizer_path!r} "
                                 f"({tok.vocab_size} tokens) or the embedding ({vocab} rows)")


def check_sliding_window(max_seq_len, hf: dict, hf_dir: Path) -> None:
    """The conversion caps ``max_seq_len`` at a sliding window, within which full causal attention
    is the same; a run raising it past the window would attend where the model never did."""
    window = hf.get("sliding_window")
    if max_seq_len is None or window is None or not hf.get("use_sliding_window", True):
        return
    if int(max_seq_len) > int(window):
        raise ValueError(f"--model.max_seq_len={max_seq_len} exceeds config.json sliding_window ({window}) of "
                         f"{hf_dir}: moetrain has no sliding-window attention, and past {window} tokens its full "
                         "attention differs from the model's")


def init_from_hf_overrides(hf_dir: str | os.PathLike, *, config: str | None, overrides: list[str]) -> list[str]:
    """The overrides that start the run of ``config`` + ``overrides`` from ``hf_dir`` (see the
    module docstring); the caller puts them before the user's ``overrides``."""
    hf_dir = Path(hf_dir).resolve()
    hf = read_hf_config(hf_dir)
    items = parse_overrides(overrides)
    export = _run_dir(config, items) / CACHE
    convert_once(hf_dir, export)
    sections = yaml.safe_load((export / CONFIG).read_text())
    user = {(s, n): v for s, n, v in items}
    out = []
    for section in ("model", "moe"):
        for name, value in sections[section].items():
            if (section, name) in user:
                given = user[(section, name)]
                if name not in TRAINING_FIELDS[section] and given != value:
                    allowed = ", ".join(sorted(TRAINING_FIELDS[section]))
                    raise ValueError(
                        f"--{section}.{name}={given!r} contradicts the Hugging Face checkpoint {hf_dir} "
                        f"({section}.{name} = {value!r}); only training settings may differ: {allowed}")
                continue
            text = value if isinstance(value, str) else json.dumps(value)
            out.append(f"--{section}.{name}={text}")
    check_sliding_window(user.get(("model", "max_seq_len")), hf, hf_dir)
    out.append(f"--checkpoint.init_from={export}")
    tokenizer = user.get(("data", "tokenizer"))
    if tokenizer is None and (hf_dir / "tokenizer.json").is_file():
        tokenizer = str(hf_dir / "tokenizer.json")
        out.append(f"--data.tokenizer={tokenizer}")
    if isinstance(tokenizer, str) and tokenizer.endswith(".json"):
        check_tokenizer(tokenizer, hf, hf_dir)
    return out
