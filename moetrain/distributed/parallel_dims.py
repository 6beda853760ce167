"""The parallel layout: degrees, the checks that need the world size, and the DeviceMesh.

Rank order (topology-aware, fixed):

    rank = edp_index * ep + ep_index

The ``ep`` ranks of one expert-parallel group are consecutive. Launchers (torchrun, SLURM) number
the processes of one node consecutively, so while ``ep`` divides the processes per node every
all-to-all stays inside a node; data parallelism (the all-reduces, which tolerate the slower
link) spans nodes. Example with 4 ranks, ep=2:

    ep groups  (share out the experts):          [0, 1]  [2, 3]
    edp groups (hold copies of the same experts): [0, 2]  [1, 3]
    dp group   (non-expert data parallelism):     [0, 1, 2, 3]

Mesh axes: ``ep`` (inner, consecutive ranks), ``edp`` = world / ep (outer), and ``dp``, the two
flattened (all ranks, for the non-expert parameters).

Nodes hold ``ranks_per_node`` consecutive ranks each (torchrun's LOCAL_WORLD_SIZE, which
``moetrain train --nproc N`` sets too). An ep group larger than a node spans whole nodes; with
``parallel.ep_hierarchical`` its exchange runs in two stages over two more axes of a separate
mesh (``moetrain.distributed.hierarchical``). Example with 8 ranks on 2 nodes of 4, ep=8:

    nodes:                                  [0, 1, 2, 3]  [4, 5, 6, 7]
    ep_intra groups (inside a node):        [0, 1, 2, 3]  [4, 5, 6, 7]
    ep_inter groups (same local index):     [0, 4]  [1, 5]  [2, 6]  [3, 7]
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moetrain.config.parallel import ParallelConfig

log = logging.getLogger("moetrain")


def launcher_ranks_per_node(world_size: int) -> int | None:
    """Processes per node as the launcher started them: torchrun's LOCAL_WORLD_SIZE (``moetrain
    train --nproc N`` runs torchrun as well), when this process belongs to a world of
    ``world_size`` (WORLD_SIZE); None otherwise (a plan or config check for another world size)."""
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local is None or world is None or int(world) != world_size:
        return None
    return int(local)


@dataclass
class ParallelDims:
    """Degrees of the parallel layout, validated against the world size and the model.

    Build with :meth:`from_config` (or directly), then call :meth:`build_mesh` once the process
    group exists. ``tp`` and ``pp`` are placeholders that must be 1 for now.
    """

    world_size: int
    """Number of processes."""
    ep: int = 1
    """Expert-parallel degree: experts are split over groups of ``ep`` consecutive ranks."""
    dp: int = -1
    """Data-parallel degree of the non-expert parameters; -1 = world / (tp * pp)."""
    tp: int = 1
    pp: int = 1
    num_experts: int | None = None
    """Routed experts per MoE layer; ``ep`` must divide it. None skips that check (dense model)."""
    ranks_per_node: int | None = None
    """Processes on each node, numbered consecutively; must divide the world size (nodes of one
    size). None: the launcher's (:func:`launcher_ranks_per_node`), else all ranks on one node."""
    ep_hierarchical: bool = False
    """parallel.ep_hierarchical: the two-stage exchange where the ep group spans nodes."""
    mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _dp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _hsdp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _ep_node_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.dp == -1 and isinstance(self.world_size, int) and self.world_size > 0:
            self.dp = self.world_size // (self.tp * self.pp)
        if self.ranks_per_node is None and isinstance(self.world_size, int):
            self.ranks_per_node = launcher_ranks_per_node(self.world_size) or self.world_size
        # Every violated rule is reported at once, so a bad layout needs one restart to fix.
        errors = []
        for name, value in (("world size", self.world_size), ("parallel.ep", self.ep),
                            ("parallel.dp", self.dp)):
            if not isinstance(value, int) or value < 1:
                errors.append(f"{name} ({value!r}) must be an integer >= 1")
        if self.tp != 1:
            errors.append(f"parallel.tp ({self.tp}) must be 1 (tensor parallelism is not supported yet)")
        if self.pp != 1:
            errors.append(f"parallel.pp ({self.pp}) must be 1 (pipeline parallelism is not supported yet)")
        if errors:
            raise ValueError("; ".join(errors))
        if self.dp * self.tp * self.pp != self.world_size:
            errors.append(f"parallel.dp ({self.dp}) * parallel.tp ({self.tp}) * parallel.pp ({self.pp}) "
                          f"must equal the world size ({self.world_size})")
        if self.world_size % self.ep != 0:
            errors.append(f"parallel.ep ({self.ep}) must divide the world size ({self.world_size})")
        elif self.dp % self.ep != 0:
            errors.append(f"parallel.ep ({self.ep}) must divide parallel.dp ({self.dp})")
        if self.num_experts is not None and self.num_experts % self.ep != 0:
            errors.append(self._experts_rule(self.num_experts))
        errors += self._node_errors()
        if errors:
            raise ValueError("; ".join(errors))

    def _node_errors(self) -> list[str]:
        rpn = self.ranks_per_node
        if not isinstance(rpn, int) or isinstance(rpn, bool) or rpn < 1:
            return [f"ranks per node ({rpn!r}) must be an integer >= 1"]
        if self.world_size % rpn != 0:
            return [(f"the world size ({self.world_size}) must be a multiple of the ranks per node ({rpn}, "
                     "LOCAL_WORLD_SIZE): every node must run the same number of processes")]
        if self.ep_hierarchical and self.ep_spans_nodes and self.ep % rpn != 0:
            return [(f"parallel.ep_hierarchical needs ep groups made of whole nodes: parallel.ep ({self.ep}) "
                     f"must be a multiple of the ranks per node ({rpn}) or divide it")]
        return []

    @classmethod
    def from_config(cls, parallel: ParallelConfig, *, world_size: int, num_experts: int | None = None,
                    ranks_per_node: int | None = None) -> ParallelDims:
        return cls(world_size=world_size, ep=parallel.ep, dp=parallel.dp, tp=parallel.tp, pp=parallel.pp,
                   num_experts=num_experts, ranks_per_node=ranks_per_node,
                   ep_hierarchical=parallel.ep_hierarchical)

    # ----- degrees -------------------------------------------------------------------------------

    @property
    def edp(self) -> int:
        """Data-parallel degree of the expert parameters: ranks holding copies of the same experts."""
        return self.dp // self.ep

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    def check_experts(self, num_experts: int, *, layer: str | None = None) -> None:
        """``parallel.ep`` must divide the routed experts of every MoE layer (of ``layer``, named in
        the error): for a model whose expert count was not given to the constructor."""
        if num_experts % self.ep != 0:
            where = "" if layer is None else f" of layer {layer!r}"
            raise ValueError(self._experts_rule(num_experts) + where)

    def _experts_rule(self, num_experts: int) -> str:
        return f"parallel.ep ({self.ep}) must divide moe.num_experts ({num_experts})"

    # ----- rank layout (pure arithmetic, no process group needed) --------------------------------

    def ep_group_ranks(self) -> list[list[int]]:
        """Ranks of each expert-parallel group: consecutive blocks of ``ep``."""
        return [list(range(g * self.ep, (g + 1) * self.ep)) for g in range(self.edp)]

    def edp_group_ranks(self) -> list[list[int]]:
        """Ranks of each expert-data-parallel group: one rank from every ep group, stride ``ep``."""
        return [list(range(j, self.world_size, self.ep)) for j in range(self.ep)]

    # ----- nodes (pure arithmetic) ----------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """Node of a global rank: launchers number the processes of a node consecutively."""
        return rank // self.ranks_per_node

    @property
    def ep_spans_nodes(self) -> bool:
        """Whether some ep group has ranks on more than one node (its all-to-alls cross nodes)."""
        return self.ranks_per_node % self.ep != 0

    @property
    def hierarchical_ep(self) -> bool:
        """The two-stage exchange runs: asked for (parallel.ep_hierarchical), and ep spans nodes."""
        return self.ep_hierarchical and self.ep_spans_nodes

    def ep_rank_nodes(self, group: int | None = None) -> list[int]:
        """Node of each rank of ep group ``group`` (in ep-rank order); None: this rank's group
        (after build_mesh)."""
        return [self.node_of(r) for r in self.ep_group_ranks()[self.edp_rank if group is None else group]]

    def ep_node_ranks(self, group: int = 0) -> list[list[int]]:
        """The ep ranks (indices inside ep group ``group``) that share a node, node by node: with
        2 nodes of 2 and ep=4, ``[[0, 1], [2, 3]]``."""
        nodes = self.ep_rank_nodes(group)
        return [[j for j, n in enumerate(nodes) if n == node] for node in dict.fromkeys(nodes)]

    def dp_rank_nodes(self) -> list[int]:
        """Node of each rank of the dp group (all ranks, in order)."""
        return [self.node_of(r) for r in range(self.world_size)]

    # ----- mesh ----------------------------------------------------------------------------------

    def build_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """Create the DeviceMesh (collective: every rank calls it, in the same order).

        ``device_type`` defaults to what the process group's backend drives: "cuda" for nccl,
        "cpu" otherwise, so the same code runs gloo on CPU and nccl on GPUs.
        """
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build_mesh needs torch.distributed to be initialized")
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"world size ({self.world_size}) given to ParallelDims must equal the "
                             f"process group's ({dist.get_world_size()})")
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self._check_launcher_nodes(device_type)
        self._report_ep_nodes()
        # Row-major (edp, ep): consecutive ranks share the ep axis, see the module docstring.
        mesh = init_device_mesh(device_type, (self.edp, self.ep), mesh_dim_names=("edp", "ep"))
        # Kept here: slicing a flattened axis from the root mesh is deprecated.
        self._dp_mesh = mesh[("edp", "ep")]._flatten("dp")
        if self.hierarchical_ep:
            # A separate root mesh, like HSDP's: the expert DTensors live on the main one's ep axis.
            # Row-major (edp, nodes of the group, ranks per node) is the rank order above.
            shape = (self.edp, self.ep // self.ranks_per_node, self.ranks_per_node)
            self._ep_node_mesh = init_device_mesh(device_type, shape, mesh_dim_names=("edp", "ep_inter", "ep_intra"))
        self.mesh = mesh
        return mesh

    def _check_launcher_nodes(self, device_type: str) -> None:
        """Every rank's LOCAL_WORLD_SIZE must be the same and the ranks of a node consecutive
        (GROUP_RANK, torchrun's node rank): each rank checked its own count against the world
        size when this object was built, but only the gathered counts find nodes of different
        sizes, and every rank then raises the same error instead of some of them hanging. Only
        when the launcher spread the job over several nodes (one collective at setup)."""
        local = launcher_ranks_per_node(self.world_size)
        if local is None or local == self.world_size:
            return
        node = int(os.environ.get("GROUP_RANK", dist.get_rank() // local))
        mine = torch.tensor([local, node], dtype=torch.int64, device=device_type)
        every = torch.empty(self.world_size * 2, dtype=torch.int64, device=device_type)
        dist.all_gather_into_tensor(every, mine)
        sizes, nodes = every.view(-1, 2).T.tolist()
        errors = []
        if len(set(sizes)) > 1:
            errors.append(f"every node must run the same number of processes; LOCAL_WORLD_SIZE by rank: {sizes}")
        elif nodes != [r // local for r in range(self.world_size)]:
            errors.append(f"the ranks of a node must be consecutive; node (GROUP_RANK) by rank: {nodes}")
        if errors:
            raise ValueError("; ".join(errors))

    def _report_ep_nodes(self) -> None:
        if self.ep > 1 and self.ep_spans_nodes and not self.hierarchical_ep:
            warnings.warn(f"parallel.ep ({self.ep}) does not divide the processes per node "
                          f"(LOCAL_WORLD_SIZE={self.ranks_per_node}): expert all-to-alls cross nodes", stacklevel=3)
        if self.ep_hierarchical and not self.ep_spans_nodes:
            # Not an error: one config serves jobs of one node and of many.
            log.warning("parallel.ep_hierarchical: each ep group of %d ranks lies inside a node of %d, so no "
                     "all-to-all crosses nodes; the flat exchange runs", self.ep, self.ranks_per_node)

    def _sub_mesh(self, axis: str) -> DeviceMesh:
        if self.mesh is None:
            raise RuntimeError("call ParallelDims.build_mesh() first")
        return self.mesh[axis]

    @property
    def ep_mesh(self) -> DeviceMesh:
        return self._sub_mesh("ep")

    @property
    def edp_mesh(self) -> DeviceMesh:
        return self._sub_mesh("edp")

    @property
    def dp_mesh(self) -> DeviceMesh:
        """All ranks (edp x ep flattened), for the non-expert parameters."""
        if self.mesh is None:
            raise RuntimeError("call ParallelDims.build_mesh() first")
        return self._dp_mesh

    def hsdp_mesh(self, replicate: int) -> DeviceMesh:
        """The (dp_replicate, dp_shard) mesh of HSDP with ``replicate`` replicas: shard groups of
        dp / replicate consecutive ranks (one node), replicas striding across nodes. Collective the
        first time; built once."""
        if not isinstance(replicate, int) or replicate < 1 or self.dp % replicate != 0:
            raise ValueError(f"parallel.hsdp_replicate ({replicate!r}) must be an int >= 1 that divides "
                             f"parallel.dp ({self.dp})")
        if self.mesh is None:
            raise RuntimeError("call ParallelDims.build_mesh() first")
        shape = (replicate, self.dp // replicate)
        if self._hsdp_mesh is None or self._hsdp_mesh.shape != shape:
            # A separate root mesh is fine here: dense parameters are plain tensors, so FSDP does
            # not have to compose this mesh with the ep mesh of the expert DTensors.
            self._hsdp_mesh = init_device_mesh(self.mesh.device_type, shape,
                                               mesh_dim_names=("dp_replicate", "dp_shard"))
        return self._hsdp_mesh

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.ep_mesh.get_group()

    def _ep_node_axis(self, axis: str) -> dist.ProcessGroup:
        if self._ep_node_mesh is None:
            raise RuntimeError("the ep node groups exist once build_mesh() ran with an ep group spanning nodes "
                               "and ep_hierarchical")
        return self._ep_node_mesh[axis].get_group()

    @property
    def ep_inter_group(self) -> dist.ProcessGroup:
        """This rank's peers with the same local index on the other nodes of its ep group."""
        return self._ep_node_axis("ep_inter")

    @property
    def ep_intra_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's ep group on its node."""
        return self._ep_node_axis("ep_intra")

    @property
    def edp_group(self) -> dist.ProcessGroup:
        return self.edp_mesh.get_group()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dp_mesh.get_group()

    @property
    def ep_rank(self) -> int:
        return self.ep_mesh.get_local_rank()

    @property
    def edp_rank(self) -> int:
        return self.edp_mesh.get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()
