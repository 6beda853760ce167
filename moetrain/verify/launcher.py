"""The processes of ``moetrain verify``'s training runs: one server process imports the training
stack once, then forks every rank of every run from it.

A verification is 1 + 2 x (layouts) runs of ``moetrain train``; started as fresh interpreters
(``moetrain train --nproc N``: the command, torchrun, then N ranks) each run imports torch and the
trainer 2 + N times, about 2.5 s of CPU each, which was most of a verification's time. A rank
forked from the server starts with them imported. Each rank is still its own process running the
``moetrain`` command (``python -m moetrain.cli train ...``) with the environment torchrun gives a
rank (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``), so the run is
the one a user launches.

Forking is safe because the server only imports: torch starts no thread and no device until a
rank uses them, after the fork. The server is ``python -m moetrain.verify.launcher``; it reads one
JSON request per line on stdin and answers each with the run's exit code:

    request  {"argv": [...], "nproc": N, "log": PATH, "env": {...}, "timeout_s": T}
    answer   {"code": C}        (the first non-zero exit of a rank, else 0; -1 after the timeout)

When a rank fails, the others of its run are killed (a peer would wait in a collective for it), as
torchrun does.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "moetrain.train.trainer", "moetrain.cli")
"""What the server imports before any fork: torch, the trainer's import chain (DTensor, FSDP2,
DCP; dynamo, which the optimizer imports) and the command. Named as strings: the server runs the
``moetrain`` command as a program, as a subprocess would, and never calls into it."""


class Launcher:
    """A started server; ``run`` one run at a time; ``close`` (or ``with``) ends it. The server
    takes its environment (PYTHONPATH included) from this process when it starts; each run's ranks
    take this process's environment at the time of ``run``."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "moetrain.verify.launcher"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=dict(os.environ))
        self._ready = False

    def run(self, argv: list[str], *, nproc: int, log: Path, timeout_s: float) -> int:
        """Run ``moetrain ARGV`` in ``nproc`` ranks, their output to ``log``; the exit code."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        if not self._ready:
            self._ready = self._proc.stdout.readline().strip() == "ready"
            if not self._ready:
                raise RuntimeError(f"verify's launcher did not start (exit {self._proc.wait()})")
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")  # the ranks share the cores; more threads only contend
        request = {"argv": argv, "nproc": nproc, "log": str(log), "env": env, "timeout_s": timeout_s}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        answer = self._proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"verify's launcher ended (exit {self._proc.wait()}) during a run; see {log}")
        return int(json.loads(answer)["code"])

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, request: dict, port: int) -> None:
    """In the forked child: become rank ``rank`` of the run and run the command; never returns."""
    code = 1
    try:
        nproc = request["nproc"]
        os.environ.clear()
        os.environ.update(request["env"])
        if nproc > 1:  # what torchrun gives each rank of a single-node job
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                              LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        import torch

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        sys.argv = ["moetrain", *request["argv"]]
        try:
            runpy.run_module("moetrain.cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - whatever the command raised goes to its log
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(request: dict) -> int:
    """Fork the run's ranks and wait for them: the first non-zero exit (the others killed), -1 on
    the timeout, else 0."""
    nproc = request["nproc"]
    port = _free_port() if nproc > 1 else 0
    sys.stdout.flush()
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _rank(rank, request, port)
        pids.append(pid)
    deadline = time.monotonic() + request["timeout_s"]
    live, code = set(pids), 0
    while live:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                code = -1
                break
            time.sleep(0.02)
            continue
        live.discard(pid)
        exit_code = os.waitstatus_to_exitcode(status)
        if exit_code != 0:
            code = exit_code
            break
    for pid in live:  # a failed rank's peers would wait for it in a collective
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return code


def serve() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        if line.strip():
            out.write(json.dumps({"code": _run(json.loads(line))}) + "\n")
            out.flush()


if __name__ == "__main__":
    serve()
    os._exit(0)  # nothing left to write: skip finalising the imported stack (seconds of CPU)
