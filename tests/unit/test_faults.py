"""Fault handling of ``moetrain.train.faults`` in one process: which errors are collective
failures and what their message says, the phase a failure is reported in, SIGTERM as a stop
request, the count of skipped steps and the per-step agreement on skipping and stopping.
(The same paths with real ranks, signals and stalls: tests/integration/test_fault_tolerance.py.)"""

import os
import signal
import subprocess
import sys

import pytest
import torch

from moetrain.train.faults import (
    CollectiveError,
    NonFiniteError,
    Phase,
    SkipCounter,
    StopRequest,
    agree_on_step,
    collective_error,
)

GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error: Timed out waiting 3000ms"


def _wait_for_peer(text: str) -> None:
    raise RuntimeError(text)


@pytest.mark.parametrize("text, cause", [
    (GLOO_TIMEOUT, "did not complete within train.collective_timeout_s=3 s"),
    ("Connection closed by peer [127.0.0.1]:1234", "failed because a peer rank went away"),
    ("[c10d] Connection reset by peer", "failed because a peer rank went away"),
])
def test_collective_failures_become_collective_errors_naming_phase_and_operation(text, cause):
    try:
        _wait_for_peer(f"first line\n{text}")
    except RuntimeError as e:
        error = collective_error(e, rank=1, during="optimizer step 7", timeout_s=3.0)
    assert isinstance(error, CollectiveError)
    message = str(error)
    assert message.startswith(f"rank 1: a collective (_wait_for_peer: `raise RuntimeError(text)`) {cause} "
                              "during optimizer step 7: another rank stalled or died.")
    assert message.endswith(f"Original error: {text}")  # the last line of torch's message


def test_other_runtime_errors_are_not_collective_errors():
    assert collective_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), rank=0,
                            during="setup", timeout_s=3.0) is None


def test_phase_names_the_failure_and_is_restored():
    phase = Phase(rank=0, timeout_s=5.0)
    assert phase.current == "setup"
    timed_out = "within train.collective_timeout_s=5 s during metrics of step 4"
    with pytest.raises(CollectiveError, match=timed_out) as info, phase("metrics of step 4"):
        assert phase.current == "metrics of step 4"
        _wait_for_peer(GLOO_TIMEOUT)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert phase.current == "setup"


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory"), NonFiniteError("steps 5-7"),
                                   CollectiveError("timed out during setup"), KeyError("step")])
def test_phase_passes_other_errors_through_unchanged(error):
    phase = Phase(rank=0, timeout_s=5.0)
    with pytest.raises(type(error)) as info, phase("optimizer step 1"):
        raise error
    assert info.value is error
    assert phase.current == "setup"


def test_sigterm_becomes_a_stop_request_while_installed():
    stop = StopRequest(rank=0)
    before = signal.getsignal(signal.SIGTERM)
    with stop.installed():
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode boundary, in this thread
        for _ in range(1000):
            if stop.requested:
                break
        assert stop.requested and stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


_TWO_SIGTERMS = """
import os, signal, sys, time
from moetrain.train import faults
faults.DUPLICATE_SIGTERM_S = float(sys.argv[1])
stop = faults.StopRequest(rank=0)
with stop.installed():
    for _ in range(2):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler runs between these sleeps
    print("requested" if stop.requested else "not requested")
"""


@pytest.mark.parametrize(("window_s", "survives"), [(5.0, True), (0.0, False)])
def test_a_second_sigterm_is_the_same_request_within_the_window_and_kills_after_it(window_s, survives):
    """SLURM signals every process of a step and torchrun forwards the same signal: a worker gets
    SIGTERM twice within milliseconds, and must still stop cleanly and save. A second SIGTERM later
    than that (a user insisting) kills at once, as without a handler."""
    done = subprocess.run([sys.executable, "-c", _TWO_SIGTERMS, str(window_s)], capture_output=True, text=True,
                          timeout=60)
    if survives:
        assert done.returncode == 0 and done.stdout.strip() == "requested", done.stderr
    else:
        assert done.returncode == -signal.SIGTERM and done.stdout == "", (done.returncode, done.stderr)


def test_skip_counter_counts_runs_and_halts_after_the_limit(caplog):
    skips = SkipCounter(max_consecutive=2, total=5)
    skips.record(1, good=False)
    assert (skips.total, skips.consecutive, skips.halt) == (6, 1, False)
    skips.record(2, good=True)
    assert (skips.total, skips.consecutive) == (6, 0)
    skips.record(3, good=False)
    skips.record(4, good=False)
    assert skips.halt
    assert "step 4 skipped: non-finite loss or gradient (2 in a row, 8 in all)" in caplog.text
    error = skips.error(4, last_good_step=2, path="ckpt/step_000000002")
    assert isinstance(error, NonFiniteError)
    assert str(error).startswith("steps 3-4 all had a non-finite loss or gradient and were skipped "
                                 "(train.max_consecutive_skips=2)")
    assert "--checkpoint.resume=ckpt/step_000000002" in str(error)
    never = SkipCounter(max_consecutive=0)
    for step in range(1, 20):
        never.record(step, good=False)
    assert not never.halt


def test_every_rank_agrees_on_skipping_and_stopping():
    cpu = torch.device("cpu")
    stop = StopRequest(rank=0)
    ok = torch.tensor(1.5)

    def agree(**kw):
        args = {"grad_norm": ok, "loss": ok, "finite": True, "stop": stop, "device": cpu, **kw}
        return agree_on_step(**args)

    assert agree() == (True, False)
    assert agree(loss=None) == (True, False)
    assert agree(grad_norm=torch.tensor(float("inf"))) == (False, False)
    assert agree(loss=torch.tensor(float("nan"))) == (False, False)
    assert agree(finite=False) == (False, False)  # an fp16 overflow the loss scaler found
    stop.signum = signal.SIGTERM
    assert agree() == (True, True)
