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
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moetrain.config.parallel import ParallelConfig


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
    mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _dp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _hsdp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.dp == -1 and isinstance(self.world_size, int) and self.world_size > 0:
            self.dp = self.world_size // (self.tp * self.pp)
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
        if errors:
            raise ValueError("; ".join(errors))

    @classmethod
    def from_config(cls, parallel: ParallelConfig, *, world_size: int,
                    num_experts: int | None = None) -> ParallelDims:
        return cls(world_size=world_size, ep=parallel.ep, dp=parallel.dp, tp=parallel.tp, pp=parallel.pp,
                   num_experts=num_experts)

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
        self._warn_if_ep_crosses_nodes()
        # Row-major (edp, ep): consecutive ranks share the ep axis, see the module docstring.
        mesh = init_device_mesh(device_type, (self.edp, self.ep), mesh_dim_names=("edp", "ep"))
        # Kept here: slicing a flattened axis from the root mesh is deprecated.
        self._dp_mesh = mesh[("edp", "ep")]._flatten("dp")
        self.mesh = mesh
        return mesh

    def _warn_if_ep_crosses_nodes(self) -> None:
        local_world = os.environ.get("LOCAL_WORLD_SIZE")
        if local_world is not None and self.ep > 1 and int(local_world) % self.ep != 0:
            warnings.warn(f"parallel.ep ({self.ep}) does not divide the processes per node "
                          f"(LOCAL_WORLD_SIZE={local_world}): expert all-to-alls cross nodes", stacklevel=3)

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
