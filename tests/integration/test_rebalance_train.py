"""Expert rebalancing through the trainer (docs/routing.md#expert-rebalancing), every run in one
launch of 2 gloo processes, zipf:1.2 forced skew, replicas re-planned every step:

- a run with replicas gives the losses and grad norms of the same run without them; it resumes from
  its step-2 checkpoint to the same losses, with rebalancing at the same layout and without it at
  another (ep = 1); its rebalance.jsonl shows the hot rank's load spread;
- that checkpoint holds the experts in logical order, so what is made of it is what the run without
  replicas gives at step 2: ``moetrain export``, ``moetrain convert --to-hf`` (Mixtral) and
  ``moetrain experts grow`` (noisy copies, grown in the launch between two runs), and the grown model trains with
  replicas to the losses of the plain run's grown model trained without them;
- a dense Llama upcycled (with noise) into an ep = 2 job with spare slots trains to the losses of that job
  without them, and with a weight average (optim.ema_decay) evaluates to its validation losses: the
  replicas take the averaged weights for the evaluation;
- with the experts frozen (LoRA on attention only) the losses are those without replicas, and only the
  steps that place replicas (the first, the re-plans) move any replica bytes;
- resumed in its own run folder, a run's rebalance.jsonl reads like that of a run that never stopped.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from moetrain.cli import main
from moetrain.interop.export import read_export
from moetrain.interop.surgery import grow_source
from moetrain.train.checkpoint.files import step_dir_name
from moetrain.utils.safetensors_io import SafetensorsFolder
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides, read_losses

pytestmark = pytest.mark.timeout(300)
# SwiGLU experts and MLPs: a model a Hugging Face family (Mixtral) holds.
SKEW = ("--moe.force_skew=zipf:1.2", "--train.deterministic=true", "--log.memory=false",
        "--moe.activation=swiglu", "--model.activation=swiglu")
REBALANCE = ("--parallel.expert_slots_per_rank=3", "--moe.rebalance_every=1")
CKPT2 = ("--checkpoint.every=2", "--checkpoint.keep_last=0")
GROWN = ("--moe.num_experts=8", "--moe.top_k=4")
EMA = ("--optim.ema_decay=0.9", "--train.eval_every=1", "--train.eval_steps=2")
FROZEN = ("--finetune.lora_rank=2", "--finetune.lora_targets=[attention]")
# Noise on the grown copies and the upcycled experts: experts that differ from the start, so a replica
# serving another expert's tokens would change the loss at once.
NOISE = 0.1
RTOL = 1e-5
"""The runs with and without replicas sum an expert's gradient in another order: equal up to rounding."""


def _runs(rank: int, world_size: int, runs: list) -> None:
    """Each run in turn in this process group (the trainer reuses an initialised one): overrides, or
    ``(config file, overrides)``, or a file step (a callable) that rank 0 runs while the others wait."""
    import torch.distributed as dist

    from moetrain.config.loader import load_config
    from moetrain.train.trainer import Trainer

    for run in runs:
        if callable(run):
            if rank == 0:
                run()
            dist.barrier()
            continue
        config, overrides = run if isinstance(run, tuple) else (None, run)
        trainer = Trainer(load_config(config, overrides))
        trainer.fit()
        trainer.metrics.close()


def _grad_norms(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["grad_norm"] for r in map(json.loads, lines) if "loss" in r]


def _close(a: list[float], b: list[float], what: str) -> None:
    assert len(a) == len(b) and all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a, b, strict=True)), (what, a, b)


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(a) == sorted(b), what
    for name, want in b.items():
        assert a[name].dtype == want.dtype, (what, name)
        torch.testing.assert_close(a[name], want, rtol=RTOL, atol=RTOL * float(want.abs().max()), msg=f"{what} {name}")


def _dense_llama(path: Path) -> None:
    from tests.helpers.hf_tiny_dense import tiny_dense

    # Byte tokens (256) fit its vocabulary; max_position_embeddings 64 holds the job's 64-token sequences.
    tiny_dense("llama", vocab_size=320).save_pretrained(path)


