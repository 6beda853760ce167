"""``log.comm_timing``: every expert-parallel exchange timed, in both directions, and the gradient
reduction and ZeRO-1 parameter gather, with the same numbers as an untimed run (timing waits for
each collective where it is issued; nothing else changes). With a multi-token module and a forced,
exactly balanced routing, the planner's all-to-all bytes per step are the counted ones (with
moe.dispatch_dedup too)."""

from __future__ import annotations

import json

import pytest

from moetrain.config.loader import load_config
from moetrain.plan.comm import comm_per_step, num_moe_layers
from moetrain.plan.model_states import Layout, param_specs
from moetrain.plan.planner import resolve_vocab
from moetrain.plan.step_time import all_to_alls_per_moe_layer
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides

KINDS = ("dispatch", "dispatch_backward", "combine", "combine_backward", "routing")


def _run(rank: int, world_size: int, overrides: list[str]) -> dict | None:
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    try:
        trainer.fit()
    finally:
        trainer.close()
    if rank != 0:
        return None
    with open(trainer.run_dir / "metrics.jsonl") as f:
        return {"records": [json.loads(line) for line in f if line.strip()]}


MTP_BALANCED = ("--model.mtp_depth=1", "--moe.force_balance=round_robin")
"""One multi-token depth (an MoE block routing 63 of each sequence's 64 positions), and every
forward's copy n = t * K + j sent to expert n mod E: with E = 4, K = 2 and ep = 2, token t's two
copies go to rank t mod 2, exactly half of each layer's tokens (256 per block, 4 * 63 = 252 at the
depth) leave each rank."""


def _check_planner(cfg, record: dict) -> None:
    """The planner's all-to-all bytes of a step (what a rank sends, forward and backward) against the
    counted dispatch and combine payloads (forward only, sent plus received: the backward sends back
    what the forward received, row for row), routing metadata aside."""
    t, model = cfg.train, resolve_vocab(cfg)
    grad_accum = t.global_batch_size // (t.micro_batch_size * 2)  # dp = 2
    vol = comm_per_step(param_specs(model, cfg.moe), Layout.of_config(cfg, 2), model, cfg.moe,
                        tokens_per_micro_batch=t.micro_batch_size * cfg.data.seq_len, grad_accum=grad_accum,
                        compute_bytes=4, seq_len=cfg.data.seq_len)
    counted = (record["a2a_dispatch_bytes"] + record["a2a_combine_bytes"]) / 2  # two steps per record
    assert vol.all_to_all == counted, (vol.all_to_all, counted)
    # By hand: of the K = 2 copies of each token a layer routes (4 x 64 in each block, 4 x 63 at the
    # depth), half leave the rank, as rows of D = 64 fp32 values, in the dispatch and the combine,
    # and the backward sends both again.
    remote_rows = (2 * 4 * 64 + 4 * 63) * 2 // 2
    assert grad_accum == 1 and counted == remote_rows * 2 * 2 * 64 * 4


DEDUP_BALANCED = ("--moe.dispatch_dtype=fp8_e4m3", "--moe.dispatch_dedup=true", "--moe.force_balance=round_robin")
"""Once per rank, under round-robin routing (E = 4, K = 2, ep = 2): token t's copies go to experts
2t mod 4 and 2t + 1 mod 4, both on rank t mod 2, so each token sends one row, to the other rank
for half of them, and both its copies' metadata."""


