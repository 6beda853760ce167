"""The aux-loss gradient under tensor and pipeline parallelism and gradient accumulation, on real
gloo processes against one plain process with the same global batch.

The aux-loss gradient of a step is isolated as the difference between two runs on the same data,
one with the aux coefficients on and one with them off (the routing, and so the lm-loss gradient,
is the same in both: the coefficients only weigh terms of the objective). Its dependence on the
layout, by term:

    z-loss                       a mean over the step's tokens: the same for every tp, pp and cut of
                                 the global batch into micro-batches
    sequence-wise balance loss   a mean over the step's sequences of per-sequence terms: the same
                                 for every tp (each sequence's counts and scores summed over its
                                 tp ranks), pp and cut into micro-batches
    batch-wise balance loss      f_e and P_e over each micro-batch (Megatron-LM's default): the same
                                 for every tp and pp at a fixed micro-batch count, and a different
                                 gradient for another count, by construction
    global-batch balance loss    f_e of the previous optimizer step over every micro-batch and rank,
                                 P_e a mean over the step's tokens: the same for every dp, tp and cut
                                 into micro-batches (its runs start from preset counts: the uniform
                                 f_e before any step gives no gradient)

The tp runs use the tp harness (tp_parity.py: dp index's rows cut ``m::M``), the pp runs the
pipeline harness (pipeline_worker.py: rows cut into consecutive blocks); each is compared with its
own one-process reference at one micro-batch (pp = tp = 1, no accumulation). The global-batch runs
use the tp harness at tp = 2 and, with tp = 1 on the same two ranks, at dp = 2.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tests.distributed.workers import pipeline_worker, tp_parity
from tests.distributed.workers.pipeline_worker import PPCase
from tests.distributed.workers.tp_parity import TpRun
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

TERMS = {"z": {"aux_loss_coef": 0.0, "z_loss_coef": 0.5},
         "sequence": {"aux_loss_type": "sequence", "aux_loss_coef": 0.5, "z_loss_coef": 0.0},
         "batch": {"aux_loss_coef": 0.5, "z_loss_coef": 0.0}}
"""The aux term under test, alone (coefficient 0.5 so its gradient stands well above rounding)."""
TP_TERMS = ("z", "sequence", "batch")
PP_MICRO_BATCHES = (2, 4)
TP_MICRO_BATCHES = (1, 2)
PP_GLOBAL_BATCH = 8


def _off(moe: dict) -> dict:
    return {**moe, "aux_loss_coef": 0.0, "z_loss_coef": 0.0}


def _tp_runs(term: str, tp: int, micro_batches: int) -> tuple[TpRun, TpRun]:
    on = TpRun(f"tp{tp}_{term}_m{micro_batches}", tp=tp, steps=1, micro_batches=micro_batches, moe=TERMS[term])
    return on, dataclasses.replace(on, name=on.name + "_off", moe=_off(TERMS[term]))


def _pp_cases(term: str, pp: int, micro_batches: int) -> tuple[PPCase, PPCase]:
    on = PPCase(f"pp{pp}_{term}_m{micro_batches}", pp=pp, steps=1, micro_batches=micro_batches,
                micro_batch_size=PP_GLOBAL_BATCH // micro_batches, moe=TERMS[term])
    return on, dataclasses.replace(on, name=on.name + "_off", moe=_off(TERMS[term]))


GLOBAL_BATCH_TERM = {"aux_loss_type": "global_batch", "aux_loss_coef": 0.5, "z_loss_coef": 0.0,
                     "collapse_threshold": 1.0}
"""The global-batch term alone (its counts need install_balancing; its collapse alarm is off, as
at top_k / num_experts = 0.5 it would only warn that it is)."""
PRESET_ROUTED = (30, 10, 5, 19)
"""The counts a previous step routed (4 experts; any non-uniform ones): the first step's f_e."""
GLOBAL_LAYOUTS = {"dp2": 1, "tp2": 2}
"""Layout name -> tp on two ranks (tp = 1 there is dp = 2)."""


def _global_runs(layout: str, micro_batches: int) -> tuple[TpRun, TpRun]:
    """``layout``: a key of GLOBAL_LAYOUTS, or "one" (the one-process reference)."""
    on = TpRun(f"{layout}_global_batch_m{micro_batches}", tp=GLOBAL_LAYOUTS.get(layout, 1), steps=1,
               micro_batches=micro_batches, balancing=True, prev_step_routed=PRESET_ROUTED, moe=GLOBAL_BATCH_TERM)
    return on, dataclasses.replace(on, name=on.name + "_off", moe=_off(GLOBAL_BATCH_TERM))


