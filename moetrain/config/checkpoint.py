"""Config of checkpointing: where, how often, how many to keep, and resuming."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moetrain.config._checks import require_bool, require_int
from moetrain.config.base import require


def checkpoint_folder(run_dir: str | Path, checkpoint_dir: str | None) -> Path:
    """Where a run's step checkpoints live: ``checkpoint.dir``, else ``<run_dir>/checkpoints``."""
    return Path(checkpoint_dir) if checkpoint_dir else Path(run_dir) / "checkpoints"


@dataclass
class CheckpointConfig:
    dir: str | None = None
    """Folder of the step checkpoints; None = <log.run_dir>/checkpoints."""

    every: int = 0
    """Save every n optimizer steps; 0 = only the final one (if save_final)."""

    keep_last: int = 2
    """Keep the newest n step checkpoints and delete older ones; 0 = keep all."""

    resume: str = "auto"
    """"auto": continue from the newest checkpoint in `dir` if there is one, else start fresh;
    "never": always start fresh (a checkpoint of the same step is overwritten; higher steps left
    in `dir` are named in a warning, never pruned by this run); or the path of one checkpoint to load."""

    save_final: bool = True
    """Save a checkpoint after the last step."""

    async_save: bool = False
    """Write checkpoints in a background thread (DCP's async save): training stops only while the
    tensors are copied to CPU memory, then goes on while the copy is written and published
    (atomically, as a synchronous save). At most one save is in flight (the next one waits for it),
    so CPU memory holds one more copy of the model and optimizer state. A save that fails in the
    background stops the run at the next step with its error; the final and SIGTERM saves are
    published before the run returns."""

    init_from: str | None = None
    """A moetrain export folder (``moetrain export`` / ``moetrain convert --from-hf``: safetensors of
    full tensors by moetrain name, one file or an index of shards) whose weights a fresh run
    starts from, at any parallel layout: every parameter and persistent buffer of the model must
    be in it with its shape, and nothing else. The optimizer, schedule and data start fresh. Ignored
    when the run resumes from a checkpoint of its own (checkpoint.resume finds or names one): the
    checkpoint's weights replace these. ``moetrain train --init-from-hf DIR`` sets it. None = the
    weights are drawn from train.seed."""

    init_from_new_head: bool = False
    """With init_from: start the task head fresh instead of loading it. The model's own head (``output``, and
    ``pool_query`` under attention pooling) keeps its initialisation from train.seed, the export's head (a
    language model's output layer, another classifier's) is not read, and every other tensor must match as
    usual. The route from a pre-trained language model to a classifier: pretrain, export, then train the
    classifier (``model.head: classifier``) from the export with this flag; its tokenizer must be the
    pretraining run's."""

    def __post_init__(self) -> None:
        require(self.dir is None or (isinstance(self.dir, str) and self.dir != ""), "checkpoint.dir",
                self.dir, "must be None (<log.run_dir>/checkpoints) or a non-empty path")
        require_int("checkpoint.every", self.every, note=" (0 = only the final checkpoint)")
        require_int("checkpoint.keep_last", self.keep_last, note=" (0 = keep all)")
        # "none"/"null"/"no"/... would silently be read as a checkpoint path: make the user say "never".
        ok = isinstance(self.resume, str) and self.resume.strip().lower() not in (
            "", "none", "null", "~", "no", "false", "off")
        require(ok, "checkpoint.resume", self.resume, 'must be "auto", "never" or a checkpoint path')
        require_bool("checkpoint.save_final", self.save_final)
        require_bool("checkpoint.async_save", self.async_save)
        require(self.init_from is None or (isinstance(self.init_from, str) and self.init_from != ""),
                "checkpoint.init_from", self.init_from, "must be None or the path of a moetrain export folder")
        require_bool("checkpoint.init_from_new_head", self.init_from_new_head)
        require(not self.init_from_new_head or self.init_from is not None, "checkpoint.init_from_new_head",
                self.init_from_new_head, "needs checkpoint.init_from (the export whose head it replaces)")
