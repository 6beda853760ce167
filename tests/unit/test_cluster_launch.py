"""``moetrain launch slurm|k8s``: the files it writes parse (bash -n, YAML), start the torchrun
line and environment the docs describe, embed the resolved config, and bad input is one error
naming the option. (A generated script run end to end: tests/integration/test_cluster_launch_run.py.)"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from moetrain.cli import main
from moetrain.config.loader import config_to_dict, load_config

JOB = ["--parallel.ep=4", "--train.global_batch_size=64", "--train.micro_batch_size=4"]


def _slurm(tmp_path: Path, *extra: str) -> str:
    out = tmp_path / "job.sbatch"
    assert main(["launch", "slurm", "--nodes", "2", "--gpus-per-node", "4", "--out", str(out),
                 f"--log.run_dir={tmp_path / 'runs' / 'moe-a'}", *JOB, *extra]) == 0
    subprocess.run(["bash", "-n", str(out)], check=True)  # the shell's own parser
    return out.read_text()


def _srun_argv(script: str) -> list[str]:
    """The srun command line of the script, continuation lines joined, as the shell splits it."""
    line = re.search(r"^srun .*?&$", script.replace("\\\n", ""), flags=re.M | re.S)
    assert line is not None, script
    return shlex.split(line.group(0).rstrip("&"))


def _heredoc(script: str) -> str:
    match = re.search(r"<<'MOETRAIN_CONFIG'\n(.*?)\nMOETRAIN_CONFIG\n", script, flags=re.S)
    assert match is not None
    return match.group(1)


def test_slurm_script_starts_one_torchrun_agent_per_node_and_requeues(tmp_path):
    script = _slurm(tmp_path, "--partition", "gpu", "--time", "4:00:00")
    directives = re.findall(r"^#SBATCH (\S+)$", script, flags=re.M)
    assert directives == ["--job-name=moe-a", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--exclusive",
                          "--partition=gpu", "--time=4:00:00", "--requeue", "--signal=B:USR1@180",
                          "--open-mode=append", "--output=moe-a-%j.out"]
    assert _srun_argv(script) == [
        "srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        "torchrun", "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=$head_node:29500",
        "--rdzv-id=$SLURM_JOB_ID", "--max-restarts=3", "--shutdown-timeout=150",
        "-m", "moetrain.cli", "train", "--config=$config", "--checkpoint.resume=auto"]
    # The signal before the time limit stops the workers (SIGTERM to the step's processes, not to
    # srun, which would SIGKILL them: they save) and requeues.
    assert re.search(r"trap '.*requeue=1; stop_workers' USR1", script)
    assert 'scancel --signal=TERM "$SLURM_JOB_ID.0"' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert "kill -TERM" not in script
    # The network variables are there for the user to set; nothing is forced without ep_hierarchical.
    for name in ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_GID_INDEX"):
        assert f"# export {name}=" in script
    assert "NCCL_CROSS_NIC" not in script


def test_slurm_script_embeds_the_resolved_config(tmp_path):
    script = _slurm(tmp_path)
    (tmp_path / "embedded.yaml").write_text(_heredoc(script))
    want = load_config(None, [f"--log.run_dir={tmp_path / 'runs' / 'moe-a'}", *JOB], world_size=8)
    assert config_to_dict(load_config(tmp_path / "embedded.yaml")) == config_to_dict(want)


def test_slurm_script_keeps_rail_alignment_for_hierarchical_ep(tmp_path):
    script = _slurm(tmp_path, "--parallel.ep=8", "--parallel.ep_hierarchical=true")
    assert re.search(r"^export NCCL_CROSS_NIC=0$", script, flags=re.M)


def test_k8s_manifest_is_an_elastic_pytorchjob_with_the_config(tmp_path):
    out = tmp_path / "job.yaml"
    assert main(["launch", "k8s", "--nodes", "4", "--min-nodes", "2", "--gpus-per-node", "4", "--image",
                 "reg.example/moetrain:1", "--pvc", "runs", "--name", "moe-b", "--out", str(out),
                 "--log.run_dir=/runs/moe-b", "--parallel.ep=4", "--train.global_batch_size=192",
                 "--train.micro_batch_size=4"]) == 0
    config_map, service, store, job = yaml.safe_load_all(out.read_text())
    assert config_map["kind"] == "ConfigMap" and config_map["metadata"]["name"] == "moe-b-config"
    (tmp_path / "c.yaml").write_text(config_map["data"]["config.yaml"])
    assert load_config(tmp_path / "c.yaml").log.run_dir == "/runs/moe-b"

    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("kubeflow.org/v1", "PyTorchJob", "moe-b")
    assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "rdzvHost": "moe-b-rdzv", "rdzvPort": 29500,
                                            "minReplicas": 2, "maxReplicas": 4, "maxRestarts": 3, "nProcPerNode": 4}
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4 and worker["restartPolicy"] == "OnFailure"
    assert worker["template"]["spec"]["terminationGracePeriodSeconds"] == 180  # --grace 150 and 30 s
    (container,) = worker["template"]["spec"]["containers"]
    assert container["command"] == [
        "torchrun", "--nnodes=2:4", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=moe-b-rdzv:29500",
        "--rdzv-id=moe-b", "--rdzv-conf=is_host=false", "--max-restarts=3", "--shutdown-timeout=150",
        "-m", "moetrain.cli", "train", "--config=/etc/moetrain/config.yaml", "--checkpoint.resume=auto"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in container["env"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"config": "/etc/moetrain", "dshm": "/dev/shm", "runs": "/runs"}
    volumes = {v["name"]: v for v in worker["template"]["spec"]["volumes"]}
    assert volumes["runs"]["persistentVolumeClaim"] == {"claimName": "runs"}
    assert volumes["config"]["configMap"] == {"name": "moe-b-config"}

    # The store that every node's agent names runs on none of them: losing any node keeps it.
    assert (service["kind"], service["metadata"]["name"]) == ("Service", "moe-b-rdzv")
    assert service["spec"]["ports"] == [{"port": 29500, "targetPort": 29500}]
    assert (store["kind"], store["spec"]["replicas"]) == ("Deployment", 1)
    assert store["spec"]["template"]["metadata"]["labels"] == service["spec"]["selector"]
    (server,) = store["spec"]["template"]["spec"]["containers"]
    assert server["image"] == "reg.example/moetrain:1"
    assert server["command"] == ["python", "-m", "moetrain.cli", "launch", "store", "--port=29500"]


def test_k8s_manifest_of_a_fixed_size_job_hosts_the_rendezvous_on_worker_0(tmp_path):
    out = tmp_path / "job.yaml"
    assert main(["launch", "k8s", "--nodes", "2", "--gpus-per-node", "4", "--image", "img", "--name", "moe-c",
                 "--out", str(out), "--parallel.ep=4", "--train.global_batch_size=64"]) == 0
    kinds = [doc["kind"] for doc in yaml.safe_load_all(out.read_text())]
    assert kinds == ["ConfigMap", "PyTorchJob"]
    job = list(yaml.safe_load_all(out.read_text()))[1]
    command = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    assert "--rdzv-endpoint=moe-c-worker-0:29500" in command and "--rdzv-conf=is_host=false" not in command


@pytest.mark.parametrize(("argv", "named"), [
    (["slurm", "--nodes", "0", "--gpus-per-node", "4"], "--nodes 0"),
    (["slurm", "--nodes", "3", "--gpus-per-node", "4"], "--nodes 3 x --gpus-per-node 4 = 12 processes"),
    (["slurm", "--nodes", "2", "--gpus-per-node", "4", "--time", "soon"], "--time 'soon'"),
    (["slurm", "--nodes", "2", "--gpus-per-node", "4", "--partition", "a b"], "--partition 'a b'"),
    (["slurm", "--nodes", "2", "--gpus-per-node", "4", "--nproc", "8"], "--nproc 8"),
    (["slurm", "--nodes", "2", "--gpus-per-node", "4", "--grace", "0"], "--grace 0"),
    (["slurm", "--nodes", "2", "--gpus-per-node", "4", "--checkpoint.resume=never"], "checkpoint.resume 'never'"),
    (["slurm", "--nodes", "2", "--gpus-per-node", "4", "--name", "Bad_Name"], "--name 'Bad_Name'"),
    # ep=6 at 4 ranks a node spans nodes without being whole nodes: a rule of the node layout,
    # which only --gpus-per-node tells.
    (["slurm", "--nodes", "3", "--gpus-per-node", "4", "--moe.num_experts=12", "--parallel.ep=6",
      "--parallel.ep_hierarchical=true", "--train.global_batch_size=96"], "ranks per node (4)"),
    (["k8s", "--nodes", "2", "--gpus-per-node", "4", "--image", "x", "--min-nodes", "3"], "--min-nodes 3"),
    # At 3 nodes (elastic down to 1) the batch does not divide: every world the job can have is checked.
    (["k8s", "--nodes", "4", "--gpus-per-node", "4", "--image", "x", "--min-nodes", "1"], "--nodes 3 x"),
    (["k8s", "--nodes", "2", "--gpus-per-node", "4", "--image", "x", "--pvc", "runs"], "--mount-path '/runs'"),
])
def test_bad_input_is_one_error_naming_the_option(argv, named, capsys):
    assert main(["launch", argv[0], "--log.run_dir=runs/moe-c", *JOB, *argv[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moetrain: error: ") and "\n" not in err and named in err, err
