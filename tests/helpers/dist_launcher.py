"""Run a function on N real processes joined by a gloo process group.

Processes come from a forkserver that has torch, torch.distributed and the trainer's modules
preloaded: a child then starts with them imported (a 4-rank test takes ~7 s instead of ~17 s with
spawn), but is forked from a clean server, not from the test process. Forking the test process
itself hangs or segfaults the children once that process has used gloo (an in-process Trainer, a
world-1 group): gloo's threads and state do not survive fork. The rendezvous goes through a
file store in a fresh temporary directory, so concurrent tests never race for a TCP port.

A rank's return value comes back through ``torch.save`` bytes (not shared-memory tensors, whose
file descriptors can outlive the child). A rank that raises makes ``run_ranks`` raise with the
tracebacks of every rank that failed within a few seconds, the cause before its peers' echoes; a
hang (a collective that never completes) fails after ``timeout_s``; either way every child is killed.
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


class RankError(RuntimeError):
    """A rank raised; the message holds its traceback."""


def _rank_main(fn, rank: int, world_size: int, init_file: str, results, args, kwargs, threads: int,
               collective_timeout_s: float) -> None:
    # One thread per rank: the ranks share 2 cores, more threads only contend.
    torch.set_num_threads(threads)
    # A rank still running just before the parent gives up prints every thread's stack (into the
    # test's captured stderr): where a hang hangs, which the timeout alone does not say.
    faulthandler.dump_traceback_later(max(1.0, collective_timeout_s - 3.0), exit=False)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout_s))
        out = fn(rank, world_size, *args, **kwargs)
        if dist.is_initialized():
            # A rank done early must not tear its groups down while a slower peer is still
            # connecting to one of them (gloo: "Connection closed by peer" on that peer).
            dist.barrier()
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report anything, including KeyboardInterrupt, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        if dist.is_initialized():
            dist.destroy_process_group()


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""What gloo says on the ranks whose peer went away: echoes of a failure elsewhere."""


def _failure_report(world_size: int, failed: dict, results, procs, grace_s: float = 5.0) -> str:
    """Every rank that died without a result and every failing rank's traceback, the cause first.
    The first report to arrive is often a peer's "Connection closed (or reset) by peer" from the
    collective it was in when the failing rank tore its group down (or died), so the others get
    ``grace_s`` to report (or die) before the verdict."""
    deadline = time.monotonic() + grace_s
    while len(failed) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            if all(p.exitcode is not None for r, p in enumerate(procs) if r not in failed):
                break
            continue
        if not ok:
            failed[rank] = payload
    died = {r: p.exitcode for r, p in enumerate(procs) if r not in failed and p.exitcode not in (None, 0)}
    order = sorted(failed, key=lambda r: (any(m in failed[r] for m in _PEER_GONE), r))
    parts = [f"rank {r} of {world_size} failed:\n{failed[r]}" for r in order]
    if died:
        parts.insert(0, f"ranks {sorted(died)} died without a result (exit codes {list(died.values())})")
    return "\n".join(parts)


def run_ranks(fn, world_size: int, *args, timeout_s: float = 90.0, threads: int = 1, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked gloo ranks and return
    the per-rank results in rank order. ``fn`` must be a module-level function."""
    ctx = mp.get_context("forkserver")
    # The trainer's import chain (DTensor, FSDP2, DCP: ~2 s of CPU) is paid once, not by every rank.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "tests.helpers.dist_launcher",
                                "moetrain.train.trainer"])
    tmp = tempfile.mkdtemp(prefix="moetrain-dist-")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(fn, rank, world_size, os.path.join(tmp, "store"), results, args, kwargs, threads,
                               timeout_s))
             for rank in range(world_size)]
    try:
        for p in procs:
            p.start()
        done: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        while len(done) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(done))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout_s} s")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                if any(r not in done and p.exitcode not in (None, 0) for r, p in enumerate(procs)):
                    raise RankError(_failure_report(world_size, {}, results, procs)) from None
                continue
            if not ok:
                raise RankError(_failure_report(world_size, {rank: payload}, results, procs))
            done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        for p in procs:
            p.join(timeout=10)
        return [done[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)
