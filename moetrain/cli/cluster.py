"""``moetrain launch``: job files for a cluster, written once the job is checked at its world size.

    moetrain launch slurm --config X --nodes N --gpus-per-node G [--partition P] [--time T]
                          [--out FILE] [--name NAME] [--max-restarts R] [--port 29500] [--grace S]
                          [--section.field=value ...]
    moetrain launch k8s --config X --nodes N --gpus-per-node G --image IMAGE [--min-nodes M]
                        [--namespace NS] [--pvc CLAIM --mount-path /runs] [--out FILE] ...
    moetrain launch store [--port 29500]

``slurm`` writes an sbatch script, ``k8s`` a Kubeflow PyTorchJob (with a ConfigMap of the config);
both embed the resolved config and resume from the latest checkpoint when the job is requeued or
restarted (moetrain.plan.cluster; docs/cluster.md). Without ``--out`` the file is printed.
``store`` hosts an elastic job's c10d rendezvous store apart from its nodes, so that losing any
node loses no rendezvous state (the k8s manifest of an elastic job runs it in a pod of its own).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from moetrain.cli.launch import add_job_args, load_job


def add_parsers(sub) -> None:
    launch = sub.add_parser("launch", help="write a SLURM script or a Kubernetes manifest for a cluster job")
    launch_sub = launch.add_subparsers(dest="launch_cmd", required=True)
    slurm = launch_sub.add_parser("slurm", help="an sbatch script: torchrun per node, requeue on preemption")
    _add_common(slurm)
    slurm.add_argument("--partition", default=None)
    slurm.add_argument("--time", default=None, help="the job's time limit (e.g. 24:00:00)")
    slurm.set_defaults(func=run_slurm, takes_overrides=True)
    k8s = launch_sub.add_parser("k8s", help="a Kubeflow PyTorchJob manifest with an elastic policy")
    _add_common(k8s)
    k8s.add_argument("--image", required=True, help="the container image (with moetrain installed)")
    k8s.add_argument("--min-nodes", type=int, default=None,
                     help="elastic: keep training on as few as M nodes (default: --nodes)")
    k8s.add_argument("--namespace", default=None)
    k8s.add_argument("--pvc", default=None, help="a PersistentVolumeClaim for log.run_dir (the checkpoints)")
    k8s.add_argument("--mount-path", default="/runs", help="where --pvc is mounted (default /runs)")
    k8s.set_defaults(func=run_k8s, takes_overrides=True)
    store = launch_sub.add_parser("store", help="host a c10d rendezvous store until SIGTERM (torchrun agents "
                                                "then use --rdzv-conf is_host=false)")
    store.add_argument("--port", type=int, default=29500, help="the port to listen on (default 29500)")
    store.set_defaults(func=run_store, takes_overrides=False)


def _add_common(sp: argparse.ArgumentParser) -> None:
    add_job_args(sp)
    sp.add_argument("--nodes", type=int, required=True)
    sp.add_argument("--gpus-per-node", type=int, required=True, help="processes per node (one per GPU)")
    sp.add_argument("--name", default=None, help="job name (default: the run folder's name)")
    sp.add_argument("--max-restarts", type=int, default=3, help="torchrun's worker restarts (default 3)")
    sp.add_argument("--port", type=int, default=29500, help="port of the c10d rendezvous (default 29500)")
    sp.add_argument("--grace", type=int, default=150, metavar="S",
                    help="seconds the workers get after SIGTERM to finish the step and save (default 150); "
                         "Slurm signals, and Kubernetes waits, 30 s more")
    sp.add_argument("--out", default=None, help="write here (default: print)")


def build_job(args: argparse.Namespace, overrides: list[str], *, min_nodes: int | None = None):
    """The ``ClusterJob`` of ``args``: the job config checked at every world size the job can
    have (``--nodes`` x ``--gpus-per-node``, and down to ``--min-nodes`` when elastic)."""
    import yaml

    from moetrain.config.loader import config_to_dict
    from moetrain.plan.cluster import ClusterJob

    if args.nproc is not None:
        raise ValueError(f"--nproc {args.nproc}: a cluster job's processes are --nodes x --gpus-per-node")
    name = args.name
    for option, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
        if value < 1:
            raise ValueError(f"{option} {value}: must be >= 1")
    if min_nodes is not None and not 1 <= min_nodes <= args.nodes:
        raise ValueError(f"--min-nodes {min_nodes}: must be from 1 to --nodes ({args.nodes})")
    cfg = None
    for nodes in range(min_nodes or args.nodes, args.nodes + 1):
        cfg = _check_at(args, overrides, nodes=nodes)
    assert cfg is not None  # the range holds --nodes
    if cfg.checkpoint.resume != "auto":
        raise ValueError(f"checkpoint.resume {cfg.checkpoint.resume!r}: a cluster job must use \"auto\", so that a "
                         "requeued or restarted job continues from its latest checkpoint")
    run_dir = cfg.log.run_dir
    if name is None:
        name = "".join(c if c.isalnum() else "-" for c in Path(run_dir).name.lower()).strip("-")[:42] or "moetrain"
    text = "# Resolved moetrain config\n" + yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    return ClusterJob(name=name, nodes=args.nodes, gpus_per_node=args.gpus_per_node, config_yaml=text,
                      run_dir=run_dir, min_nodes=min_nodes, max_restarts=args.max_restarts,
                      ep_hierarchical=cfg.parallel.ep_hierarchical, rdzv_port=args.port, grace_s=args.grace)


def _check_at(args: argparse.Namespace, overrides: list[str], *, nodes: int):
    """The job config at ``nodes`` nodes: the launch checks of ``moetrain train`` (layout, batch,
    pipeline) at that world size, plus the node-aware layout rules at ``--gpus-per-node`` ranks a node."""
    from moetrain.distributed.parallel_dims import ParallelDims

    world = nodes * args.gpus_per_node
    where = f"--nodes {nodes} x --gpus-per-node {args.gpus_per_node} = {world} processes"
    checked = argparse.Namespace(config=args.config, deepspeed=args.deepspeed, nproc=world)
    try:
        cfg = load_job(checked, overrides, world=world)
        ParallelDims.from_config(cfg.parallel, world_size=world, ranks_per_node=args.gpus_per_node,
                                 num_experts=cfg.moe.num_experts if cfg.model.is_moe else None)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    return cfg


def _write(text: str, out: str | None, what: str) -> None:
    if out is None:
        sys.stdout.write(text)
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {what} {path}", file=sys.stderr)


def _command(args: argparse.Namespace) -> str:
    return "moetrain " + " ".join(shlex.quote(a) for a in args.argv)


def run_slurm(args: argparse.Namespace, overrides: list[str]) -> int:
    from moetrain.plan.cluster import slurm_script

    job = build_job(args, overrides)
    text = slurm_script(job, partition=args.partition, time=args.time, command=_command(args))
    _write(text, args.out, "sbatch script")
    if args.out is not None:
        print(f"submit with: sbatch {args.out}", file=sys.stderr)
    return 0


def run_k8s(args: argparse.Namespace, overrides: list[str]) -> int:
    from moetrain.plan.cluster import k8s_manifest

    job = build_job(args, overrides, min_nodes=args.min_nodes)
    text = k8s_manifest(job, image=args.image, namespace=args.namespace, pvc=args.pvc, mount_path=args.mount_path)
    _write(text, args.out, "Kubernetes manifest")
    if args.out is not None:
        print(f"submit with: kubectl apply -f {args.out}", file=sys.stderr)
    return 0


def run_store(args: argparse.Namespace, overrides: list[str]) -> int:
    """Serve a TCPStore on every interface until SIGTERM or SIGINT. The store holds the
    rendezvous rounds of the agents that name it as their endpoint; it holds no training state,
    so the job outlives any of its nodes but not this process."""
    import signal
    import threading

    if isinstance(args.port, bool) or not 1 <= args.port <= 65535:
        raise ValueError(f"--port {args.port!r}: must be a TCP port (1-65535)")
    from torch.distributed import TCPStore

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    store = TCPStore("0.0.0.0", args.port, is_master=True, wait_for_workers=False)
    print(f"rendezvous store listening on port {store.port}", flush=True)
    stop.wait()
    return 0