def _upcycled_job(export: Path, run_dir: Path, extra: tuple[str, ...]) -> tuple[str, list[str]]:
    """The job of the upcycled export's config.yaml (its model and moe) on job_overrides' data and schedule."""
    rest = [o for o in job_overrides(run_dir, steps=3, ep=2) if not o.startswith(("--model.", "--moe."))]
    return str(export / "config.yaml"), [*rest, f"--checkpoint.init_from={export}", *SKEW, *extra]


def _check_export(tmp_path: Path, rebal_ckpt: Path, plain_ckpt: Path) -> dict[str, torch.Tensor]:
    """``moetrain export`` and ``convert --to-hf`` of the two step-2 checkpoints; the rebalanced run's export."""
    for ckpt, name in ((rebal_ckpt, "rebal"), (plain_ckpt, "plain")):  # file conversions: in-process
        assert main(["export", str(ckpt), "--to", str(tmp_path / f"export-{name}")]) == 0
        assert main(["convert", str(ckpt), "--to-hf", str(tmp_path / f"hf-{name}")]) == 0
    config, got, info = read_export(tmp_path / "export-rebal")
    assert info["step"] == 2 and config["parallel"]["expert_slots_per_rank"] == 3
    _same_tensors(got, read_export(tmp_path / "export-plain")[1], "export with vs without replicas")
    for layer in range(2):
        for w in ("w1", "w2", "w3"):
            t = got[f"layers.{layer}.feed_forward.experts.{w}"]
            assert t.shape[0] == 4, (layer, w, t.shape)  # every logical expert once, no replica
            # Trained apart: a mix-up of the order would not pass the comparison above.
            apart = min(float((t[e] - t[f]).abs().max()) for e in range(4) for f in range(e))
            assert apart > 1e3 * RTOL * float(t.abs().max()), (layer, w, apart)

    hf, hf_plain = SafetensorsFolder(tmp_path / "hf-rebal"), SafetensorsFolder(tmp_path / "hf-plain")
    assert json.loads((tmp_path / "hf-rebal" / "config.json").read_text())["model_type"] == "mixtral"
    assert len([n for n in hf.names() if ".experts." in n]) == 2 * 4 * 3  # 2 blocks x 4 experts x (w1, w3, w2)
    _same_tensors({n: hf.get(n) for n in hf.names()}, {n: hf_plain.get(n) for n in hf_plain.names()},
                  "Hugging Face conversion with vs without replicas")
    return got


def _check_grown(tmp_path: Path, exported: dict[str, torch.Tensor]) -> None:
    """The two grown exports: the same model; grown expert 2e is exported expert e, 2e + 1 a noisy copy of it."""
    config, grown, info = read_export(tmp_path / "grown-rebal")
    plain_config, plain, _ = read_export(tmp_path / "grown-plain")
    assert info["step"] == 2 and config["moe"]["num_experts"] == 8 and config["moe"]["top_k"] == 4
    assert config["model"] == plain_config["model"]
    assert {**config["moe"], "rebalance_every": 0} == plain_config["moe"]
    _same_tensors(grown, plain, "grown with vs without replicas")
    for layer in range(2):
        for w in ("w1", "w2", "w3"):
            name = f"layers.{layer}.feed_forward.experts.{w}"
            assert torch.equal(grown[name][::2], exported[name]), name
            assert not torch.allclose(grown[name][1::2], exported[name], rtol=0.01), name


