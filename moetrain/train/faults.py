"""What can go wrong during training, and how the ranks agree on it.

* A collective that cannot complete (a rank stalled past ``train.collective_timeout_s``, or died)
  becomes a :class:`CollectiveError` naming the training phase and the operation: ``Phase``.
* SIGTERM (a scheduler's preemption, torchrun stopping the job) asks for a clean stop at the end
  of the current step: ``StopRequest``.
* A step whose loss or gradient is not finite is skipped on every rank and counted;
  ``train.max_consecutive_skips`` in a row halt the run with a :class:`NonFiniteError`:
  ``SkipCounter``.
* Skipping and stopping are decided together, the same on every rank: :func:`agree_on_step`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("moetrain")


class CollectiveError(RuntimeError):
    """A collective did not complete (timed out, or a peer went away): another rank stalled or
    died. Names the training phase and the operation."""


class NonFiniteError(RuntimeError):
    """``train.max_consecutive_skips`` steps in a row had a non-finite loss or gradient."""


# Text of the errors torch's process groups raise when a collective cannot complete.
_TIMEOUT_RE = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER_GONE_RE = re.compile(r"connection (closed|reset) by peer|broken pipe|connection refused", re.IGNORECASE)
# Frames that only pass a failure through (the loop and this module): the moetrain line a
# collective error reports is the innermost one outside them.
_PASS_THROUGH = ("/train/trainer.py", "/train/faults.py")


class Phase:
    """Names what the ranks are doing, so that a collective that fails reports the phase.

        phase = Phase(rank=0, timeout_s=300)
        with phase("optimizer step 3"):
            ...          # a timed-out or broken collective here raises CollectiveError
    """

    def __init__(self, *, rank: int, timeout_s: float) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.current = "setup"

    @contextlib.contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        previous, self.current = self.current, what
        try:
            yield
        except (CollectiveError, NonFiniteError):
            raise
        except RuntimeError as e:
            error = collective_error(e, rank=self.rank, during=what, timeout_s=self.timeout_s)
            if error is None:
                raise
            raise error from e
        finally:
            self.current = previous


def collective_error(exc: RuntimeError, *, rank: int, during: str, timeout_s: float) -> CollectiveError | None:
    """The :class:`CollectiveError` that ``exc`` stands for, or None when ``exc`` is not a
    collective that timed out or lost a peer. ``during`` names the phase."""
    text = str(exc)
    timed_out = _TIMEOUT_RE.search(text) is not None
    if not timed_out and _PEER_GONE_RE.search(text) is None:
        return None
    cause = (f"did not complete within train.collective_timeout_s={timeout_s:g} s" if timed_out
             else "failed because a peer rank went away")
    last_line = text.strip().splitlines()[-1] if text.strip() else text
    return CollectiveError(f"rank {rank}: a collective ({collective_site(exc)}) {cause} during {during}: "
                           f"another rank stalled or died. Original error: {last_line}")


def collective_site(exc: BaseException) -> str:
    """The operation that failed, from the traceback: the torch.distributed call (or, for
    collectives torch issues itself, the innermost torch function) with its source line, and
    the moetrain line that led there. E.g. ``torch.distributed.all_to_all_single: `work.wait()`
    from moetrain/distributed/expert_parallel/dispatcher.py:395 (_exchange_counts)``."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "unknown operation"
    paths = [f.filename.replace(os.sep, "/") for f in frames]
    op = where = None
    for f, path in zip(reversed(frames), reversed(paths), strict=True):
        public = not f.name.startswith("_") and f.name != "wrapper"  # skip torch's logging decorators
        if op is None and "/torch/distributed/" in path and public:
            op = f"torch.distributed.{f.name}"
        if where is None and "/moetrain/" in path and not path.endswith(_PASS_THROUGH):
            where = f"moetrain/{path.rsplit('/moetrain/', 1)[1]}:{f.lineno} ({f.name})"
    inner, inner_path = frames[-1], paths[-1]
    if op is None:
        if inner_path.endswith("/nn/parallel/distributed.py"):
            op = f"DistributedDataParallel.{inner.name}"
        elif "/torch/autograd/" in inner_path:
            op = "a gradient collective in backward (DDP all-reduce or expert all-to-all)"
        else:
            op = inner.name
    text = f"{op}: `{inner.line.strip()}`" if inner.line else op
    return f"{text} from {where}" if where else text


