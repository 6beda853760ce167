"""The optimizer's per-group hyperparameters compared parameter by parameter: a layout that puts a
parameter in another group (experts in the no-decay group, another learning rate) trains another
model, though every tensor of the first steps may still agree.

The checkpoint keeps the param groups as JSON text (``optim.param_groups``, a uint8 tensor). A
pipeline stage lists only its own parameters, so each parameter both sides list is compared; a
parameter one side does not list is not a difference.
"""

from __future__ import annotations

import json

import torch

from moetrain.verify.checks import EXACT, Comparison

PARAM_GROUPS = "optim.param_groups"

NOT_HYPERPARAMETERS = frozenset({"params", "name", "foreach", "fused", "capturable", "differentiable"})
"""Group entries that are not the update's math: the members, the label and the kernel choice."""


def hyperparameters_by_parameter(state: dict[str, torch.Tensor]) -> dict[str, dict[str, object]]:
    """Parameter name -> its group's hyperparameters (lr, weight_decay, betas, eps, ...), from the
    checkpoint's ``optim.param_groups``; empty when the checkpoint has none."""
    blob = state.get(PARAM_GROUPS)
    if blob is None:
        return {}
    groups = json.loads(bytes(blob.flatten().tolist()).decode("utf-8"))
    out: dict[str, dict[str, object]] = {}
    for group in groups:
        hyper = {k: v for k, v in group.items() if k not in NOT_HYPERPARAMETERS}
        for name in group.get("params", []):
            out[str(name)] = hyper
    return out


def _numbers(hyper: dict[str, object], keys: list[str]) -> list[float]:
    out: list[float] = []
    for key in keys:
        value = hyper.get(key)
        items = value if isinstance(value, (list, tuple)) else [value]
        out += [float(v) if isinstance(v, (int, float)) else float("nan") for v in items]
    return out


def compare_hyperparameters(out: Comparison, tag: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                            *, step: int) -> None:
    """One row, ``optimizer hyperparameters``: every parameter both checkpoints list in a param group
    holds the same group values (exact); a failure names the first parameter and value that differ."""
    quantity = f"{tag} optimizer hyperparameters"
    got_p, want_p = hyperparameters_by_parameter(got), hyperparameters_by_parameter(want)
    if not want_p:
        return
    if not got_p:
        out.missing(quantity, f"no {PARAM_GROUPS} in the layout's checkpoint at step {step}", step=step)
        return
    g_all: list[float] = []
    w_all: list[float] = []
    first = ""
    for name in sorted(set(got_p) & set(want_p)):
        g, w = got_p[name], want_p[name]
        keys = sorted(set(g) | set(w))
        differ = [k for k in keys if g.get(k) != w.get(k)]
        if differ and not first:
            k = differ[0]
            first = f"{name}: {k} {g.get(k)!r} at the layout against {w.get(k)!r} at world 1"
        g_num, w_num = _numbers(g, keys), _numbers(w, keys)
        if len(g_num) != len(w_num) or differ and g_num == w_num:
            g_num, w_num = [1.0], [0.0]  # a difference the numbers do not show (a text or length)
        g_all += g_num
        w_all += w_num
    r = out.values(quantity, torch.tensor(g_all, dtype=torch.float64).nan_to_num(-1.0),
                   torch.tensor(w_all, dtype=torch.float64).nan_to_num(-1.0), EXACT, step=step)
    if first and not r.note:
        r.note = f"step {step}: {first}"
