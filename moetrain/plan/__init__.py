"""Memory and communication estimates for a job before launching it (``moetrain plan``)."""

from moetrain.plan.activations import ActivationEstimate, estimate_activations
from moetrain.plan.comm import CommVolume, comm_per_step
from moetrain.plan.model_states import (
           Layout,
           ParamSpec,
           StateBytes,
           param_specs,
           rank_state_bytes,
           state_bytes_per_rank,
)
from moetrain.plan.plan_table import format_plan
from moetrain.plan.planner import Choice, Plan, PlanRow, make_plan

__all__ = ["ActivationEstimate", "Choice", "CommVolume", "Layout", "ParamSpec", "Plan", "PlanRow", "StateBytes",
           "comm_per_step", "estimate_activations", "format_plan", "make_plan", "param_specs",
           "rank_state_bytes", "state_bytes_per_rank"]
