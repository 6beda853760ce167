"""The checkpoint folder and the checkpoints a job names, checked once by the launcher before
``--nproc N`` starts its ranks: a folder that cannot be written, a path that does not exist, or a
checkpoint of another model is then one line of the command rather than the same error raised by
every rank under torchrun's traceback. The ranks check again (``prepare_checkpoint_folder``,
``Checkpointer.resume``, ``load_initial_weights``): a job started by torchrun itself has no
launcher, and the folder may change in between."""

from __future__ import annotations

from pathlib import Path

from moetrain.config import JobConfig
from moetrain.config.checkpoint import checkpoint_folder
from moetrain.config.loader import config_to_dict
from moetrain.train.checkpoint.files import checkpoint_dir_error, latest_checkpoint, resolve_checkpoint
from moetrain.train.checkpoint.index import read_trainer_state
from moetrain.train.checkpoint.same_model import check_same_model
from moetrain.utils.safetensors_io import SafetensorsFolder


def check_job_checkpoints(cfg: JobConfig) -> None:
    """Raise a ValueError when the checkpoint folder cannot be written, when ``checkpoint.init_from``
    is not an export folder, when ``checkpoint.resume`` names a path that holds no checkpoint, or
    when the checkpoint the run would resume from holds another model (``same_model``)."""
    _check_named_checkpoints(cfg)
    # Last: it creates the folder's parents (the run folder), which a job refused for another reason
    # should not leave behind.
    error = checkpoint_dir_error(checkpoint_folder(cfg.log.run_dir, cfg.checkpoint.dir))
    if error is not None:
        raise ValueError(error)


def _check_named_checkpoints(cfg: JobConfig) -> None:
    c = cfg.checkpoint
    if c.init_from is not None:
        if not Path(c.init_from).is_dir():
            raise ValueError(f"checkpoint.init_from ({c.init_from!r}) must be a moetrain export folder "
                             "(moetrain export / moetrain convert --from-hf writes one)")
        SafetensorsFolder(c.init_from)  # names what the folder lacks
    if c.resume == "never":
        return
    found = (latest_checkpoint(checkpoint_folder(cfg.log.run_dir, c.dir)) if c.resume == "auto"
             else resolve_checkpoint(c.resume))
    if found is None:
        return
    saved = read_trainer_state(found)
    saved_config = saved.get("config") if isinstance(saved, dict) else None
    new = config_to_dict(cfg)
    if new["model"].get("vocab_size") is None and isinstance(saved_config, dict):
        # The ranks resolve it from the tokenizer (and compare it then); here only what the job sets.
        new["model"]["vocab_size"] = (saved_config.get("model") or {}).get("vocab_size")
    check_same_model(found, saved_config, new, moe=cfg.model.is_moe)
