"""Cluster job files for a checked job config: a SLURM batch script and a Kubeflow PyTorchJob
manifest (``moetrain launch slurm|k8s``; docs/cluster.md).

Both start one torchrun agent per node with c10d rendezvous, embed the resolved config (so every
node trains the same job, whatever files the nodes see) and train with ``checkpoint.resume=auto``:
a job that is requeued, restarted or rescheduled continues from its latest checkpoint.

    job = ClusterJob(name="moe", nodes=2, gpus_per_node=8, config_yaml=..., run_dir="runs/moe")
    slurm_script(job, partition="gpu", time="24:00:00")       # text of an sbatch script
    k8s_manifest(job, image="registry/moetrain:1.0")         # YAML: a ConfigMap and a PyTorchJob
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

import yaml

RDZV_PORT = 29500
CONFIG_MOUNT = "/etc/moetrain"
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?$")


class _Block(str):
    """Text that the manifest shows as a YAML block (``|``), line for line."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Block, lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|"))


@dataclass(frozen=True)
class ClusterJob:
    """What both job files need. ``min_nodes`` < ``nodes``: an elastic job (torchrun
    ``--nnodes MIN:MAX``), which moetrain resumes at any world size in between."""

    name: str
    """The job's name: lower-case letters, digits and '-' (a Kubernetes object name)."""
    nodes: int
    gpus_per_node: int
    config_yaml: str
    """The resolved job config (``save_config``'s text)."""
    run_dir: str
    """``log.run_dir``: on storage that every node shares and that outlives the job."""
    min_nodes: int | None = None
    max_restarts: int = 3
    """Restarts of the workers torchrun allows (a lost rank restarts the job from its checkpoint)."""
    ep_hierarchical: bool = False
    rdzv_port: int = RDZV_PORT
    """The port of the c10d rendezvous on the first node (slurm) or worker 0 (k8s)."""
    grace_s: int = 150
    """Seconds the workers get after SIGTERM to finish their step and save a checkpoint before
    torchrun kills them (its ``--shutdown-timeout``); the scheduler's own notice is 30 s longer."""

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"--name {self.name!r}: must be 1-42 lower-case letters, digits or '-', "
                             "starting and ending with a letter or digit (a Kubernetes object name)")
        for option, value in (("--nodes", self.nodes), ("--gpus-per-node", self.gpus_per_node)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{option} {value!r}: must be an integer >= 1")
        low = self.min_nodes
        if low is not None and (isinstance(low, bool) or not isinstance(low, int) or not 1 <= low <= self.nodes):
            raise ValueError(f"--min-nodes {low!r}: must be an integer from 1 to --nodes ({self.nodes})")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"--max-restarts {self.max_restarts!r}: must be an integer >= 0")
        if isinstance(self.rdzv_port, bool) or not isinstance(self.rdzv_port, int) or not 1 <= self.rdzv_port <= 65535:
            raise ValueError(f"--port {self.rdzv_port!r}: must be a TCP port (1-65535)")
        if isinstance(self.grace_s, bool) or not isinstance(self.grace_s, int) or self.grace_s < 1:
            raise ValueError(f"--grace {self.grace_s!r}: must be a number of seconds >= 1")

    @property
    def notice_s(self) -> int:
        """The scheduler's notice before it kills the job: the workers' grace and 30 s for the rest."""
        return self.grace_s + 30

    @property
    def nnodes(self) -> str:
        """torchrun's ``--nnodes``: ``N``, or ``MIN:MAX`` for an elastic job."""
        low = self.min_nodes if self.min_nodes is not None else self.nodes
        return str(self.nodes) if low == self.nodes else f"{low}:{self.nodes}"

    def torchrun_args(self, *, rdzv_endpoint: str, rdzv_id: str, config_path: str,
                      external_store: bool = False) -> list[str]:
        """The torchrun command line every node runs (an argv; values may hold shell variables).
        ``external_store``: the endpoint is a store no node hosts (``moetrain launch store``)."""
        rdzv_conf = ["--rdzv-conf=is_host=false"] if external_store else []
        return ["torchrun", f"--nnodes={self.nnodes}", f"--nproc-per-node={self.gpus_per_node}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}", *rdzv_conf,
                f"--max-restarts={self.max_restarts}", f"--shutdown-timeout={self.grace_s}",
                "-m", "moetrain.cli", "train", f"--config={config_path}", "--checkpoint.resume=auto"]


