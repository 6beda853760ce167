"""The process runtime: device, process group, collective timeouts, the nodes as the launcher
started them, the few world-wide collectives of setup, and shutdown.

    runtime = init_runtime(device="auto", backend="auto", deterministic=False)
    dims = ParallelDims.from_config(cfg.parallel, world_size=runtime.world_size, ...)
    dims.build_mesh(runtime.device.type)
    ...                                          # long setup: data preparation, checkpoint loading
    set_collective_timeout(cfg.train.collective_timeout_s, dims)
    ...                                          # training
    shutdown()

Under torchrun the ranks come from the environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``); a
plain process is a world of one with an in-memory store, so meshes and collectives work unchanged.
Launchers (torchrun, SLURM) number the processes of one node consecutively, which
``ParallelDims``'s rank order relies on to keep tp and ep groups inside a node; every node must run
the same number of them (``check_launcher_nodes``).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from moetrain.config.train import resolve_device
from moetrain.utils.cpu_allocator import tune_cpu_allocator
from moetrain.utils.devices import set_tf32

if TYPE_CHECKING:
    from moetrain.config.job import JobConfig
    from moetrain.distributed.parallel_dims import ParallelDims

log = logging.getLogger("moetrain")


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: its ranks and its device."""

    world_size: int
    rank: int
    """Global rank."""
    local_rank: int
    """Rank on this node (the CUDA device index)."""
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_job_runtime(cfg: JobConfig) -> Runtime:
    """``init_runtime`` for a job: its train.device, parallel.backend, train.deterministic and
    train.tf32, with host collectives when ZeRO offloads (FSDP2 then keeps the gradients on the
    host, where the global norm and the overflow check reduce them)."""
    offload = cfg.zero.offload_optimizer == "cpu" or cfg.zero.offload_param == "cpu"
    return init_runtime(device=cfg.train.device, backend=cfg.parallel.backend, deterministic=cfg.train.deterministic,
                        tf32=cfg.train.tf32, host_collectives=offload)


def resolve_backend(backend: str, *, device_type: str, host_collectives: bool = False) -> str:
    """The process group's backend: ``parallel.backend`` ("auto": NCCL on CUDA, gloo otherwise),
    with gloo beside NCCL for tensors on the host when ``host_collectives`` (NCCL takes device
    tensors only)."""
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise ValueError(f"parallel.backend ('nccl') needs a CUDA device (this process trains on {device_type!r}): "
                         "NCCL moves GPU tensors only; use 'gloo' or 'auto'")
    return "cuda:nccl,cpu:gloo" if backend == "nccl" and host_collectives else backend


def init_runtime(*, device: str, backend: str, deterministic: bool, tf32: bool = False,
                 host_collectives: bool = False) -> Runtime:
    """Pick the device, set process-wide switches and join the process group (unless one exists).

    ``device`` is ``train.device``, ``backend`` is ``parallel.backend`` (``resolve_backend``),
    ``tf32`` is ``train.tf32``. The group starts with ``SETUP_TIMEOUT`` while
    rank 0 prepares the data and the others wait for it; :func:`set_collective_timeout` sets
    ``train.collective_timeout_s`` afterwards.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        tune_cpu_allocator()
    set_tf32(tf32, device=dev)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    backend = resolve_backend(backend, device_type=dev.type, host_collectives=host_collectives)
    if not dist.is_initialized():
        _init_process_group(backend, world_size=world_size, rank=rank, device=dev)
    return Runtime(world_size=world_size, rank=rank, local_rank=local_rank, device=dev)


SETUP_TIMEOUT = timedelta(hours=2)
"""How long the other ranks wait for rank 0 to prepare the data (tokenizer training, tokenising)
before their first collective times out: explicit, since NCCL's default is 10 minutes (gloo's 30).
A corpus that takes longer is prepared beforehand with ``moetrain data prepare``."""


def _init_process_group(backend: str, *, world_size: int, rank: int, device: torch.device) -> None:
    if world_size == 1:
        # One process: an in-memory store, no port; the mesh and collectives still work.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    device_id = device if "nccl" in backend else None
    store = _restart_safe_store(world_size)
    if store is None:
        dist.init_process_group(backend=backend, device_id=device_id, timeout=SETUP_TIMEOUT)
    else:
        dist.init_process_group(backend=backend, device_id=device_id, store=store, rank=rank,
                                world_size=world_size, timeout=SETUP_TIMEOUT)


def _restart_safe_store(world_size: int) -> dist.Store | None:
    """None (torch's default rendezvous), except in a worker that torchrun restarted while
    sharing its rendezvous store with the workers: that store still holds the previous attempt's
    keys, and the new ranks would read the dead ranks' addresses and hang connecting to them
    (pytorch#135712; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on torchrun avoids it too). A key
    prefix per restart attempt keeps the attempts apart."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == 0:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False)
    return dist.PrefixStore(f"moetrain/attempt_{attempt}", store)


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
    from moetrain.distributed.comm.collectives import all_gather_single  # collectives imports this module

    node = int(os.environ.get("GROUP_RANK", dist.get_rank() // local))
    mine = torch.tensor([local, node], dtype=torch.int64, device=device_type)
    every = torch.empty(world_size * 2, dtype=torch.int64, device=device_type)
    all_gather_single(every, mine)
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
    if dims.tp > 1 and dims.node_size % dims.tp != 0:
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


def set_collective_timeout(timeout_s: float, dims: ParallelDims) -> None:
    """``timeout_s`` (``train.collective_timeout_s``) on every process group training uses: the
    world, the mesh's ep, edp, etp, dp, tp, pp and dp x tp groups, and the hierarchical exchange's
    two (the mesh creates its groups with torch's default of 30 minutes, whatever the world group's
    timeout is)."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:  # not in every torch release
        log.warning("this torch cannot change a process group's timeout: train.collective_timeout_s "
                    "is ignored")
        return
    timeout = timedelta(seconds=timeout_s)
    axes = ["ep", "edp", "etp", "dp", "tp", "pp", "dp_tp"] + (["ep_inter", "ep_intra"] if dims.hierarchical_ep else [])
    groups = [dist.group.WORLD] + [dims.group(axis) for axis in axes]
    unique = {id(g): g for g in groups}
    for group in unique.values():
        set_timeout(timeout, group)


def barrier() -> None:
    """Wait for every rank of the world (no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def broadcast_from_main(value: object) -> object:
    """Rank 0's ``value`` on every rank (a pickled object broadcast: setup decisions only)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown() -> None:
    """Leave the process group (a no-op when there is none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End this process with ``code`` without the interpreter's finalisation, after
    :func:`shutdown` and once everything the run writes is closed.

    For the ranks of a multi-process job: gloo's worker threads destroy a finished collective's
    work, and the Python-owned tensors it holds, just after the ranks return from it. A thread that
    gets there while the interpreter finalises needs the GIL, cannot take it, and aborts the
    process ("terminate called without an active exception", exit -6) after a run that succeeded.
    A final barrier narrows that window; on a loaded machine it still opens (3 of 10 two-rank runs
    on 2 busy cores). Not finalising closes it.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
