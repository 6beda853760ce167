"""The parallel layout: degrees, the checks that need the world size, and the DeviceMesh.

Rank order (topology-aware, fixed):

    rank = (pp_index * dp + dp_index) * tp + tp_index

The ``tp`` ranks of one tensor-parallel group are consecutive, then come the data-parallel
copies, and the pipeline stages are outermost. Launchers (torchrun, SLURM) number the processes
of one node consecutively, so while ``tp`` divides the processes per node every tensor-parallel
collective (several per layer, on the critical path) stays inside a node; stage-to-stage
point-to-point sends tolerate the slower link and may cross nodes.

The MoE layers fold over the same ranks (Megatron-Core's "parallel folding"): the ``dp * tp``
ranks of one pipeline stage hold different tokens at the MoE layer (its input is sharded along
the sequence over tp), and re-factor as ``edp x ep x etp`` with ``etp`` innermost:

    rank = pp_index * dp * tp + (edp_index * ep + ep_index) * etp + etp_index

so ``ep`` and ``etp`` may borrow from ``dp x tp`` (``ep * etp`` must divide ``dp * tp``) and the
all-to-alls stay inside a node while ``ep * etp`` divides the processes per node. An etp group
(``parallel.etp`` consecutive ranks: the tp pairs when etp = tp) splits each expert's hidden dim
and computes on the tokens of all its ranks (``moetrain.distributed.expert_parallel.tensor_parallel``).
Example with 8 ranks, pp=2, tp=2, ep=2 (so dp = 2 and edp = 2):

    pp groups  (pipeline stages, p2p):             [0, 4]  [1, 5]  [2, 6]  [3, 7]
    tp groups  (split attention/FFN weights):      [0, 1]  [2, 3]  [4, 5]  [6, 7]
    dp groups  (copies of the dense weights):      [0, 2]  [1, 3]  [4, 6]  [5, 7]
    ep groups  (share out the experts):            [0, 1]  [2, 3]  [4, 5]  [6, 7]
    edp groups (copies of the same experts):       [0, 2]  [1, 3]  [4, 6]  [5, 7]
    dp_tp groups (distinct tokens at the MoE):     [0, 1, 2, 3]  [4, 5, 6, 7]

With pp = tp = 1 this is the expert layout alone: 4 ranks, ep=2 give ep groups [0, 1] [2, 3],
edp groups [0, 2] [1, 3] and one dp group [0, 1, 2, 3].

Meshes: one 1-D root over all ranks, unflattened twice so that FSDP and DTensor see one root:
``mesh`` = (pp, dp, tp) for the dense part and ``moe_mesh`` = (pp, edp, ep, etp) for the experts;
``dp_tp`` is the (dp, tp) part of ``mesh`` flattened (the dp axis itself when tp = 1).

Nodes hold ``ranks_per_node`` consecutive ranks each (torchrun's LOCAL_WORLD_SIZE, which
``moetrain train --nproc N`` sets too). An ep group larger than a node spans whole nodes; with
``parallel.ep_hierarchical`` its exchange runs in two stages over two more axes of a separate
mesh (``moetrain.distributed.expert_parallel.hierarchical``). Example with 8 ranks on 2 nodes of 4, ep=8:

    nodes:                                  [0, 1, 2, 3]  [4, 5, 6, 7]
    ep_intra groups (inside a node):        [0, 1, 2, 3]  [4, 5, 6, 7]
    ep_inter groups (same local index):     [0, 4]  [1, 5]  [2, 6]  [3, 7]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moetrain.config.parallel import ParallelConfig
from moetrain.distributed.runtime import check_launcher_nodes, launcher_ranks_per_node, report_ep_nodes


def _is_degree(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass
class ParallelDims:
    """Degrees of the parallel layout, validated against the world size and the model.

    Build with :meth:`from_config` (or directly), then call :meth:`build_mesh` once the process
    group exists. See the module docstring for the rank order.
    """

    world_size: int
    """Number of processes."""
    ep: int = 1
    """Expert-parallel degree: experts are split over groups of ``ep`` ranks of a stage (consecutive,
    or at stride ``etp``)."""
    dp: int = -1
    """Data-parallel degree of the dense (non-expert) parameters; -1 = world / (tp * pp)."""
    tp: int = 1
    """Tensor-parallel degree of the dense part: groups of ``tp`` consecutive ranks."""
    pp: int = 1
    """Pipeline-parallel degree: stages of ``world / pp`` consecutive ranks."""
    etp: int = 1
    """Expert tensor-parallel degree: groups of ``etp`` consecutive ranks split each expert's hidden dim."""
    num_experts: int | None = None
    """Routed experts per MoE layer; ``ep`` must divide it. None skips that check (dense model)."""
    ranks_per_node: int | None = None
    """Processes on each node, numbered consecutively; must divide the world size (nodes of one
    size). None: the launcher's (:func:`launcher_ranks_per_node`), else all ranks on one node."""
    ep_hierarchical: bool = False
    """parallel.ep_hierarchical: the two-stage exchange where the ep group spans nodes."""
    mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    """The dense mesh (pp, dp, tp), after :meth:`build_mesh`."""
    moe_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    """The expert mesh (pp, edp, ep, etp) over the same ranks, after :meth:`build_mesh`."""
    _dp_tp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _hsdp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _ep_node_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.dp == -1 and all(_is_degree(v) for v in (self.world_size, self.tp, self.pp)):
            if self.world_size % (self.tp * self.pp) != 0:
                raise ValueError(f"parallel.tp ({self.tp}) * parallel.pp ({self.pp}) must divide the world size "
                                 f"({self.world_size})")
            self.dp = self.world_size // (self.tp * self.pp)
        from_launcher = launcher_ranks_per_node(self.world_size) if self.ranks_per_node is None else None
        launched = from_launcher is not None
        if self.ranks_per_node is None and isinstance(self.world_size, int):
            self.ranks_per_node = from_launcher or self.world_size
        # Every violated rule is reported at once, so a bad layout needs one restart to fix.
        errors = [f"{name} ({value!r}) must be an integer >= 1"
                  for name, value in (("world size", self.world_size), ("parallel.ep", self.ep),
                                      ("parallel.dp", self.dp), ("parallel.tp", self.tp), ("parallel.pp", self.pp),
                                      ("parallel.etp", self.etp))
                  if not _is_degree(value)]
        if errors:
            raise ValueError("; ".join(errors))
        errors = self._degree_errors()
        if self.num_experts is not None and self.num_experts % self.ep != 0:
            errors.append(self._experts_rule(self.num_experts))
        errors += self._node_errors(launched=launched)
        if errors:
            raise ValueError("; ".join(errors))

    def _degree_errors(self) -> list[str]:
        errors = []
        if self.dp * self.tp * self.pp != self.world_size:
            errors.append(f"parallel.dp ({self.dp}) * parallel.tp ({self.tp}) * parallel.pp ({self.pp}) "
                          f"must equal the world size ({self.world_size})")
        if self.world_size % self.ep != 0:
            errors.append(f"parallel.ep ({self.ep}) must divide the world size ({self.world_size})")
        elif self.dp_tp % (self.ep * self.etp) != 0:
            what = f"parallel.ep ({self.ep})" + (f" * parallel.etp ({self.etp})" if self.etp > 1 else "")
            errors.append(f"{what} must divide parallel.dp * parallel.tp ({self.dp_tp}): expert parallelism folds "
                          "over the ranks of one pipeline stage")
        if self.ep_hierarchical and (self.tp > 1 or self.pp > 1 or self.etp > 1):
            errors.append(f"parallel.ep_hierarchical needs parallel.tp, pp and etp = 1 (are {self.tp}, {self.pp}, "
                          f"{self.etp}): its node mesh is laid out for one stage without tensor parallelism")
        return errors

    def _node_errors(self, *, launched: bool = False) -> list[str]:
        rpn = self.ranks_per_node
        if not isinstance(rpn, int) or isinstance(rpn, bool) or rpn < 1:
            return [f"ranks per node ({rpn!r}) must be an integer >= 1"]
        if self.world_size % rpn != 0 and launched:
            # Nodes of different sizes: a node whose count divides the world would go on and wait
            # for this one until the setup timeout. build_mesh's check_launcher_nodes gathers every
            # rank's count and raises the same error on all of them.
            return []
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
        dims = cls(world_size=world_size, ep=parallel.ep, dp=parallel.dp, tp=parallel.tp, pp=parallel.pp,
                   etp=parallel.etp, num_experts=num_experts, ranks_per_node=ranks_per_node,
                   ep_hierarchical=parallel.ep_hierarchical)
        dims.check_hsdp(parallel.hsdp_replicate)  # here too: a job is checked before its ranks start
        return dims

    # ----- degrees -------------------------------------------------------------------------------

    @property
    def dp_tp(self) -> int:
        """Ranks of one pipeline stage (dp * tp): each holds different tokens at the MoE layers."""
        return self.dp * self.tp

    @property
    def edp(self) -> int:
        """Data-parallel degree of the expert parameters: ranks of a stage holding copies of the
        same expert shards (dp * tp / (ep * etp))."""
        return self.dp_tp // (self.ep * self.etp)

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def check_experts(self, num_experts: int, *, layer: str | None = None) -> None:
        """``parallel.ep`` must divide the routed experts of every MoE layer (of ``layer``, named in
        the error): for a model whose expert count was not given to the constructor."""
        if num_experts % self.ep != 0:
            where = "" if layer is None else f" of layer {layer!r}"
            raise ValueError(self._experts_rule(num_experts) + where)

    def _experts_rule(self, num_experts: int) -> str:
        return f"parallel.ep ({self.ep}) must divide moe.num_experts ({num_experts})"

    # ----- rank layout (pure arithmetic, no process group needed) --------------------------------

    def rank_of(self, *, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        """Global rank of coordinates (pp, dp, tp): ``(pp * dp_degree + dp) * tp_degree + tp``."""
        return (pp * self.dp + dp) * self.tp + tp

    def pp_group_ranks(self) -> list[list[int]]:
        """Ranks of each pipeline group (one rank per stage, stride dp * tp)."""
        return [list(range(j, self.world_size, self.dp_tp)) for j in range(self.dp_tp)]

    def tp_group_ranks(self) -> list[list[int]]:
        """Ranks of each tensor-parallel group: consecutive blocks of ``tp``."""
        return [list(range(g * self.tp, (g + 1) * self.tp)) for g in range(self.world_size // self.tp)]

    def dp_group_ranks(self) -> list[list[int]]:
        """Ranks of each data-parallel group of the dense part: stride ``tp`` inside a stage."""
        return [[self.rank_of(pp=p, dp=d, tp=t) for d in range(self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def dp_tp_group_ranks(self) -> list[list[int]]:
        """Ranks of each stage: the dp x tp ranks with different tokens at the MoE layers."""
        return [list(range(p * self.dp_tp, (p + 1) * self.dp_tp)) for p in range(self.pp)]

    def ep_group_ranks(self) -> list[list[int]]:
        """Ranks of each expert-parallel group, ordered (pp, edp, etp): ``ep`` ranks at stride ``etp``
        (consecutive blocks of ``ep`` at etp = 1)."""
        blocks = range(0, self.world_size, self.ep * self.etp)
        return [list(range(b + t, b + self.ep * self.etp, self.etp)) for b in blocks for t in range(self.etp)]

    def edp_group_ranks(self) -> list[list[int]]:
        """Ranks of each expert-data-parallel group, ordered (pp, ep, etp): one rank from every
        (ep, etp) block of a stage, stride ``ep * etp``."""
        return [list(range(p * self.dp_tp + j, (p + 1) * self.dp_tp, self.ep * self.etp))
                for p in range(self.pp) for j in range(self.ep * self.etp)]

    def etp_group_ranks(self) -> list[list[int]]:
        """Ranks of each expert-tensor-parallel group: consecutive blocks of ``etp``."""
        return [list(range(g, g + self.etp)) for g in range(0, self.world_size, self.etp)]

    # ----- nodes (pure arithmetic) ----------------------------------------------------------------

    @property
    def node_size(self) -> int:
        assert self.ranks_per_node is not None, "ranks_per_node (processes per node) is resolved by __post_init__"
        return self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.node_size

    def node_of(self, rank: int) -> int:
        """Node of a global rank: launchers number the processes of a node consecutively."""
        return rank // self.node_size

    @property
    def ep_spans_nodes(self) -> bool:
        """Whether some ep group has ranks on more than one node (its all-to-alls cross nodes)."""
        return self.node_size % (self.ep * self.etp) != 0

    @property
    def hierarchical_ep(self) -> bool:
        """The two-stage exchange runs: asked for (parallel.ep_hierarchical), and ep spans nodes."""
        return self.ep_hierarchical and self.ep_spans_nodes

    def ep_rank_nodes(self, group: int | None = None) -> list[int]:
        """Node of each rank of ep group ``group`` (in ep-rank order); None: this rank's group
        (after build_mesh)."""
        if group is None:
            group = (self.pp_rank * self.edp + self.edp_rank) * self.etp + self.etp_rank
        return [self.node_of(r) for r in self.ep_group_ranks()[group]]

    def ep_node_ranks(self, group: int = 0) -> list[list[int]]:
        """The ep ranks (indices inside ep group ``group``) that share a node, node by node: with
        2 nodes of 2 and ep=4, ``[[0, 1], [2, 3]]``."""
        nodes = self.ep_rank_nodes(group)
        return [[j for j, n in enumerate(nodes) if n == node] for node in dict.fromkeys(nodes)]

    def dp_rank_nodes(self) -> list[int]:
        """Node of each rank of this rank's dp_tp group (its stage, in rank order; stage 0 before
        build_mesh): the group the MoE layers decide capacity drops over."""
        stage = self.pp_rank if self.mesh is not None else 0
        return [self.node_of(r) for r in self.dp_tp_group_ranks()[stage]]

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
        check_launcher_nodes(self.world_size, device_type)
        report_ep_nodes(self)
        # One 1-D root, unflattened twice: FSDP and DTensor need every mesh a parameter lives on
        # to share a root, and the dense and expert axes overlap (parallel folding). Row-major
        # (pp, dp, tp) and (pp, edp, ep, etp) give the rank order of the module docstring.
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        mesh = world._unflatten(0, (self.pp, self.dp, self.tp), ("pp", "dp", "tp"))
        self.moe_mesh = world._unflatten(0, (self.pp, self.edp, self.ep, self.etp), ("pp", "edp", "ep", "etp"))
        # At tp = 1 the stage's ranks are the dp axis itself: no second group over them.
        self._dp_tp_mesh = mesh[("dp", "tp")]._flatten("dp_tp") if self.tp > 1 else mesh["dp"]
        if self.hierarchical_ep:
            # A separate root mesh, like HSDP's: the expert DTensors live on the main one's ep axis.
            # Row-major (edp, nodes of the group, ranks per node) is the rank order above (pp = 1:
            # the hierarchical exchange is for one stage of whole nodes).
            shape = (self.edp, self.ep // self.node_size, self.node_size)
            self._ep_node_mesh = init_device_mesh(device_type, shape, mesh_dim_names=("edp", "ep_inter", "ep_intra"))
        self.mesh = mesh
        return mesh

    def axis_mesh(self, axis: str) -> DeviceMesh:
        """The 1-D mesh of a named axis: "pp", "dp" (the dense parameters' data-parallel axis; all
        ranks at tp = pp = 1), "tp", "dp_tp" (the ranks of this rank's stage, dp x tp flattened, the
        dp axis at tp = 1: each holds different tokens at the MoE layers, so routing counts and
        capacity drops are global over it), "edp", "ep", "etp"; with the hierarchical exchange also
        "ep_inter" (the same local index on the other nodes of this rank's ep group) and "ep_intra"
        (the ranks of its ep group on its node)."""
        if self.mesh is None or self.moe_mesh is None or self._dp_tp_mesh is None:  # build_mesh sets all
            raise RuntimeError("call ParallelDims.build_mesh() first")
        if axis in ("pp", "dp", "tp"):
            return self.mesh[axis]
        if axis in ("edp", "ep", "etp"):
            return self.moe_mesh[axis]
        if axis == "dp_tp":
            return self._dp_tp_mesh
        if axis in ("ep_inter", "ep_intra"):
            if self._ep_node_mesh is None:
                raise RuntimeError("the ep node groups exist once build_mesh() ran with an ep group spanning "
                                   "nodes and ep_hierarchical")
            return self._ep_node_mesh[axis]
        raise ValueError(f"no mesh axis named {axis!r}: one of pp, dp, tp, dp_tp, edp, ep, etp, ep_inter, ep_intra")

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of a named axis (:meth:`axis_mesh`)."""
        return self.axis_mesh(axis).get_group()

    def degree(self, axis: str) -> int:
        """The number of ranks on a named axis of the dense or expert mesh."""
        degrees = {"pp": self.pp, "dp": self.dp, "tp": self.tp, "dp_tp": self.dp_tp, "edp": self.edp,
                   "ep": self.ep, "etp": self.etp}
        if axis not in degrees:
            raise ValueError(f"no parallel degree named {axis!r}: one of {', '.join(degrees)}")
        return degrees[axis]

    @property
    def expert_mesh(self) -> DeviceMesh:
        """What the expert weights are sharded over: the ep axis, and with etp > 1 (ep, etp)."""
        ep = self.axis_mesh("ep")  # checks that the meshes exist
        assert self.moe_mesh is not None
        return ep if self.etp == 1 else self.moe_mesh[("ep", "etp")]

    def check_hsdp(self, replicate: int) -> None:
        """ValueError unless HSDP with ``replicate`` replicas fits these degrees."""
        if not isinstance(replicate, int) or replicate < 1 or self.dp % replicate != 0:
            raise ValueError(f"parallel.hsdp_replicate ({replicate!r}) must be an int >= 1 that divides "
                             f"parallel.dp ({self.dp})")
        if replicate > 1 and (self.tp > 1 or self.pp > 1):
            raise ValueError(f"parallel.hsdp_replicate ({replicate}) needs parallel.tp = 1 and parallel.pp = 1 "
                             f"(are {self.tp}, {self.pp}): its mesh is a root of its own, which tensor-parallel "
                             "DTensors and pipeline stages cannot share")

    def hsdp_mesh(self, replicate: int) -> DeviceMesh:
        """The (dp_replicate, dp_shard) mesh of HSDP with ``replicate`` replicas: shard groups of
        dp / replicate consecutive ranks (one node), replicas striding across nodes. Collective the
        first time; built once."""
        self.check_hsdp(replicate)
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
    def ep_rank(self) -> int:
        return self.axis_mesh("ep").get_local_rank()

    @property
    def edp_rank(self) -> int:
        return self.axis_mesh("edp").get_local_rank()

    @property
    def etp_rank(self) -> int:
        return self.axis_mesh("etp").get_local_rank()

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: the tp ranks of one dp index read the same batch."""
        return self.axis_mesh("dp").get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.axis_mesh("tp").get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.axis_mesh("pp").get_local_rank()

    @property
    def dp_tp_rank(self) -> int:
        """This rank's index among the ranks of its stage (dp_index * tp + tp_index)."""
        return self.axis_mesh("dp_tp").get_local_rank()