DUPLICATE_SIGTERM_S = 5.0
"""A SIGTERM this soon after the first is the same request delivered twice: a scheduler that
signals every process of a job step (SLURM's scancel, preemption) reaches a worker directly and
again through torchrun, which forwards what it gets."""


class StopRequest:
    """SIGTERM as a request to stop cleanly at the end of the current step; another SIGTERM more
    than ``DUPLICATE_SIGTERM_S`` later kills at once (a user insisting). Only the main thread can
    install it (elsewhere ``installed`` does nothing)."""

    def __init__(self, *, rank: int) -> None:
        self.rank = rank
        self.signum: int | None = None
        """The signal received, None until one comes."""
        self._first_at = 0.0

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            if time.monotonic() - self._first_at < DUPLICATE_SIGTERM_S:
                return  # the first one again, by another route
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # die now, as without this handler
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.signum, self._first_at = signum, time.monotonic()
        log.warning("rank %d: SIGTERM received; will save a checkpoint and stop after this step", self.rank)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._handle)
        try:
            yield
        finally:
            # getsignal gives None for a handler installed outside Python: fall back to the default.
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


class SkipCounter:
    """Steps skipped for a non-finite loss or gradient: in all, and in a row.
    ``max_consecutive`` (``train.max_consecutive_skips``) in a row halt the run; 0 = never."""

    def __init__(self, *, max_consecutive: int, total: int = 0) -> None:
        self.max_consecutive = max_consecutive
        self.total = total
        self.consecutive = 0

    def record(self, step: int, *, good: bool) -> None:
        """Count optimizer step ``step`` (1-based), taken or skipped."""
        if good:
            self.consecutive = 0
            return
        self.total += 1
        self.consecutive += 1
        log.warning("step %d skipped: non-finite loss or gradient (%d in a row, %d in all)", step,
                    self.consecutive, self.total)

    @property
    def halt(self) -> bool:
        return self.max_consecutive > 0 and self.consecutive >= self.max_consecutive

    def error(self, step: int, *, last_good_step: int, path: Path) -> NonFiniteError:
        """The error that stops the run at ``step``; ``path`` holds the state after ``last_good_step``."""
        return NonFiniteError(
            f"steps {last_good_step + 1}-{step} all had a non-finite loss or gradient and were skipped "
            f"(train.max_consecutive_skips={self.max_consecutive}); stopped. The last good state (after step "
            f"{last_good_step}) is in {path}; resume from it with --checkpoint.resume={path} after lowering "
            f"optim.lr or fixing the data")


def agree_on_step(*, grad_norm: torch.Tensor, loss: torch.Tensor | None, finite: bool, stop: StopRequest,
                  device: torch.device) -> tuple[bool, bool]:
    """(take this step, stop after it): the same answers on every rank. One pair of flags is
    all-reduced over the world per step for both the non-finite check and a SIGTERM received by
    any rank (ranks that saw the signal at different steps would otherwise stop at different
    steps). ``finite`` is False after an fp16 overflow (the loss scaler agreed on it already)."""
    bad = ~torch.isfinite(grad_norm.float())
    if loss is not None:
        bad = bad | ~torch.isfinite(loss)
    if not finite:
        bad = torch.ones_like(bad)
    stopping = torch.tensor(stop.requested, device=bad.device)
    flags = torch.stack([bad, stopping]).float().to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad_any, stop_any = flags.tolist()  # host sync: skipping and stopping are decided on the host
    return bad_any == 0, stop_any > 0
