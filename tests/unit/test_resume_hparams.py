"""A resume runs with the config's optimizer hyper-parameters (lr through the schedule, weight
decay, betas, eps, Muon's momentum, nesterov and ns_steps), not the checkpoint's, and keeps the
checkpoint's optimizer state. Real saves and loads through the trainer's ``Checkpointer``, for
AdamW, Muon, 1-bit Adam and ZeRO-1 (on one rank its consolidated save and sliced load run; one
two-rank check against a plain AdamW reference)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moetrain.config import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.optim import OptimConfig
from moetrain.config.train import TrainConfig
from moetrain.distributed import ParallelDims
from moetrain.distributed.data_parallel.onebit_adam import OneBitAdam
from moetrain.distributed.data_parallel.zero1 import ZeroShardedOptimizer
from moetrain.models.transformer import Transformer
from moetrain.train.checkpoint.checkpointer import Checkpointer, TrainingObjects
from moetrain.train.faults import Phase
from moetrain.train.optim import build_optimizer, build_scheduler, lr_at, optimizer_settings, param_groups
from moetrain.train.precision import DynamicLossScaler
from tests.helpers.dist_launcher import run_ranks
from tests.helpers.onebit import OneReplica

STEPS = 8
SAVED_AT = 3
OLD = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, muon_momentum=0.95, muon_nesterov=True,
           muon_ns_steps=5, warmup_steps=2, schedule="cosine")
NEW = dict(OLD, lr=1e-4, weight_decay=0.0, betas=(0.8, 0.99), eps=1e-6, muon_momentum=0.5, muon_nesterov=False,
           muon_ns_steps=3)


class _Position:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """A loader with no position to restore (these tests read no data)."""


@pytest.fixture
def dims(tmp_path):
    # ZeRO-1 asks the mesh for its slice groups: a one-rank gloo group for every kind alike.
    assert not dist.is_initialized(), "an earlier test left a process group initialised"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        dims = ParallelDims(world_size=1)
        dims.build_mesh()
        yield dims
    finally:
        dist.destroy_process_group()


def _job(kind: str, hp: dict) -> JobConfig:
    optim = OptimConfig(name="muon" if kind == "muon" else "adamw", min_lr=hp["lr"] / 10,
                        **{k: v for k, v in hp.items() if kind == "muon" or not k.startswith("muon_")})
    return JobConfig(optim=optim, train=TrainConfig(steps=STEPS))


def _build(kind: str, cfg: JobConfig, dims: ParallelDims, tmp_path):
    mc = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=2, max_seq_len=16, moe_every=2)
    model = Transformer(mc, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=48), seed=3)
    o = cfg.optim
    if kind == "onebit":
        opt: torch.optim.Optimizer = OneBitAdam(
            param_groups(model, weight_decay=o.weight_decay), data_parallel=OneReplica(), warmup_steps=2,
            lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)  # type: ignore[arg-type]
    else:
        opt = build_optimizer(model, **optimizer_settings(o))
    if kind == "zero1":
        opt = ZeroShardedOptimizer(opt, dims)
    sched = build_scheduler(opt, lr=o.lr, min_lr=o.resolved_min_lr, warmup_steps=o.warmup_steps,
                            total_steps=STEPS, schedule=o.schedule)
    objects = TrainingObjects(model=model, optimizer=opt, parallel_model=model, scheduler=sched,
                              scaler=DynamicLossScaler(enabled=False), train_loader=_Position(), balancer=None,
                              ema=None)
    ckpt = Checkpointer(cfg, folder=tmp_path / "ckpt", objects=objects, dims=dims,
                        phase=Phase(rank=dist.get_rank(), timeout_s=60), vocab_size=64,
                        is_main=dist.get_rank() == 0)
    return model, opt, sched, ckpt


def _step(model, opt, sched, step: int) -> None:
    tok = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(step))
    model(tok[:, :-1], tok[:, 1:]).total_loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _save_at(kind: str, dims: ParallelDims, tmp_path):
    model, opt, sched, ckpt = _build(kind, _job(kind, OLD), dims, tmp_path)
    for s in range(SAVED_AT):
        _step(model, opt, sched, s)
    return ckpt.save(ckpt.snapshot(step=SAVED_AT, skipped_total=0), wait=True)


KINDS = ["adamw", "muon", "onebit", "zero1"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_resume_takes_the_configs_hyperparameters_and_keeps_the_state(kind, dims, tmp_path, caplog):
    path = _save_at(kind, dims, tmp_path)
    model, opt, sched, ckpt = _build(kind, _job(kind, NEW), dims, tmp_path / "new")
    with caplog.at_level(logging.INFO, logger="moetrain"):
        ckpt.load(path)
    assert "optim.lr: 0.001 in the checkpoint, 0.0001 now" in caplog.text
    assert "optim.weight_decay: 0.1 in the checkpoint, 0.0 now" in caplog.text
    # 1-bit Adam past its warmup keeps the b2 its variance froze under (test_onebit_frozen_variance.py).
    betas = (0.8, 0.95) if kind == "onebit" else (0.8, 0.99)
    assert f"optim.betas: (0.9, 0.95) in the checkpoint, {betas} now" in caplog.text
    assert ("optim.betas[1]: 0.95 in the checkpoint, 0.99 asked, kept" in caplog.text) == (kind == "onebit")
    assert ("optim.muon_ns_steps: 5 in the checkpoint, 3 now" in caplog.text) == (kind == "muon")
    # The state is the checkpoint's: the step counts of the 3 saved steps.
    steps = {int(s["step"]) for s in opt.state.values() if "step" in s}
    assert steps == {SAVED_AT}
    schedule = dict(lr=NEW["lr"], min_lr=NEW["lr"] / 10, warmup_steps=2, total_steps=STEPS, schedule="cosine")
    for step in (SAVED_AT, SAVED_AT + 1):
        for g in opt.param_groups:
            assert g["lr"] == pytest.approx(lr_at(step, **schedule), rel=1e-12), (step, g["name"])
            assert g["weight_decay"] == 0.0 and tuple(g["betas"]) == betas and g["eps"] == 1e-6
            if kind == "muon":
                assert (g["momentum"], g["nesterov"], g["ns_steps"]) == (0.5, False, 3)
        assert sched.get_last_lr() == [g["lr"] for g in opt.param_groups]
        if step == SAVED_AT:
            before = _params(model)
            _step(model, opt, sched, step)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert moved


@pytest.mark.parametrize("kind", KINDS)
def test_an_unchanged_config_resumes_bit_identically(kind, dims, tmp_path):
    model, opt, sched, _ = _build(kind, _job(kind, OLD), dims, tmp_path / "straight")
    for s in range(STEPS):
        _step(model, opt, sched, s)
    path = _save_at(kind, dims, tmp_path / "first")
    resumed, opt2, sched2, ckpt = _build(kind, _job(kind, OLD), dims, tmp_path / "second")
    ckpt.load(path)
    for s in range(SAVED_AT, STEPS):
        _step(resumed, opt2, sched2, s)
    want = _params(model)
    assert all(torch.equal(p, want[n]) for n, p in resumed.named_parameters())


def _hand_edited_reference(dims: ParallelDims, folder: Path) -> dict[str, torch.Tensor]:
    """The weights after step SAVED_AT + 1 of the uninterrupted AdamW run whose hyper-parameters are
    set to the new config's by hand before that step."""
    model, opt, sched, _ = _build("adamw", _job("adamw", OLD), dims, folder)
    for s in range(SAVED_AT):
        _step(model, opt, sched, s)
    sched.base_lrs = [NEW["lr"]] * len(opt.param_groups)
    for g in opt.param_groups:
        g["lr"] = lr_at(SAVED_AT, lr=NEW["lr"], min_lr=NEW["lr"] / 10, warmup_steps=2, total_steps=STEPS,
                        schedule="cosine")
        g.update(betas=NEW["betas"], eps=NEW["eps"], weight_decay=0.0)
    _step(model, opt, sched, SAVED_AT)
    return _params(model)


