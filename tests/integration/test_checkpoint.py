"""Checkpoints end to end on the tiny job: exact resume, resharding to other layouts, refusal of
corrupt or partial checkpoints, and export.

References are independent of the checkpoint code: full weights and Adam moments are read from
the live model and optimizer (``named_parameters`` / ``optimizer.state``, gathered from their
DTensor shards), losses from a run that never stopped, and expert ownership from each rank's
local shard.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

from moetrain.config.loader import load_config
from moetrain.train.checkpoint.files import CheckpointError
from moetrain.train.checkpoint.index import load_model_weights
from moetrain.train.checkpoint.state import load_checkpoint
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides, read_losses

E = 4  # experts per MoE layer of the tiny job


def _ov(run_dir, *, steps: int, ep: int = 1, micro: int = 4, extra: tuple[str, ...] = ()) -> list[str]:
    # micro * dp is kept at 8 (= the global batch) across layouts: one micro-batch per step, so the
    # layouts sum the same per-rank gradients and their results can be compared.
    return job_overrides(run_dir, steps=steps, ep=ep, extra=(f"--train.micro_batch_size={micro}", *extra))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _full_state(trainer) -> dict[str, torch.Tensor]:
    """Global parameters, persistent buffers, Adam state and learning rates (collective)."""
    out = {}
    persistent = set(trainer.model.state_dict())
    for name, b in trainer.model.named_buffers():
        if name in persistent:
            out[f"buffer/{name}"] = _full(b)
    for name, p in trainer.model.named_parameters():
        out[f"param/{name}"] = _full(p)
        # .get: optimizer.state is a defaultdict; indexing would plant empty entries.
        for key, value in sorted(trainer.optimizer.state.get(p, {}).items()):
            value = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            out[f"adam/{name}/{key}"] = _full(value)
    for i, group in enumerate(trainer.optimizer.param_groups):
        out[f"lr/{i}"] = torch.tensor(group["lr"])
    return out


def _assert_same_state(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    differ = [k for k in want if got[k].shape != want[k].shape or not torch.equal(got[k], want[k])]
    assert not differ, f"{len(differ)} entries differ, e.g. {differ[:5]}"


def save_or_resume(rank: int, model, optimizer, train, ckpt_dir: str, *, save: bool) -> dict | None:
    """The end of a save-then-reload comparison: ``train(0, 3)`` then a step-3 checkpoint in
    ``ckpt_dir`` (``save``), or that checkpoint loaded; then the full state and the losses of
    ``train(3, 6)`` (rank 0; None elsewhere)."""
    from moetrain.train.checkpoint.state import save_checkpoint

    if save:
        train(0, 3)
        save_checkpoint(ckpt_dir, 3, model=model, optimizer=optimizer, trainer_state={"step": 3})
    else:
        load_checkpoint(Path(ckpt_dir) / "step_000000003", model=model, optimizer=optimizer)
    state = _full_state(SimpleNamespace(model=model, optimizer=optimizer))
    losses = train(3, 6)
    return {"state": state, "losses": losses} if rank == 0 else None


def _run(rank: int, world_size: int, overrides: list[str], capture_steps: tuple[int, ...] = ()) -> dict:
    """Train; return the full state right after a resume and after the saves at ``capture_steps``,
    each rank's local expert shards at those saves, and (rank 0) the logged losses."""
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    out = {"loaded": None, "captured": {}, "local_experts": {}, "resumed_step": trainer.step}
    if trainer.resumed_from is not None:
        out["loaded"] = _full_state(trainer)
    save = trainer.checkpointer.save

    def save_and_capture(snapshot):
        path = save(snapshot)
        if trainer.step in capture_steps:
            out["captured"][trainer.step] = _full_state(trainer)
            out["local_experts"][trainer.step] = {n: p.to_local().detach().clone()
                                                  for n, p in trainer.model.named_parameters()
                                                  if isinstance(p, DTensor)}
        return path

    trainer.checkpointer.save = save_and_capture
    try:
        trainer.fit()
    finally:
        trainer.close()
    if rank != 0:  # only rank 0's global copies travel back
        out["loaded"], out["captured"] = None, {}
    out["losses"] = read_losses(trainer.run_dir) if rank == 0 else None
    return out


