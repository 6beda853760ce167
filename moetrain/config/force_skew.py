"""``moe.force_skew``, the benchmark-only routing of skewed workloads ("zipf:S", "hot:K:FRACTION",
"drift:S:PERIOD", "trace:PATH"): its parser, which the MoE config, the planner's skew rows and the
routing trace share."""

from __future__ import annotations

import math

from moetrain.config.base import require


def parse_force_skew(text: str, *, num_experts: int) -> tuple[str, tuple]:
    """``moe.force_skew`` as ``(kind, params)``; ValueError naming the field and the rule."""
    rule = 'must be "none", "zipf:S", "hot:K:FRACTION", "drift:S:PERIOD" or "trace:PATH"'
    require(isinstance(text, str), "moe.force_skew", text, rule)
    kind, _, rest = text.partition(":")
    if text == "none":
        return "none", ()
    if kind == "trace":
        require(rest != "", "moe.force_skew", text, "trace:PATH needs a path")
        return kind, (rest,)
    parts = rest.split(":")
    try:
        if kind == "zipf" and len(parts) == 1:
            params: tuple = (float(parts[0]),)
            ok = math.isfinite(params[0]) and params[0] > 0
        elif kind == "hot" and len(parts) == 2:
            params = (int(parts[0]), float(parts[1]))
            ok = 1 <= params[0] < num_experts and 0 < params[1] < 1
        elif kind == "drift" and len(parts) == 2:
            params = (float(parts[0]), int(parts[1]))
            ok = math.isfinite(params[0]) and params[0] > 0 and params[1] >= 1
        else:
            ok = False
    except ValueError:
        ok = False
    require(ok, "moe.force_skew", text, rule + f" with S > 0, 1 <= K < num_experts ({num_experts}), "
            "0 < FRACTION < 1, PERIOD >= 1")
    return kind, params