def _resumed_step(kind: str, dims: ParallelDims, folder: Path) -> dict[str, torch.Tensor]:
    """The weights after step SAVED_AT + 1 of a run resumed from SAVED_AT with the new config."""
    path = _save_at(kind, dims, folder / "first")
    resumed, opt, sched, ckpt = _build(kind, _job(kind, NEW), dims, folder / "second")
    ckpt.load(path)
    _step(resumed, opt, sched, SAVED_AT)
    return _params(resumed)


def _assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for n, p in got.items():
        torch.testing.assert_close(p, want[n], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("kind", ["adamw", "zero1"])
def test_a_lower_lr_on_resume_takes_the_smaller_step(kind, dims, tmp_path):
    """The resumed step moves the weights as the uninterrupted optimizer does once its
    hyper-parameters are set to the new config's by hand (the reference)."""
    _assert_close(_resumed_step(kind, dims, tmp_path), _hand_edited_reference(dims, tmp_path / "ref"))


def _zero1_ranks(rank: int, world_size: int, folder: str) -> dict:
    dims = ParallelDims(world_size=world_size)
    dims.build_mesh("cpu")
    # Every rank steps the same batch, so the gradients are the all-reduced ones without DDP.
    return {"resumed": _resumed_step("zero1", dims, Path(folder)),
            "reference": _hand_edited_reference(dims, Path(folder) / f"ref{rank}")}


@pytest.mark.slow
def test_a_two_rank_zero1_resume_takes_the_new_hyperparameters(tmp_path):
    ranks = run_ranks(_zero1_ranks, 2, str(tmp_path), timeout_s=120)
    for r in ranks:
        _assert_close(r["resumed"], r["reference"])
    _assert_close(ranks[1]["resumed"], ranks[0]["resumed"])


def test_another_weight_decay_leaves_the_no_decay_group_at_zero(dims, tmp_path):
    path = _save_at("adamw", dims, tmp_path)
    _, opt, _, ckpt = _build("adamw", _job("adamw", dict(OLD, weight_decay=0.05)), dims, tmp_path / "new")
    ckpt.load(path)
    assert {g["name"]: g["weight_decay"] for g in opt.param_groups} == {"decay": 0.05, "no_decay": 0.0}
