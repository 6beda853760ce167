"""Checkpoints written while training goes on (``checkpoint.async_save``).

    saver = BackgroundSaver(timeout_s=600)   # collective: its own gloo groups
    saver.start(pending)                     # waits for the previous save, stages a CPU copy, returns
    saver.poll()                             # every step; collective while a save is in flight
    saver.wait()                             # the save in flight published (or its error raised)

The training loop is blocked only while ``pending``'s tensors are copied to CPU memory (DCP's
``async_save`` stages them before it returns), so the next optimizer step can change the live
tensors while the copy is written. A thread then runs DCP's write and the same publication as a
synchronous save (``publish_save``: hashes, manifest, rename, ``latest``), which starts only once
every rank's write has returned: a checkpoint appears complete or not at all, exactly as before,
and a process killed mid-write leaves only a ``.step_N.tmp`` folder. At most one save is in
flight: the next one waits for it, so memory holds one staged copy at a time.

Two gloo groups of their own, so that no collective of the thread interleaves with those of the
training loop: one for the thread's writing and publication, one for ``poll``. ``poll`` agrees
across ranks on whether every rank's thread has finished, so all ranks raise a failed save's
error at the same step (a rank that stopped alone would leave the others blocked in training
collectives).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moetrain.train.checkpoint.files import dcp_write_error
from moetrain.train.checkpoint.state import PendingSave, checkpoint_writer, publish_save

log = logging.getLogger("moetrain")


class BackgroundSaver:
    """At most one checkpoint save in flight in a background thread. Build it on every rank (it
    creates two process groups when a process group exists)."""

    def __init__(self, *, timeout_s: float) -> None:
        multi = dist.is_initialized()
        # Gloo whatever the training backend: DCP's async save needs a group with a CPU backend.
        # ``timeout_s`` (train.collective_timeout_s, as for a synchronous save) bounds the wait for
        # a rank that died mid-save, so that the thread, which the interpreter joins at exit, ends.
        timeout = timedelta(seconds=timeout_s)
        self._write_group = dist.new_group(backend="gloo", timeout=timeout) if multi else None
        self._poll_group = dist.new_group(backend="gloo", timeout=timeout) if multi else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetrain-checkpoint")
        self._in_flight: tuple[int, Future[Path]] | None = None

    @property
    def in_flight_step(self) -> int | None:
        return self._in_flight[0] if self._in_flight is not None else None

    def start(self, pending: PendingSave) -> None:
        """Write ``pending`` in the background, after the save in flight (if any) has been
        published. Returns once a CPU copy of its tensors is staged. Collective."""
        self.wait()
        write = dcp.async_save(pending.state, storage_writer=checkpoint_writer(pending.tmp),
                               process_group=self._write_group, no_dist=self._write_group is None)
        assert isinstance(write, Future), "a blocking stager returns the write's future"
        # The staged copy is the thread's; the live tensors (a consolidated ZeRO-1 state among
        # them) need not outlive this call.
        pending = replace(pending, state={})
        self._in_flight = (pending.step, self._executor.submit(self._publish, pending, write))

    def _publish(self, pending: PendingSave, write: Future) -> Path:
        """The thread: wait for this rank's write, then publish with the other ranks (or agree that
        the save failed: every rank takes part either way, so that none blocks)."""
        try:
            metadata, error = write.result(), None
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must take part in publishing
            metadata, error = None, dcp_write_error(e, pending.tmp)
        # The same group as DCP's write: on every rank the thread uses it in the same order.
        return publish_save(pending, metadata, write_error=error, group=self._write_group)

    def poll(self) -> None:
        """Raise the error of a save that failed in the background, once every rank's thread has
        finished it; publish nothing and wait for nothing. Collective while a save is in flight (a
        one-integer all-reduce on CPU)."""
        if self._in_flight is None:
            return
        done = torch.tensor([int(self._in_flight[1].done())])
        if self._poll_group is not None:
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._poll_group)
        if done.item():
            self.wait()

    def wait(self) -> Path | None:
        """Block until the save in flight is published; its path (None when there was none).
        Raises ``RuntimeError`` with the failed save's message, on every rank."""
        if self._in_flight is None:
            return None
        step, future = self._in_flight
        self._in_flight = None
        try:
            return future.result()
        except Exception as e:
            raise RuntimeError(f"the checkpoint of step {step}, written in the background "
                               f"(checkpoint.async_save), failed: {e}") from e
