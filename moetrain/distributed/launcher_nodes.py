"""Nodes as the launcher started them: how many processes each runs, the check that every node
runs the same number with consecutive ranks, and the notices about collectives that cross nodes.

Launchers (torchrun, SLURM) number the processes of one node consecutively, which
``ParallelDims``'s rank order relies on to keep tp and ep groups inside a node.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from moetrain.distributed.parallel_dims import ParallelDims

log = logging.getLogger("moetrain")


def launcher_ranks_per_node(world_size: int) -> int | None:
    """Processes per node as the launcher started them: torchrun's LOCAL_WORLD_SIZE (``moetrain
    train --nproc N`` runs torchrun as well), when this process belongs to a world of
    ``world_size`` (WORLD_SIZE); None otherwise (a plan or config check for another world size)."""
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local is None or world is None or int(world) != world_size:
        return None
    return int(local)


def check_launcher_nodes(world_size: int, device_type: str) -> None:
    """Every rank's LOCAL_WORLD_SIZE must be the same and the ranks of a node consecutive
    (GROUP_RANK, torchrun's node rank): each rank checked its own count against the world
    size when its ``ParallelDims`` was built, but only the gathered counts find nodes of different
    sizes, and every rank then raises the same error instead of some of them hanging. Only
    when the launcher spread the job over several nodes (one collective at setup)."""
    local = launcher_ranks_per_node(world_size)
    if local is None or local == world_size:
        return
    node = int(os.environ.get("GROUP_RANK", dist.get_rank() // local))
    mine = torch.tensor([local, node], dtype=torch.int64, device=device_type)
    every = torch.empty(world_size * 2, dtype=torch.int64, device=device_type)
    dist.all_gather_into_tensor(every, mine)
    sizes, nodes = every.view(-1, 2).T.tolist()
    errors = []
    if len(set(sizes)) > 1:
        errors.append(f"every node must run the same number of processes; LOCAL_WORLD_SIZE by rank: {sizes}")
    elif nodes != [r // local for r in range(world_size)]:
        errors.append(f"the ranks of a node must be consecutive; node (GROUP_RANK) by rank: {nodes}")
    if errors:
        raise ValueError("; ".join(errors))


def report_ep_nodes(dims: ParallelDims) -> None:
    """Warn when tensor-parallel or flat expert-parallel collectives cross nodes; note when
    parallel.ep_hierarchical has nothing to do."""
    if dims.tp > 1 and dims.ranks_per_node % dims.tp != 0:
        warnings.warn(f"parallel.tp ({dims.tp}) does not divide the processes per node "
                      f"(LOCAL_WORLD_SIZE={dims.ranks_per_node}): tensor-parallel collectives cross nodes",
                      stacklevel=3)
    if dims.ep * dims.etp > 1 and dims.ep_spans_nodes and not dims.hierarchical_ep:
        what = f"parallel.ep ({dims.ep})" + (f" * parallel.etp ({dims.etp})" if dims.etp > 1 else "")
        warnings.warn(f"{what} does not divide the processes per node (LOCAL_WORLD_SIZE={dims.ranks_per_node}): "
                      "expert all-to-alls cross nodes", stacklevel=3)
    if dims.ep_hierarchical and not dims.ep_spans_nodes:
        # Not an error: one config serves jobs of one node and of many.
        log.warning("parallel.ep_hierarchical: each ep group of %d ranks lies inside a node of %d, so no "
                    "all-to-all crosses nodes; the flat exchange runs", dims.ep, dims.ranks_per_node)
