"""``log.comm_timing``: every expert-parallel exchange timed, in both directions, and the gradient
reduction and ZeRO-1 parameter gather, with the same numbers as an untimed run (timing waits for
each collective where it is issued; nothing else changes)."""

from __future__ import annotations

import json

import pytest

from moetrain.config.loader import load_config
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


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("extra", [(), ("--moe.dispatch_dtype=fp8_e4m3", "--moe.dispatch_dedup=true"),
                                   ("--parallel.zero_stage=1",)],
                         ids=["plain", "fp8-dedup", "zero1"])
def test_timed_exchanges_report_every_kind_and_change_no_number(tmp_path, shakespeare_cached, extra):
    base = ("--train.micro_batch_size=4", "--log.every=2", "--train.deterministic=true", *extra)
    plain = run_ranks(_run, 2, job_overrides(tmp_path / "plain", steps=4, ep=2, extra=base), timeout_s=150)[0]
    timed = run_ranks(_run, 2, job_overrides(tmp_path / "timed", steps=4, ep=2,
                                             extra=(*base, "--log.comm_timing=true")), timeout_s=150)[0]
    assert [r["loss"] for r in timed["records"]] == [r["loss"] for r in plain["records"]]
    assert [r["a2a_bytes"] for r in timed["records"]] == [r["a2a_bytes"] for r in plain["records"]]
    for record in timed["records"]:
        # 2 MoE layers, one dispatch and one combine each, per step (and their backward).
        for kind in ("dispatch", "dispatch_backward", "combine", "combine_backward"):
            assert record[f"comm_calls/{kind}"] == 2, (kind, record)
            assert record[f"comm_time/{kind}"] > 0
        assert record["comm_calls/routing"] >= 2 and record["comm_time/routing"] > 0
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
