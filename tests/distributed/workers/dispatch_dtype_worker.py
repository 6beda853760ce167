"""Workers and measures of the ``moe.dispatch_dtype`` tests (test_dispatch_dtype.py).

``bytes_worker`` runs one MoE layer at ep = world on a fixed input once per setting and returns
its ``CommStats``, its routing (to count the rows by hand) and the dtypes of every all-to-all it
saw, forward and backward. ``parity_errors`` measures how far a compressed run is from the
fp32 single-process reference: the largest norm-wise relative error over the steps, per kind
(outputs, losses, gradients, parameters after the last step).

Shape legend: T tokens per rank, D model dim, K experts per token.
"""

from __future__ import annotations

import torch

from moetrain.models.moe import MoELayer
from tests.distributed.workers.dtype_probe import DtypeRecorder
from tests.distributed.workers.ep_parity import _assemble


def bytes_worker(rank: int, world_size: int, settings: dict[str, dict], *, dim: int,
                 tokens: int = 16) -> dict:
    """Per setting (name -> MoEConfig overrides): one forward and backward of one MoE layer
    (E=4, K=2) at ep = world on this rank's fixed input."""
    from moetrain.config.moe import MoEConfig
    from moetrain.distributed import ParallelDims, apply_expert_parallel, collect_comm_stats

    dims = ParallelDims(world_size=world_size, ep=world_size, num_experts=4)
    dims.build_mesh("cpu")
    x_TD = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, overrides in settings.items():
        cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=32, **overrides)
        torch.manual_seed(0)
        layer = apply_expert_parallel(torch.nn.Sequential(MoELayer(dim, cfg)), dims)[0]
        recorder = DtypeRecorder()
        with recorder:
            y_TD, _ = layer(x_TD)
            y_TD.sum().backward()
        stats = collect_comm_stats(layer)
        out[name] = {"stats": stats, "idx_TK": layer.router(x_TD).idx_TK,
                     "seen": [s for s in recorder.seen if s.where == "payload"]}
    return out


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.double().norm().item()
    return (actual.double() - expected.double()).norm().item() / max(scale, 1e-30)


def _tensor_errors(per_rank: list[dict], expected: dict, ep: int) -> float:
    worst = 0.0
    for name, (_, exp) in expected.items():
        if per_rank[0][name][0] is None:
            worst = max([worst] + [_rel(d[name][1], exp) for d in per_rank])
        else:
            worst = max([worst] + [_rel(full, exp) for full in _assemble(per_rank, name, ep)])
    return worst


def parity_errors(ranks: list[dict], ref: dict, *, ep: int) -> dict[str, float]:
    """Largest norm-wise relative error of the ranks against the reference, per kind, over every
    step (``ep_parity`` result layout)."""
    W = len(ranks)
    err = {"output": 0.0, "loss": 0.0, "grad": 0.0, "param": 0.0}
    for s, ref_step in enumerate(ref["steps"]):
        steps = [r["steps"][s] for r in ranks]
        for m, ref_out in enumerate(ref_step["out"]):
            err["output"] = max(err["output"], _rel(torch.cat([st["out"][m] for st in steps]), ref_out))
        loss = sum(st["loss"] for st in steps) / W
        err["loss"] = max(err["loss"], abs(loss - ref_step["loss"]) / abs(ref_step["loss"]))
        err["grad"] = max(err["grad"], _tensor_errors([st["grads"] for st in steps], ref_step["grads"], ep))
    err["param"] = _tensor_errors([r["params"] for r in ranks], ref["params"], ep)
    return err