def test_rebalanced_training_matches_resumes_exports_grows_and_upcycles(tmp_path, shakespeare_cached):
    from moetrain.interop.upcycle import upcycle_hf

    plain, rebal, same, other = (tmp_path / n for n in ("plain", "rebal", "resume-same", "resume-ep1"))
    ckpt, plain_ckpt = (r / "checkpoints" / step_dir_name(2) for r in (rebal, plain))
    _dense_llama(tmp_path / "dense")
    upcycle_hf(tmp_path / "dense", tmp_path / "up", num_experts=4, top_k=2, noise=NOISE)
    grow = partial(grow_source, num_experts=8, top_k=4, noise=NOISE)
    grown_slots = ("--parallel.expert_slots_per_rank=5", "--moe.rebalance_every=1")
    runs = [job_overrides(plain, steps=3, ep=2, extra=(*SKEW, *CKPT2)),
            job_overrides(rebal, steps=3, ep=2, extra=(*SKEW, *REBALANCE, *CKPT2)),
            job_overrides(same, steps=3, ep=2, extra=(*SKEW, *REBALANCE, f"--checkpoint.resume={ckpt}")),
            # Again in its own folder, as after a crash: its records of step 3 are replaced, not repeated.
            job_overrides(rebal, steps=3, ep=2, extra=(*SKEW, *REBALANCE, f"--checkpoint.resume={ckpt}")),
            job_overrides(other, steps=3, ep=1, extra=(*SKEW, f"--checkpoint.resume={ckpt}")),
            partial(grow, ckpt, tmp_path / "grown-rebal"), partial(grow, plain_ckpt, tmp_path / "grown-plain"),
            job_overrides(tmp_path / "train-grown-rebal", steps=2, ep=2, extra=(
                *SKEW, *GROWN, *grown_slots, f"--checkpoint.init_from={tmp_path / 'grown-rebal'}")),
            job_overrides(tmp_path / "train-grown-plain", steps=2, ep=2, extra=(
                *SKEW, *GROWN, f"--checkpoint.init_from={tmp_path / 'grown-plain'}")),
            _upcycled_job(tmp_path / "up", tmp_path / "up-plain", EMA),
            # Re-planned every 2 of 3 steps: the last step's record is written by the trainer's finish.
            _upcycled_job(tmp_path / "up", tmp_path / "up-rebal", (*EMA, *REBALANCE[:1], "--moe.rebalance_every=2")),
            job_overrides(tmp_path / "frozen-plain", steps=3, ep=2, extra=(*SKEW, *FROZEN)),
            job_overrides(tmp_path / "frozen-rebal", steps=3, ep=2,
                          extra=(*SKEW, *FROZEN, *REBALANCE[:1], "--moe.rebalance_every=2"))]
    run_ranks(_runs, 2, runs, timeout_s=260)

    _close(read_losses(rebal), read_losses(plain), "loss with vs without replicas")
    _close(_grad_norms(rebal), _grad_norms(plain), "grad norm with vs without replicas")
    _close(read_losses(same), read_losses(plain)[2:], "resumed with replicas at ep=2")
    _close(read_losses(other), read_losses(plain)[2:], "resumed without replicas at ep=1")
    recs = [json.loads(line) for line in (rebal / "rebalance.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3] and all(r["rebalanced"] for r in recs)
    for r in recs[1:]:  # planned from the previous step's load
        for copies in r["rank_copies"]:
            assert max(copies) <= 1.2 * sum(copies) / len(copies), r
    first = recs[0]["rank_copies"][0]
    assert max(first) > 1.3 * sum(first) / len(first), first  # the home layout under zipf:1.2

    _check_grown(tmp_path, _check_export(tmp_path, ckpt, plain_ckpt))
    for run, steps in (("train-grown", 2), ("up", 3)):
        want = read_losses(tmp_path / f"{run}-plain")
        assert len(want) == steps and all(torch.isfinite(torch.tensor(want))), (run, want)
        _close(read_losses(tmp_path / f"{run}-rebal"), want, f"{run}: with vs without replicas")
        recs = [json.loads(r) for r in (tmp_path / f"{run}-rebal" / "rebalance.jsonl").read_text().splitlines()]
        every = 2 if run == "up" else 1
        assert [(r["step"], r["rebalanced"]) for r in recs] == [(s, s % every == 0) for s in range(1, steps + 1)], run
    val = {run: [r["val_loss"] for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())
                 if "val_loss" in r] for run in ("up-plain", "up-rebal")}
    assert len(val["up-plain"]) == 3, val
    _close(val["up-rebal"], val["up-plain"], "validation loss of the weight average with vs without replicas")

    _close(read_losses(tmp_path / "frozen-rebal"), read_losses(tmp_path / "frozen-plain"), "frozen experts")
    recs = [json.loads(r) for r in (tmp_path / "frozen-rebal" / "rebalance.jsonl").read_text().splitlines()]
    # Step 1: the first placement's weights; step 2: a re-plan's; step 3 nothing (frozen: no gradients
    # to send home, no weights that changed).
    assert [r["replica_bytes"] > 0 for r in recs] == [True, True, False], recs