def _nccl_comments(job: ClusterJob) -> list[str]:
    """The network settings that decide NCCL's and gloo's speed, left for the user to fill in."""
    lines = [
        "# Network: set these for your cluster (its admins know the names). NCCL picks InfiniBand/RoCE",
        "# adapters and interfaces itself, but a wrong guess costs a large factor or hangs at startup.",
        "# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3   # the IB/RoCE adapters NCCL may use (one per GPU rail)",
        "# export NCCL_IB_GID_INDEX=3                       # RoCE only: the GID of the RoCEv2 address",
        "# export NCCL_SOCKET_IFNAME=ib0                    # interface of NCCL's bootstrap and socket fallback",
        "# export GLOO_SOCKET_IFNAME=ib0                    # the same for gloo (checkpoint.async_save, CPU groups)",
        "# export NCCL_DEBUG=WARN                           # INFO prints the transports and rings NCCL chose",
    ]
    if job.ep_hierarchical:
        lines += [
            "# parallel.ep_hierarchical: a token crosses nodes only between GPUs of the same local index",
            "# (the same rail); keep NCCL on each GPU's own NIC so that this traffic stays on its rail:",
            "export NCCL_CROSS_NIC=0",
        ]
    return lines


def slurm_script(job: ClusterJob, *, partition: str | None = None, time: str | None = None,
                 command: str = "") -> str:
    """An sbatch script: ``job.nodes`` nodes, one torchrun agent per node (srun), rendezvous on
    the first node. ``job.notice_s`` seconds before the time limit Slurm sends SIGUSR1 to the
    script, which sends SIGTERM to the agents (the workers finish the step and save a checkpoint)
    and requeues the job; a preempted job (``--requeue``) is requeued by Slurm. Either way the
    requeued job resumes from the latest checkpoint. ``command``: the command that wrote it."""
    if time is not None and not re.match(r"^(\d+-)?\d+(:\d{1,2}){0,2}$", time):
        raise ValueError(f"--time {time!r}: must be a Slurm time limit such as 90, 4:00:00 or 2-00:00:00")
    if partition is not None and not re.match(r"^[\w.-]+(,[\w.-]+)*$", partition):
        raise ValueError(f"--partition {partition!r}: must be a Slurm partition name (letters, digits, '_', '.', '-')")
    header = ["#!/bin/bash", f"# {command}" if command else "# moetrain launch slurm",
              f"#SBATCH --job-name={job.name}", f"#SBATCH --nodes={job.nodes}",
              "# One torchrun agent per node; it starts one process per GPU.",
              "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={job.gpus_per_node}", "#SBATCH --exclusive"]
    header += [f"#SBATCH --partition={partition}"] if partition else []
    header += [f"#SBATCH --time={time}"] if time else []
    header += [
        "# A preempted job goes back to the queue; SIGUSR1 comes to this script before the time limit,",
        "# which then saves and requeues; a requeued job appends to the same log.",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{job.notice_s}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={job.name}-%j.out",
    ]
    torchrun = job.torchrun_args(rdzv_endpoint=f'"$head_node:{job.rdzv_port}"', rdzv_id='"$SLURM_JOB_ID"',
                                 config_path='"$config"')
    body = [
        "set -euo pipefail",
        "",
        *_nccl_comments(job),
        "",
        "# The resolved job config, written where every node reads it (log.run_dir must be on shared storage).",
        f"run_dir={shlex.quote(job.run_dir)}",
        'config="$run_dir/launch_config.yaml"',
        'mkdir -p "$run_dir"',
        "cat > \"$config\" <<'MOETRAIN_CONFIG'",
        job.config_yaml.rstrip("\n"),
        "MOETRAIN_CONFIG",
        "",
        "# The rendezvous (c10d) is hosted by the first node's agent.",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        "",
        'requeue=0 srun_pid=""',
        "# The workers finish their step, save a checkpoint and exit. SIGTERM to every process of the",
        "# job step (srun's first, .0): srun itself would turn a SIGTERM into SIGKILL for its tasks.",
        "stop_workers() {",
        '    scancel --signal=TERM "$SLURM_JOB_ID.0" 2>/dev/null || true',
        "}",
        "trap 'echo \"moetrain: time limit near: saving and requeueing\"; requeue=1; stop_workers' USR1",
        "trap 'echo \"moetrain: SIGTERM (preempted or cancelled): saving\"; stop_workers' TERM",
        "",
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        "    " + " \\\n    ".join(_join_pairs(torchrun)) + " &",
        "srun_pid=$!",
        "# A trapped signal cuts `wait` short: wait again until srun itself has ended.",
        'while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid" || true; done',
        'wait "$srun_pid" && status=0 || status=$?',
        'if [ "$requeue" = 1 ]; then',
        '    scontrol requeue "$SLURM_JOB_ID"  # resumes from the checkpoint just saved (checkpoint.resume=auto)',
        "    exit 0",
        "fi",
        'exit "$status"',
    ]
    return "\n".join(header + [""] + body) + "\n"