def _global_pp_cases(pp: int, micro_batches: int) -> tuple[PPCase, PPCase]:
    on = PPCase(f"pp{pp}_global_batch_m{micro_batches}", pp=pp, steps=1, micro_batches=micro_batches,
                micro_batch_size=PP_GLOBAL_BATCH // micro_batches, balancing=True, prev_step_routed=PRESET_ROUTED,
                moe=GLOBAL_BATCH_TERM)
    return on, dataclasses.replace(on, name=on.name + "_off", moe=_off(GLOBAL_BATCH_TERM))


TP_RUNS = [r for term in TP_TERMS for m in TP_MICRO_BATCHES for r in _tp_runs(term, 2, m)]
TP_RUNS += [r for layout in GLOBAL_LAYOUTS for m in TP_MICRO_BATCHES for r in _global_runs(layout, m)]
PP_CASES = [c for term in TERMS for m in PP_MICRO_BATCHES for c in _pp_cases(term, 2, m)]
PP_CASES += [c for m in PP_MICRO_BATCHES for c in _global_pp_cases(2, m)]


def worker(rank: int, world: int, tp_runs: list[TpRun], pp_cases: list[PPCase]) -> dict:
    """Every tp run, then every pp case, on the same ranks."""
    return {"tp": tp_parity.tp_worker(rank, world, tp_runs), "pp": pipeline_worker.run_cases(rank, world, pp_cases)}


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_ranks(worker, 2, TP_RUNS, PP_CASES, timeout_s=140)


def _difference(on: dict, off: dict) -> dict:
    assert on.keys() == off.keys()
    return {k: on[k] - off[k] for k in on}


# The one-process references, each computed once for the tests below (several tests read the same one).
@functools.cache
def _reference_tp(term: str, micro_batches: int) -> dict:
    on, off = _tp_runs(term, 2, micro_batches)
    return _difference(tp_parity.run_reference(on)["grads"], tp_parity.run_reference(off)["grads"])


@functools.cache
def _reference_pp(term: str, micro_batches: int) -> dict:
    on, off = _pp_cases(term, 2, micro_batches)
    return _difference(pipeline_worker.run_reference(on, 1)["grads"][0],
                       pipeline_worker.run_reference(off, 1)["grads"][0])


def _aux_grads_tp(term: str, micro_batches: int, results: list[dict] | None) -> dict:
    """The aux-loss gradient of the first step: from rank 0's full gradients at tp = 2, or from
    the one-process reference (tp = 1) when ``results`` is None."""
    if results is None:
        return _reference_tp(term, micro_batches)
    on, off = _tp_runs(term, 2, micro_batches)
    return _difference(results[0]["tp"][on.name]["grads"], results[0]["tp"][off.name]["grads"])


def _aux_grads_pp(term: str, micro_batches: int, results: list[dict] | None) -> dict:
    """The same under the pipeline harness: the stages' gradients merged over the ranks at pp = 2,
    or the one-process reference (pp = 1) when ``results`` is None."""
    if results is None:
        return _reference_pp(term, micro_batches)
    on, off = _pp_cases(term, 2, micro_batches)
    merged = [{k: v for r in results for k, v in r["pp"][case.name]["grads"][0].items()} for case in (on, off)]
    return _difference(*merged)


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=1e-4, msg=lambda m, k=k: f"{what} {k}: {m}")


def _assert_nonzero_at_routers(grads: dict, what: str) -> None:
    routers = [k for k in grads if "router" in k]
    assert routers, what
    for k in routers:
        assert grads[k].abs().max() > 1e-4, f"{what}: no aux-loss gradient reaches {k}"


def _max_relative_change(a: dict, b: dict) -> float:
    num = max((a[k] - b[k]).abs().max().item() for k in a)
    return num / max(b[k].abs().max().item() for k in b)


@pytest.mark.parametrize("term", ["z", "sequence"])
def test_token_and_sequence_means_do_not_depend_on_pp_or_micro_batches(world2, term):
    want = _aux_grads_pp(term, 1, None)
    _assert_nonzero_at_routers(want, f"[{term}] reference")
    for m in PP_MICRO_BATCHES:
        _assert_same(_aux_grads_pp(term, m, None), want, f"[{term}] one process, {m} micro-batches:")
        _assert_same(_aux_grads_pp(term, m, world2), want, f"[{term}] pp=2, {m} micro-batches:")


@pytest.mark.parametrize("term", ["z", "sequence"])
def test_token_and_sequence_means_do_not_depend_on_tp_or_micro_batches(world2, term):
    want = _aux_grads_tp(term, 1, None)
    _assert_nonzero_at_routers(want, f"[{term}] reference")
    for m in TP_MICRO_BATCHES:
        _assert_same(_aux_grads_tp(term, m, None), want, f"[{term}] one process, {m} micro-batches:")
        _assert_same(_aux_grads_tp(term, m, world2), want, f"[{term}] tp=2, {m} micro-batches:")