def _check_dedup_planner(cfg, record: dict) -> None:
    """The planner's all-to-all bytes of a step, told the one rank per token of ``DEDUP_BALANCED``,
    against the counted ones: the rows (the dispatch and combine payloads, sent and received) and
    each remote copy's fp32 gate weight (forward, its gradient backward) and int32 row index
    (forward), which the record counts with the routing metadata."""
    t, model = cfg.train, resolve_vocab(cfg)
    vol = comm_per_step(param_specs(model, cfg.moe), Layout.of_config(cfg, 2), model, cfg.moe,
                        tokens_per_micro_batch=t.micro_batch_size * cfg.data.seq_len, grad_accum=1,
                        compute_bytes=4, seq_len=cfg.data.seq_len, dedup_ranks_per_token=1.0)
    T, layers, D = 4 * 64, 2, 64
    counted = (record["a2a_dispatch_bytes"] + record["a2a_combine_bytes"]) / 2  # two steps per record
    # T / 2 rows leave per layer and T / 2 arrive, each an e4m3 row with its scale and a bf16 combine
    # row; the backward sends the gradients of those that arrived, two bf16 rows each.
    remote_rows = T // 2 * layers
    assert counted == 2 * remote_rows * ((D + 4) + 2 * D)
    rows = counted / 2 + remote_rows * 2 * 2 * D
    remote_copies = T * 2 // 2
    # Routing, two steps a record, per layer: the per-expert counts (L = 2) and the unique-row count
    # to the other rank and from it (int32), and the remote copies' gate weights and row indices.
    assert record["a2a_routing_bytes"] == 2 * layers * (2 * (2 + 1) * 4 + 2 * remote_copies * (4 + 4))
    assert vol.all_to_all == rows + remote_copies * (4 + 4 + 4) * layers, (vol.all_to_all, rows)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("extra", [(), DEDUP_BALANCED,
                                   ("--parallel.zero_stage=1", *MTP_BALANCED)],
                         ids=["plain", "fp8-dedup", "zero1-mtp"])