def _records(run_dir) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _step_dir(run_dir, step: int):
    return run_dir / "checkpoints" / f"step_{step:09d}"


def _call(rank: int, world_size: int, body, *args):
    return body(*args)


def in_child(body, *args, timeout_s: float = 120):
    """``body(*args)`` in a forked one-rank process (one thread), assertions included.

    Why not in the test process: once a process has used gloo, the ranks ``run_ranks`` forks
    from it can hang or crash in their collectives (the parent's gloo state does not survive the
    fork), so the single-process runs stay out of the pytest process too."""
    return run_ranks(_call, 1, body, *args, timeout_s=timeout_s)[0]


# --- single process --------------------------------------------------------------------------------


def test_exact_resume_after_sigterm_single_process(tmp_path, shakespeare_cached):
    in_child(_exact_resume_after_sigterm, tmp_path)


def _exact_resume_after_sigterm(tmp_path):
    from moetrain.train.trainer import Trainer

    torch.use_deterministic_algorithms(True)  # this child process only
    # Reference: 10 steps, never stopped.
    deterministic = ("--train.deterministic=true",)
    ref = Trainer(load_config(None, _ov(tmp_path / "ref", steps=10, extra=deterministic)))
    ref.fit()
    ref.close()
    want = _records(tmp_path / "ref")

    # The same run, sent SIGTERM after step 5: it finishes the step in flight, saves, stops.
    overrides = _ov(tmp_path / "run", steps=10, extra=deterministic)
    run = Trainer(load_config(None, overrides))
    step = run.train_step

    def step_then_signal():
        step()
        if run.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    run.train_step = step_then_signal
    run.fit()
    run.close()
    stopped_at = run.step
    assert run.interrupted and stopped_at in (5, 6), stopped_at
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:09d}"
    rng_after_stop = torch.rand(4)
    # A stale line past the checkpoint (as a kill between log and save leaves): must go.
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": stopped_at + 1, "loss": 0.0}) + "\n")

    torch.manual_seed(1234)  # the resumed process must restore the RNG, not inherit it
    resumed = Trainer(load_config(None, overrides))
    assert resumed.step == stopped_at
    assert torch.equal(torch.rand(4), rng_after_stop)
    resumed.fit()
    resumed.close()

    got = _records(tmp_path / "run")
    assert [r["step"] for r in got] == list(range(1, 11))
    # Bit for bit: the loss of every step, before and after the stop.
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert [r["lr"] for r in got] == [r["lr"] for r in want]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in want]


def test_resume_mid_balance_interval_is_exact(tmp_path, shakespeare_cached):
    in_child(_resume_mid_balance_interval, tmp_path)


