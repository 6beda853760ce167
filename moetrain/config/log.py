"""Config of logging: the run folder, metric cadence and sinks."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config._checks import require_bool, require_int
from moetrain.config.base import require, require_choice


@dataclass
class LogConfig:
    run_dir: str = "runs/default"
    """Folder of this run: the resolved config.yaml, metrics.jsonl, TensorBoard events and (by
    default) the checkpoints. `moetrain train --config <run_dir>/config.yaml` reproduces the run."""

    every: int = 10
    """Log training metrics every n steps. Reading the loss is a host sync, so not every step."""

    tensorboard: bool = True
    """Write TensorBoard event files to <run_dir>/tensorboard."""

    jsonl: bool = True
    """Append one JSON line of metrics per logged step to <run_dir>/metrics.jsonl."""

    progress_bar: bool = True
    """Show a tqdm progress bar on rank 0."""

    memory: bool = True
    """Measure each rank's peak bytes of parameters, gradients, optimizer states and activations on
    the log steps (a tensor-allocation tracker; it slows the step it watches) and log them as mem/*."""

    comm_timing: bool = False
    """Time every collective of the expert-parallel exchanges (dispatch, combine and their backward,
    routing metadata; with parallel.etp > 1 the etp_gather and etp_scatter around them), the
    gradient reduction at ZeRO stages 0/1 and the ZeRO-1 parameter all-gather, and log the seconds
    per step as comm_time/<kind> (and the spans as comm_calls/<kind>). Timing waits for each
    collective where it is issued, so communication stops overlapping compute: steps get slower,
    and the figures say what each exchange costs, the most overlap could hide. FSDP2's own gathers
    and reduce-scatters (stages 2/3) are not timed."""

    level: str = "info"
    """Python logging level of rank 0: "debug", "info" or "warning" (other ranks log warnings only)."""

    def __post_init__(self) -> None:
        require(isinstance(self.run_dir, str) and self.run_dir != "", "log.run_dir", self.run_dir,
                "must be a non-empty path")
        require_int("log.every", self.every, min_value=1)
        require_bool("log.tensorboard", self.tensorboard)
        require_bool("log.jsonl", self.jsonl)
        require_bool("log.progress_bar", self.progress_bar)
        require_bool("log.memory", self.memory)
        require_bool("log.comm_timing", self.comm_timing)
        require_choice("log.level", self.level, ("debug", "info", "warning"))