def test_batch_balance_loss_follows_the_micro_batch_not_the_layout(world2):
    """The same gradient at tp = 2 or pp = 2 as in one process with the same micro-batches; a
    different one for another micro-batch count (f_e and P_e per micro-batch)."""
    for m in TP_MICRO_BATCHES:
        want = _aux_grads_tp("batch", m, None)
        _assert_nonzero_at_routers(want, f"[batch] reference, {m} micro-batches")
        _assert_same(_aux_grads_tp("batch", m, world2), want, f"[batch] tp=2, {m} micro-batches:")
    for m in PP_MICRO_BATCHES:
        _assert_same(_aux_grads_pp("batch", m, world2), _aux_grads_pp("batch", m, None),
                     f"[batch] pp=2, {m} micro-batches:")
    for name, grads in (("tp", _aux_grads_tp), ("pp", _aux_grads_pp)):
        counts = sorted({1, *(TP_MICRO_BATCHES if name == "tp" else PP_MICRO_BATCHES)})
        by_count = {m: grads("batch", m, None) for m in counts}
        for m in counts[1:]:
            change = _max_relative_change(by_count[m], by_count[1])
            assert change > 1e-2, f"[batch, {name} harness] {m} micro-batches vs 1: relative change {change:.1e}"



@functools.cache
def _reference_global(micro_batches: int) -> tuple[dict, dict]:
    """The one-process global-batch run's aux-loss gradient and its full results."""
    on, off = _global_runs("one", micro_batches)
    res_on = tp_parity.run_reference(on)
    return _difference(res_on["grads"], tp_parity.run_reference(off)["grads"]), res_on


def _aux_grads_global(layout: str, micro_batches: int, results: list[dict]) -> dict:
    on, off = _global_runs(layout, micro_batches)
    return _difference(results[0]["tp"][on.name]["grads"], results[0]["tp"][off.name]["grads"])


def test_global_batch_balance_gradient_does_not_depend_on_dp_tp_or_micro_batches(world2):
    """One process with the whole step in one micro-batch against one process with two, and dp = 2
    and tp = 2, each with one and with two micro-batches: every parameter's aux-loss gradient."""
    want = _reference_global(1)[0]
    _assert_nonzero_at_routers(want, "[global_batch] reference")
    for m in TP_MICRO_BATCHES:
        _assert_same(_reference_global(m)[0], want, f"[global_batch] one process, {m} micro-batches:")
        for layout in GLOBAL_LAYOUTS:
            _assert_same(_aux_grads_global(layout, m, world2), want, f"[global_batch] {layout}, {m} micro-batches:")


def test_global_batch_counts_are_the_steps_over_every_rank_and_micro_batch(world2):
    """What the optimizer hook keeps for the next step: the step's routed copies, all of them (global
    batch x seq_len x top_k per layer), the same integers at every layout and micro-batch count."""
    want = _reference_global(1)[1]["prev_step_routed"][0]
    assert want.shape == (1, 4) and int(want.sum()) == tp_parity.GLOBAL_BATCH * 8 * 2, want
    assert not torch.equal(want[0], torch.tensor(PRESET_ROUTED)), "the hook did not replace the preset counts"
    for m in TP_MICRO_BATCHES:
        assert torch.equal(_reference_global(m)[1]["prev_step_routed"][0], want), f"one process, {m} micro-batches"
        for layout in GLOBAL_LAYOUTS:
            for rank, res in enumerate(world2):
                got = res["tp"][_global_runs(layout, m)[0].name]["prev_step_routed"][0]
                assert torch.equal(got, want), f"{layout}, {m} micro-batches, rank {rank}: {got} != {want}"


def test_global_batch_balance_gradient_does_not_depend_on_pp_or_micro_batches(world2):
    """The pipeline harness (its own model and batch): pp = 2 at 2 and 4 micro-batches, and one
    process at 1, 2 and 4, against one process with the whole step in one micro-batch."""
    def grads(m: int, results: list[dict] | None) -> dict:
        on, off = _global_pp_cases(2, m)
        if results is None:
            return _difference(pipeline_worker.run_reference(on, 1)["grads"][0],
                               pipeline_worker.run_reference(off, 1)["grads"][0])
        merged = [{k: v for r in results for k, v in r["pp"][case.name]["grads"][0].items()} for case in (on, off)]
        return _difference(*merged)

    want = grads(1, None)
    _assert_nonzero_at_routers(want, "[global_batch] pp reference")
    for m in PP_MICRO_BATCHES:
        _assert_same(grads(m, None), want, f"[global_batch] one process, {m} micro-batches:")
        _assert_same(grads(m, world2), want, f"[global_batch] pp=2, {m} micro-batches:")
