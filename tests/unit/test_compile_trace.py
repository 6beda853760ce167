"""The ``counts`` routing trace (the default ``log.routing_trace``) records from the MoE layers'
in-graph statistics: under ``train.compile`` the blocks run as many compiled graphs a step as with
the trace off (a router hook split each MoE block into 5), with the eager run's counts; and in
eager runs with activation checkpointing and accumulation, each step's counts equal the bincount of
the same step's ``full`` trace (the router hook's ids), recorded beside them in the same run.

A counting backend stands in for inductor: graph splits are dynamo's, before any backend runs."""

from __future__ import annotations

import torch

from moetrain.config.loader import load_config
from moetrain.models.moe.layer import MoELayer
from moetrain.train.routing_trace import RoutingRecorder
from moetrain.train.routing_trace_read import TRACE_DIR, read_tensor, step_file
from moetrain.train.trainer import Trainer
from moetrain.utils.safetensors_io import read_header
from tests.helpers.compile_calls import count_compiled_calls, fit_counting_calls

STEPS = 3


def _config(run_dir, *overrides: str):
    return load_config("tiny", [
        "--parallel.ep=1", "--model.num_layers=2", "--model.dim=32", "--model.num_heads=2",
        "--moe.expert_hidden_dim=32", "--data.seq_len=32", f"--train.steps={STEPS}", "--train.global_batch_size=4",
        "--train.eval_every=0", "--log.every=1", "--log.memory=false", "--train.seed=3",
        "--checkpoint.save_final=false", "--log.report=false", "--log.progress_bar=false", "--log.tensorboard=false",
        f"--log.run_dir={run_dir}", "--checkpoint.resume=never", *overrides])


def _read(run_dir, step: int, prefix: str) -> dict[str, torch.Tensor]:
    path = run_dir / TRACE_DIR / step_file(step, 0)
    tensors, _ = read_header(path)
    return {k[len(prefix):]: read_tensor(info, path) for k, info in tensors.items() if k.startswith(prefix)}


def _compiled_run(run_dir, monkeypatch, trace: str) -> list[int]:
    calls: list[int] = []
    with monkeypatch.context() as m:
        count_compiled_calls(m, calls)
        torch._dynamo.reset()
        try:
            return fit_counting_calls(Trainer(_config(run_dir, "--train.compile=true", f"--log.routing_trace={trace}",
                                        "--train.micro_batch_size=4")), calls)
        finally:
            torch._dynamo.reset()


def test_counts_trace_adds_no_compiled_graph_and_records_the_eager_counts(tmp_path, monkeypatch):
    off = _compiled_run(tmp_path / "off", monkeypatch, "off")
    counts = _compiled_run(tmp_path / "counts", monkeypatch, "counts")
    assert len(off) == STEPS and min(off) > 0
    assert counts == off, f"compiled-graph calls per step: {counts} with the counts trace, {off} without"
    fit_counting_calls(Trainer(_config(tmp_path / "eager", "--log.routing_trace=counts", "--train.micro_batch_size=4")))
    for step in range(1, STEPS + 1):
        compiled, eager = _read(tmp_path / "counts", step, "counts."), _read(tmp_path / "eager", step, "counts.")
        assert list(eager) == ["layers.0.feed_forward", "layers.1.feed_forward"]
        assert all(torch.equal(compiled[n], eager[n]) for n in eager), (step, compiled, eager)
        assert all(int(c.sum()) == 4 * 32 * 2 for c in eager.values())  # every token's top-2 copies


def test_counts_equal_the_bincount_of_the_full_trace_with_checkpointing_and_accumulation(tmp_path):
    # grad_accum 2, every block checkpointed (its recompute in backward routes the tokens again).
    trainer = Trainer(_config(tmp_path, "--log.routing_trace=counts", "--train.micro_batch_size=2",
                              "--train.activation_checkpointing=full"))
    assert trainer.grad_accum == 2
    counts_recorder = trainer.routing.parts[0]
    assert isinstance(counts_recorder, RoutingRecorder) and counts_recorder.mode == "counts"
    layers = [m for m in trainer.model.modules() if isinstance(m, MoELayer)]
    assert all(not m.router._forward_hooks for m in layers), "counts registers no router hook"
    full_recorder = RoutingRecorder(trainer.model, mode="full", every=1, run_dir=tmp_path / "full",
                                    geometry=counts_recorder.geometry, num_micro=2, rank=0, world_size=1, ep=1,
                                    is_main=True, start_step=0)
    trainer.routing.parts.append(full_recorder)
    fit_counting_calls(trainer)
    for step in range(1, STEPS + 1):
        counts, ids = _read(tmp_path, step, "counts."), _read(tmp_path / "full", step, "ids.")
        assert list(counts) == list(ids) and len(ids) == 2
        for name, ids_TK in ids.items():
            assert ids_TK.shape == (4 * 32, 2)
            expected = torch.bincount(ids_TK.long().reshape(-1), minlength=counts[name].numel())
            assert torch.equal(counts[name].long(), expected), (step, name, counts[name], expected)