def _resume_mid_balance_interval(tmp_path):
    """Dynamic capacity and per-expert learning rates change every balance_interval steps from the
    load counted since the last change: a resume between two changes must continue that count."""
    from moetrain.train.trainer import Trainer

    torch.use_deterministic_algorithms(True)  # this child process only
    balancing = ("--train.deterministic=true", "--moe.balance_interval=3", "--moe.capacity_factor=1.25",
                 "--moe.dynamic_capacity=true", "--moe.expert_lr_scale_max=4", "--moe.unused_expert_steps=2")
    ref = Trainer(load_config(None, _ov(tmp_path / "ref", steps=9, extra=balancing)))
    ref.fit()
    ref.close()
    want = _records(tmp_path / "ref")

    # Stopped after step 4 (one step into the second interval), then resumed to step 9.
    first = Trainer(load_config(None, _ov(tmp_path / "run", steps=4,
                                          extra=(*balancing, "--checkpoint.save_final=true"))))
    first.fit()
    first.close()
    resumed = Trainer(load_config(None, _ov(tmp_path / "run", steps=9, extra=balancing)))
    assert resumed.step == 4
    resumed.fit()
    resumed.close()
    got = _records(tmp_path / "run")

    assert [r["step"] for r in got] == list(range(1, 10))
    for key in ("loss", "grad_norm", "capacity_factor", "expert_lr_scale", "unused_experts"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    # The interval changes really happened (at steps 3, 6 and 9), so the comparison means something.
    factors = [r["capacity_factor"] for r in want]
    assert factors[0] == [1.25, 1.25] and len({tuple(f) for f in factors}) > 1, factors


def test_checkpoint_layout_rotation_and_router_state(tmp_path, shakespeare_cached):
    in_child(_layout_rotation_and_router_state, tmp_path)


def _layout_rotation_and_router_state(tmp_path):
    from moetrain.train.trainer import Trainer

    run_dir = tmp_path / "run"
    trainer = Trainer(load_config(None, _ov(run_dir, steps=6, extra=("--checkpoint.every=2",
                                                                     "--checkpoint.keep_last=2"))))
    # Router state such as an expert bias is a persistent buffer: it must travel with the model.
    routers = [blk.feed_forward.router for blk in trainer.model.layers]
    for i, router in enumerate(routers):
        router.register_buffer("state_probe", torch.arange(E, dtype=torch.float32) + 10 * i)
    trainer.fit()
    saved_weights = _full_state(trainer)
    trainer.close()

    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000000004", "step_000000006"]
    assert (ckpts / "latest").read_text().strip() == "step_000000006"
    manifest = json.loads((ckpts / "step_000000006" / "manifest.json").read_text())
    assert manifest["step"] == 6 and manifest["world_size"] == 1
    written = {p.name for p in (ckpts / "step_000000006").iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == written

    weights, trainer_state = load_model_weights(ckpts / "step_000000006")
    # Data position in optimizer steps (each 2 micro-batches of 4 sequences here).
    assert trainer_state["step"] == 6 and trainer_state["data"]["step"] == 6  # counted in optimizer steps
    assert trainer_state["config"]["model"]["vocab_size"] == 256
    assert torch.equal(weights["layers.1.feed_forward.router.state_probe"], torch.arange(E) + 10.0)
    for name, value in weights.items():
        if f"param/{name}" in saved_weights:
            assert torch.equal(value, saved_weights[f"param/{name}"]), name

    fresh = Trainer(load_config(None, _ov(tmp_path / "fresh", steps=6)))
    for router in (blk.feed_forward.router for blk in fresh.model.layers):
        router.register_buffer("state_probe", torch.zeros(E))
    loaded = load_checkpoint(ckpts / "step_000000006", model=fresh.model, optimizer=fresh.optimizer)
    assert loaded.step == 6
    assert torch.equal(fresh.model.layers[1].feed_forward.router.state_probe, torch.arange(E) + 10.0)
    _assert_same_state(_full_state(fresh), saved_weights)
    fresh.close()


def _train_source(run_dir):
    """A finished 2-step run with its checkpoint at step 2: the checkpoint the next tests load."""
    from moetrain.train.trainer import Trainer

    source = Trainer(load_config(None, _ov(run_dir, steps=2)))
    source.fit()
    source.close()


def test_corrupt_or_partial_checkpoint_is_refused_and_loads_nothing(tmp_path, shakespeare_cached):
    in_child(_corrupt_or_partial_refused, tmp_path)


def _corrupt_or_partial_refused(tmp_path):
    from moetrain.train.trainer import Trainer

    _train_source(tmp_path / "src")
    good = _step_dir(tmp_path / "src", 2)

    def broken(name: str, damage) -> object:
        path = tmp_path / name
        shutil.copytree(good, path)
        damage(path)
        return path

    def truncate(p):
        data = p / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])

    def flip_byte(p):
        data = p / "__0_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))

    cases = [
        (broken("missing_file", lambda p: (p / "__0_0.distcp").unlink()), r"__0_0\.distcp is missing"),
        (broken("truncated", truncate), r"__0_0\.distcp has \d+ bytes, the manifest says \d+"),
        (broken("flipped", flip_byte), r"__0_0\.distcp does not match its sha256"),
        (broken("no_manifest", lambda p: (p / "manifest.json").unlink()),
         r"no manifest\.json: it is incomplete"),
        (broken("no_index", lambda p: (p / ".metadata").unlink()), r"\.metadata is missing"),
    ]
    target = Trainer(load_config(None, _ov(tmp_path / "target", steps=2)))
    before = _full_state(target)
    for path, message in cases:
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(path, model=target.model, optimizer=target.optimizer)
    # Past the manifest check (verify=False), DCP itself fails half way through the truncated
    # file: the load reads into fresh tensors, so still nothing changed.
    with pytest.raises(CheckpointError, match="nothing was loaded"):
        load_checkpoint(tmp_path / "truncated", model=target.model, optimizer=target.optimizer, verify=False)
    # A model with state the checkpoint lacks, and one without state the checkpoint has.
    target.model.layers[0].feed_forward.router.register_buffer("state_probe", torch.zeros(E))
    with pytest.raises(CheckpointError,
                       match=r"missing entries: model\.layers\.0\.feed_forward\.router\.state_probe"):
        load_checkpoint(good, model=target.model, optimizer=target.optimizer)
    del target.model.layers[0].feed_forward.router.state_probe
    _assert_same_state(_full_state(target), before)
    target.close()

    # Another model (dim 32): the trainer's resume names the config field; the loader itself names
    # every mis-shaped entry.
    with pytest.raises(CheckpointError, match=r"does not match this job's model: model\.dim \(saved 64, now 32\)"):
        Trainer(load_config(None, _ov(tmp_path / "other", steps=2,
                                      extra=("--model.dim=32", f"--checkpoint.resume={good}"))))
    other = Trainer(load_config(None, _ov(tmp_path / "other", steps=2, extra=("--model.dim=32",))))
    with pytest.raises(CheckpointError, match=r"entries of another shape: model\.layers\.0\.attention\.wk"
                                              r"\.weight \(saved \(64, 64\), this model \(32, 32\)\)"):
        load_checkpoint(good, model=other.model, optimizer=other.optimizer)
    other.close()
    # The temporary folder of a save that never finished is not a checkpoint.
    tmp_dir = tmp_path / "src" / "checkpoints" / ".step_000000003.tmp"
    tmp_dir.mkdir()
    from moetrain.train.checkpoint.files import resolve_checkpoint

    with pytest.raises(CheckpointError, match="never finished"):
        resolve_checkpoint(tmp_dir)