def _join_pairs(argv: list[str]) -> list[str]:
    """The torchrun argv as continuation lines: options one per line, ``-m moetrain.cli train``
    and its arguments on the last."""
    cut = argv.index("-m")
    return [" ".join(argv[:2]), *argv[2:cut], " ".join(argv[cut:])]


def k8s_manifest(job: ClusterJob, *, image: str, namespace: str | None = None, pvc: str | None = None,
                 mount_path: str = "/runs") -> str:
    """YAML documents: a ConfigMap holding the resolved config and a Kubeflow PyTorchJob of
    ``job.nodes`` pods, each one torchrun agent with ``job.gpus_per_node`` GPUs. Its elasticPolicy
    (c10d rendezvous, minReplicas..maxReplicas, maxRestarts) is torchrun's elastic mode, in which
    moetrain restarts at the new world size from its latest checkpoint. An elastic job's
    rendezvous store runs in a Deployment and Service of its own (``moetrain launch store``): hosted
    on worker 0, as the operator's default has it, losing that node would leave the others unable
    to re-form at ``--min-nodes``. A fixed-size job keeps it on worker 0, which restarts with it.
    ``pvc``: a PersistentVolumeClaim mounted at ``mount_path``, which must hold ``log.run_dir``."""
    if not image or any(c.isspace() for c in image):
        raise ValueError(f"--image {image!r}: must be a container image reference (no spaces)")
    if pvc is not None and not _NAME_RE.match(pvc):
        raise ValueError(f"--pvc {pvc!r}: must be a PersistentVolumeClaim name (lower-case letters, digits, '-')")
    if pvc is not None and not (job.run_dir + "/").startswith(mount_path.rstrip("/") + "/"):
        raise ValueError(f"log.run_dir {job.run_dir!r} is not under --mount-path {mount_path!r}: checkpoints "
                         "would be lost with the pod; set --log.run_dir=<mount path>/<run>")
    meta = {"name": job.name, **({"namespace": namespace} if namespace else {})}
    low = job.min_nodes if job.min_nodes is not None else job.nodes
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**meta, "name": f"{job.name}-config"},
                  "data": {"config.yaml": _Block(job.config_yaml)}}
    elastic = low < job.nodes
    rdzv_host = f"{job.name}-rdzv" if elastic else f"{job.name}-worker-0"
    command = job.torchrun_args(rdzv_endpoint=f"{rdzv_host}:{job.rdzv_port}", rdzv_id=job.name,
                                config_path=f"{CONFIG_MOUNT}/config.yaml", external_store=elastic)
    # Without it, an agent that stays rank 0 across a membership change does not publish the
    # master address again (docs/checkpoints.md, elastic membership).
    env = [{"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"}]
    if job.ep_hierarchical:
        env.append({"name": "NCCL_CROSS_NIC", "value": "0"})
    mounts = [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict] = [{"name": "config", "configMap": {"name": f"{job.name}-config"}},
                           {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if pvc is not None:
        mounts.append({"name": "runs", "mountPath": mount_path})
        volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": pvc}})
    container = {"name": "pytorch", "image": image, "command": command, "env": env,
                 "resources": {"limits": {"nvidia.com/gpu": job.gpus_per_node}}, "volumeMounts": mounts}
    pytorch_job = {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": meta,
        "spec": {
            "elasticPolicy": {"rdzvBackend": "c10d", "rdzvHost": rdzv_host, "rdzvPort": job.rdzv_port,
                              "minReplicas": low,
                              "maxReplicas": job.nodes, "maxRestarts": job.max_restarts,
                              "nProcPerNode": job.gpus_per_node},
            "pytorchReplicaSpecs": {"Worker": {
                "replicas": job.nodes, "restartPolicy": "OnFailure",
                "template": {"spec": {"terminationGracePeriodSeconds": job.notice_s, "containers": [container],
                                      "volumes": volumes}}}},
        },
    }
    head = ("# Network settings that matter (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME): "
            "docs/cluster.md\n")
    store = _rendezvous_store(job, image=image, meta=meta) if elastic else []
    return head + yaml.dump_all([config_map, *store, pytorch_job], Dumper=_Dumper, sort_keys=False)


def _rendezvous_store(job: ClusterJob, *, image: str, meta: dict) -> list[dict]:
    """A Service and a one-replica Deployment serving the rendezvous store on no training node."""
    name, labels = f"{job.name}-rdzv", {"app": f"{job.name}-rdzv"}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {**meta, "name": name},
               "spec": {"selector": labels, "ports": [{"port": job.rdzv_port, "targetPort": job.rdzv_port}]}}
    container = {"name": "store", "image": image,
                 "command": ["python", "-m", "moetrain.cli", "launch", "store", f"--port={job.rdzv_port}"],
                 "ports": [{"containerPort": job.rdzv_port}],
                 "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}}}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {**meta, "name": name},
                  "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                           "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}}}}
    return [service, deployment]
