"""Config of logging: the run folder, metric cadence and sinks."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config._checks import require_bool, require_int
from moetrain.config.base import require, require_choice

ROUTING_TRACES = ("counts", "full", "off")
"""The choices of ``log.routing_trace``."""


@dataclass
class WandbConfig:
    """A Weights & Biases run beside metrics.jsonl (``pip install moetrain[wandb]``)."""

    project: str = "moetrain"
    """W&B project."""

    entity: str | None = None
    """W&B entity (team or user); None = the logged-in user's default."""

    mode: str = "online"
    """"online" (sync as it runs), "offline" (write <run_dir>/wandb only; `wandb sync` uploads it later, the
    mode for nodes without network) or "disabled"."""

    def __post_init__(self) -> None:
        require(isinstance(self.project, str) and self.project != "", "log.wandb.project", self.project,
                "must be a non-empty string")
        require(self.entity is None or (isinstance(self.entity, str) and self.entity != ""), "log.wandb.entity",
                self.entity, "must be None or a non-empty string")
        require_choice("log.wandb.mode", self.mode, ("online", "offline", "disabled"))


@dataclass
class MlflowConfig:
    """An MLflow run beside metrics.jsonl (``pip install moetrain[mlflow]``)."""

    tracking_uri: str | None = None
    """Tracking server or store: "http://host:5000", "sqlite:///path/mlflow.db", ...; None = MLflow's own
    default (MLFLOW_TRACKING_URI, else its local store)."""

    experiment: str = "moetrain"
    """Experiment name; created when missing."""

    def __post_init__(self) -> None:
        require(self.tracking_uri is None or (isinstance(self.tracking_uri, str) and self.tracking_uri != ""),
                "log.mlflow.tracking_uri", self.tracking_uri, "must be None or a non-empty URI")
        require(isinstance(self.experiment, str) and self.experiment != "", "log.mlflow.experiment",
                self.experiment, "must be a non-empty string")


@dataclass
class LogConfig:
    run_dir: str = "runs/default"
    """Folder of this run: the resolved config.yaml, metrics.jsonl, TensorBoard events and (by
    default) the checkpoints. `moetrain train --config <run_dir>/config.yaml` reproduces the run."""

    every: int = 10
    """Log training metrics every n steps, at each checkpoint save and at each evaluation
    (train.eval_every) (reading the loss is a host sync)."""

    tensorboard: bool = True
    """Write TensorBoard event files to <run_dir>/tensorboard."""

    jsonl: bool = True
    """Append one JSON line of metrics per logged step to <run_dir>/metrics.jsonl."""

    progress_bar: bool = True
    """Show a tqdm progress bar on rank 0."""

    report: bool = True
    """At the end of the run, rank 0 draws the report's PNGs (loss, throughput, expert load, ...) into
    <run_dir>/report, and hands them to log.wandb / log.mlflow. false: none are drawn (about a second of CPU
    per run, most of a few-step run); `moetrain report RUN_DIR` draws them later from metrics.jsonl."""

    memory: bool = True
    """Measure each rank's peak bytes of parameters, gradients, optimizer states and activations on
    the log steps (a tensor-allocation tracker; it slows the step it watches) and log them as mem/*.
    Not under train.compile: compiled code does not run under the tracker (docs/compile.md)."""

    comm_timing: bool = False
    """Time every collective of the expert-parallel exchanges (dispatch, combine and their backward,
    routing metadata; with parallel.etp > 1 the etp_gather and etp_scatter around them), the
    gradient reduction at ZeRO stages 0/1 and the ZeRO-1 parameter all-gather, and log the seconds
    per step as comm_time/<kind> (and the spans as comm_calls/<kind>). Timing waits for each
    collective where it is issued, so communication stops overlapping compute: steps get slower,
    and the figures say what each exchange costs, the most overlap could hide. FSDP2's own gathers
    and reduce-scatters (stages 2/3) are not timed."""

    wandb: WandbConfig | None = None
    """Also log to Weights & Biases (rank 0): every scalar of metrics.jsonl, the per-expert load as a table and
    histograms, the resolved config, and at the end the report's PNGs as an artifact. The run id is kept in
    <run_dir>/wandb_run_id, so a resumed run continues the same W&B run. None = off (wandb not imported)."""

    mlflow: MlflowConfig | None = None
    """Also log to MLflow (rank 0): the same scalars as metrics.jsonl, the resolved config as parameters and as
    config.yaml, each per-expert table (expert_share, expert_bias, expert_lr_scale) as JSON artifacts named
    <key>/step<step, 8 digits>.json (expert_share/step00000002.json) and at the end the report's PNGs.
    The run id is kept in <run_dir>/mlflow_run_id for resumes. None = off (mlflow not imported)."""

    routing_trace: str = "counts"
    """Routing trace in <run_dir>/routing_trace (safetensors shards + index.json, docs/routing.md#routing-traces):
    "counts" = on each log.every step, the routed copies per expert and MoE layer of each rank's tokens (4 bytes x
    layers x experts per rank); "full" = every step, the top-k expert ids of every token with its place in the
    global batch (2 bytes x tokens x top_k per step), what moe.routing_replay reads; "off" = none. "full" needs
    parallel.pp = 1 (under tp each rank records its sequence shard of every sequence it holds)."""

    level: str = "info"
    """Python logging level of rank 0: "debug", "info" or "warning" (other ranks log warnings only)."""

    def __post_init__(self) -> None:
        require(isinstance(self.run_dir, str) and self.run_dir != "", "log.run_dir", self.run_dir,
                "must be a non-empty path")
        require_int("log.every", self.every, min_value=1)
        require_bool("log.tensorboard", self.tensorboard)
        require_bool("log.jsonl", self.jsonl)
        require_bool("log.progress_bar", self.progress_bar)
        require_bool("log.report", self.report)
        require_bool("log.memory", self.memory)
        require_bool("log.comm_timing", self.comm_timing)
        require_choice("log.routing_trace", self.routing_trace, ROUTING_TRACES)
        require_choice("log.level", self.level, ("debug", "info", "warning"))
        require(self.wandb is None or isinstance(self.wandb, WandbConfig), "log.wandb", self.wandb,
                "must be None or a mapping of project, entity, mode")
        require(self.mlflow is None or isinstance(self.mlflow, MlflowConfig), "log.mlflow", self.mlflow,
                "must be None or a mapping of tracking_uri, experiment")