# --- resharding (gloo ranks) -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_reshard_world4_ep2_to_world2_ep2_and_world4_ep4(tmp_path, shakespeare_cached):
    saved = run_ranks(_run, 4, _ov(tmp_path / "w4ep2", steps=6, ep=2, micro=2,
                                   extra=("--checkpoint.every=3",)), capture_steps=(3,), timeout_s=120)[0]
    ckpt = _step_dir(tmp_path / "w4ep2", 3)
    for world, ep, micro in ((2, 2, 4), (4, 4, 2)):
        run_dir = tmp_path / f"w{world}ep{ep}"
        got = run_ranks(_run, world, _ov(run_dir, steps=6, ep=ep, micro=micro,
                                         extra=(f"--checkpoint.resume={ckpt}",)), timeout_s=120)[0]
        assert got["resumed_step"] == 3
        # Identical global weights *and* optimizer states, whatever the layout.
        _assert_same_state(got["loaded"], saved["captured"][3])
        # Training continues as it would have (the reduction order differs: fp32 tolerance).
        assert got["losses"] == pytest.approx(saved["losses"][3:], rel=1e-4), (world, ep)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_reshard_single_process_to_ep2_and_back_with_global_expert_index(tmp_path, shakespeare_cached):
    # (world 1) -> (world 2, ep 2)
    single = run_ranks(_run, 1, _ov(tmp_path / "w1", steps=6, micro=8, extra=("--checkpoint.every=3",)),
                       capture_steps=(3,), timeout_s=120)[0]
    ep2 = run_ranks(_run, 2, _ov(tmp_path / "ep2", steps=8, ep=2, micro=4,
                                 extra=(f"--checkpoint.resume={_step_dir(tmp_path / 'w1', 3)}",
                                        "--checkpoint.every=3")),
                    capture_steps=(6,), timeout_s=120)
    _assert_same_state(ep2[0]["loaded"], single["captured"][3])
    assert ep2[0]["losses"][:3] == pytest.approx(single["losses"][3:], rel=1e-4)

    # (world 2, ep 2) -> (world 1): rank r held experts [2r, 2r + 2) of every layer.
    back = run_ranks(_run, 1, _ov(tmp_path / "w1b", steps=8, micro=8,
                                  extra=(f"--checkpoint.resume={_step_dir(tmp_path / 'ep2', 6)}",)),
                     timeout_s=120)[0]
    _assert_same_state(back["loaded"], ep2[0]["captured"][6])
    for name in ep2[0]["local_experts"][6]:
        full = back["loaded"][f"param/{name}"]  # [E, ...] as loaded by one process
        for e in range(E):
            rank, local = divmod(e, E // 2)
            assert torch.equal(full[e], ep2[rank]["local_experts"][6][name][local]), (name, e)
    assert back["losses"] == pytest.approx(ep2[0]["losses"][3:], rel=1e-4)

    # Export of the sharded checkpoint: one file of full tensors, equal to the gathered weights.
    from safetensors.torch import load_file

    from moetrain.cli import main as cli_main

    out = tmp_path / "export"
    assert cli_main(["export", str(_step_dir(tmp_path / "ep2", 6)), "--to", str(out)]) == 0
    exported = load_file(str(out / "model.safetensors"))
    params = {k.removeprefix("param/"): v for k, v in ep2[0]["captured"][6].items() if k.startswith("param/")}
    assert set(params) <= set(exported)
    for name, value in params.items():
        assert torch.equal(exported[name], value), name
    assert load_config(out / "config.yaml").model.vocab_size == 256


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_zero1_resume_is_exact(tmp_path, shakespeare_cached):
    zero1 = ("--parallel.zero_stage=1", "--train.deterministic=true")
    # The reference saves step 3 itself (saving changes nothing in a run); the resumed run starts
    # from a copy of it in a run directory of its own.
    ref = run_ranks(_run, 2, _ov(tmp_path / "ref", steps=6, extra=(*zero1, "--checkpoint.every=3")),
                    timeout_s=120)[0]
    shutil.copytree(_step_dir(tmp_path / "ref", 3), _step_dir(tmp_path / "run", 3))
    resumed = run_ranks(_run, 2, _ov(tmp_path / "run", steps=6, extra=zero1), timeout_s=120)[0]
    assert resumed["resumed_step"] == 3
    assert len(ref["losses"]) == 6 and resumed["losses"] == ref["losses"][3:]  # bit for bit


def test_other_accumulation_resumes_and_other_global_batch_is_a_clear_error(tmp_path, shakespeare_cached):
    in_child(_other_batch_geometry, tmp_path)


def _other_batch_geometry(tmp_path):
    from moetrain.train.trainer import Trainer

    _train_source(tmp_path / "src")  # world 1, micro 4: two micro-batches per step
    resume = f"--checkpoint.resume={_step_dir(tmp_path / 'src', 2)}"
    # One micro-batch of 8 per step: the same global batch, so the same data from step 3 on.
    t = Trainer(load_config(None, _ov(tmp_path / "dst", steps=4, micro=8, extra=(resume,))))
    assert (t.step, t.grad_accum) == (2, 1)
    source = t.data.train_loader(global_batch_size=8, micro_steps=2, seed=t.cfg.train.seed)
    source.load_state_dict(t.train_loader.state_dict())
    expected = torch.cat([source.next_batch()[0], source.next_batch()[0]])
    assert torch.equal(t.train_loader.next_batch()[0], expected)
    t.close()
    with pytest.raises(ValueError, match=r"saved global_batch_size \(8\) differs from this run's \(16\)"):
        Trainer(load_config(None, _ov(tmp_path / "dst2", steps=4, micro=8,
                                      extra=(resume, "--train.global_batch_size=16"))))