def test_timed_exchanges_report_every_kind_and_change_no_number(tmp_path, shakespeare_cached, extra):
    base = ("--train.micro_batch_size=4", "--log.every=2", "--train.deterministic=true", *extra)
    plain = run_ranks(_run, 2, job_overrides(tmp_path / "plain", steps=4, ep=2, extra=base), timeout_s=150)[0]
    timed = run_ranks(_run, 2, job_overrides(tmp_path / "timed", steps=4, ep=2,
                                             extra=(*base, "--log.comm_timing=true")), timeout_s=150)[0]
    assert [r["loss"] for r in timed["records"]] == [r["loss"] for r in plain["records"]]
    assert [r["a2a_bytes"] for r in timed["records"]] == [r["a2a_bytes"] for r in plain["records"]]
    cfg = load_config(None, job_overrides(tmp_path / "cfg", steps=4, ep=2, extra=base))
    num_moe = num_moe_layers(cfg.model)
    assert num_moe == (3 if "--model.mtp_depth=1" in extra else 2)  # the blocks', and the module's
    for record in timed["records"]:
        # One dispatch and one combine per MoE layer and step (and their backward).
        for kind in ("dispatch", "dispatch_backward", "combine", "combine_backward"):
            assert record[f"comm_calls/{kind}"] == num_moe, (kind, record)
            assert record[f"comm_time/{kind}"] > 0
        assert record["comm_calls/routing"] >= 2 and record["comm_time/routing"] > 0
        # The step-time model's all-to-all calls are those (once per rank: the unique-row counts, the
        # gate weights and row indices, the weights' gradient more).
        calls = sum(v for k, v in record.items() if k.startswith("comm_calls/") and k != "comm_calls/grad_reduce"
                    and not k.startswith("comm_calls/param_gather"))
        assert calls == all_to_alls_per_moe_layer(cfg.moe)[0] * num_moe, record
        # dp = 2 for the dense weights: DDP's buckets, once per step (the experts have edp = 1).
        assert record["comm_calls/grad_reduce"] >= 1 and record["comm_time/grad_reduce"] > 0
        zero1 = "--parallel.zero_stage=1" in extra
        assert ("comm_calls/param_gather" in record) == zero1
        assert ("param_gather_bytes" in record) == zero1 and record.get("param_gather_bytes", 1) > 0
        # Bytes per payload: the combine brings back the rows the dispatch sent, in fp32 rows of
        # D = 64 values (4 bytes each) or, with fp8, as bf16 rows (2 D bytes) against e4m3 rows plus
        # one fp32 scale (D + 4 bytes); the rest of the total is routing metadata.
        dispatch, combine = record["a2a_dispatch_bytes"], record["a2a_combine_bytes"]
        assert dispatch > 0 and record["a2a_routing_bytes"] > 0
        assert combine * (64 + 4 if extra and "fp8" in extra[0] else 4 * 64) == \
            dispatch * (2 * 64 if extra and "fp8" in extra[0] else 4 * 64)
        assert record["a2a_bytes_per_step"] == record["a2a_bytes"] / 2
        if extra[-len(MTP_BALANCED):] == MTP_BALANCED:
            _check_planner(cfg, record)
        if extra == DEDUP_BALANCED:
            _check_dedup_planner(cfg, record)
    assert not any(k.startswith("comm_") for r in plain["records"] for k in r)  # off by default


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_timed_expert_tensor_parallel_gathers(tmp_path, shakespeare_cached):
    # ep = 1, etp = 2: no all-to-all, only the gathers and reduce-scatters around the experts.
    base = ("--log.every=2", "--train.deterministic=true", "--parallel.etp=2")
    plain = run_ranks(_run, 2, job_overrides(tmp_path / "plain", steps=4, extra=base), timeout_s=150)[0]
    timed = run_ranks(_run, 2, job_overrides(tmp_path / "timed", steps=4, extra=(*base, "--log.comm_timing=true")),
                      timeout_s=150)[0]
    assert [r["loss"] for r in timed["records"]] == [r["loss"] for r in plain["records"]]
    assert [r["etp_bytes"] for r in timed["records"]] == [r["etp_bytes"] for r in plain["records"]]
    for record in timed["records"]:
        # Per step and MoE layer (2): the gathers of the tokens, gate weights and expert ids, the
        # backward of the first two; one reduce-scatter of the outputs and its backward.
        want = {"etp_gather": 6, "etp_gather_backward": 4, "etp_scatter": 2, "etp_scatter_backward": 2}
        for kind, calls in want.items():
            assert record[f"comm_calls/{kind}"] == calls, (kind, record)
            assert record[f"comm_time/{kind}"] > 0
        assert not any(k.startswith("comm_calls/dispatch") for k in record)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_evaluation_exchanges_stay_out_of_the_next_window(tmp_path, shakespeare_cached):
    # The same 4 steps (ep = 2, windows of 2 steps, timed), once with a validation pass after each
    # window: its forwards go through the same dispatchers, and must not reach the second window's
    # byte counters or call counts.
    base = ("--log.every=2", "--train.deterministic=true", "--log.comm_timing=true", "--train.eval_steps=2")
    runs = {every: run_ranks(_run, 2, job_overrides(tmp_path / f"eval{every}", steps=4, ep=2,
                                                    extra=(*base, f"--train.eval_every={every}")),
                             timeout_s=150)[0]["records"]
            for every in (0, 2)}
    assert [("val_loss" in r) for r in runs[2]] == [True, True]  # the evaluation ran
    assert [r["loss"] for r in runs[2]] == [r["loss"] for r in runs[0]]
    for plain, evaluated in zip(runs[0], runs[2], strict=True):
        counters = {k for k in plain if k.startswith(("a2a_", "comm_calls/"))}
        assert "a2a_bytes" in counters and "comm_calls/dispatch" in counters
        assert {k for k in evaluated if k.startswith(("a2a_", "comm_calls/", "comm_time/"))} == \
            {k for k in plain if k.startswith(("a2a_", "comm_calls/", "comm_time/"))}
        assert {k: evaluated[k] for k in counters} == {k: plain[k] for k in counters}


def _stage_spans_left(rank: int, world_size: int, overrides: list[str]) -> dict:
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    try:
        trainer.fit()
    finally:
        trainer.close()
    assert trainer.pipeline is not None
    # What the stage timers hold after the last log step (its evaluation ran after its read).
    return {k: v for chunk in trainer.pipeline.pm.chunks for k, v in chunk.timer.read(reset=False).items()
            if k.startswith("comm_calls/")}


def test_evaluation_forwards_stay_out_of_the_next_windows_stage_timings(tmp_path, shakespeare_cached):
    # pp = 2: the last log step reads the stage timers, then evaluates (forward-only schedules
    # through the same stages); the next window must start from none of those spans.
    left = run_ranks(_stage_spans_left, 2, job_overrides(tmp_path / "pp", steps=2, extra=(
        "--parallel.pp=2", "--log.every=2", "--train.eval_every=2", "--train.eval_steps=2")), timeout_s=150)
    assert left == [{}, {}], left
