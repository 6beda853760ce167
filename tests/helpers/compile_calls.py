"""Count the compiled-graph calls of ``nn.Module.compile``'d blocks: a dynamo backend that runs each
graph it is given and appends 1 to ``calls`` per call (graph breaks show as more calls a step, an
eager fallback as none)."""

from __future__ import annotations

import torch


def count_compiled_calls(monkeypatch, calls: list[int]) -> None:
    """Make every ``nn.Module.compile`` in the test use the counting backend (undone by
    ``monkeypatch``; reset dynamo around the run)."""

    def counting(gm, example_inputs):
        def run(*args):
            calls.append(1)
            return gm.forward(*args)
        return run

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: compile_module(self, **{**kw, "backend": counting}))


def fit_counting_calls(trainer, calls: list[int] | None = None) -> list[int]:
    """Run ``trainer.fit()`` (and close it); the compiled-graph calls each training step made, from
    ``calls`` as ``count_compiled_calls`` fills it (zeros when not counting)."""
    per_step: list[int] = []
    step = trainer.train_step

    def counted_step():
        before = len(calls or [])
        out = step()
        per_step.append(len(calls or []) - before)
        return out

    trainer.train_step = counted_step
    try:
        trainer.fit()
    finally:
        trainer.close()
    return per_step
