"""optim.name "muon": the optimizer against a single-process reference written here from the published
algorithm (Keller Jordan's ``zeropower_via_newtonschulz5`` and Moonlight's ``Muon.step``, one 2-D
matrix at a time, experts one by one; torch's AdamW for the rest), which parameters it takes, exact
resume through moetrain's checkpoint files, the config's refusals, and the planner's state bytes
against a dry run. The parallel layouts are in tests/distributed/test_muon_parallel.py."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from moetrain.config.loader import load_config
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.distributed.muon import muon_param_ids, orthogonalize, update_scale
from moetrain.distributed.pipeline.stages import build_pipeline_model
from moetrain.models.lora import apply_lora
from moetrain.models.transformer import Transformer
from moetrain.plan.dry_run import dry_run
from moetrain.plan.model_states import Layout, ParamSpec, rank_state_bytes, transient_state_bytes
from moetrain.train.checkpoint.state import load_checkpoint, save_checkpoint
from moetrain.train.optim import build_optimizer

LR, WD, MU, BETAS, EPS = 2e-2, 0.1, 0.95, (0.9, 0.95), 1e-8
ADAMW_NAMES = ("tok_embeddings.weight", "router.gate.weight")
"""Parameters the published recipe leaves to AdamW besides vectors: embedding (tied head), router."""


def _model() -> Transformer:
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=2, max_seq_len=16, moe_every=2,
                      tie_embeddings=True)
    return Transformer(cfg, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=48), seed=3)


def _batches(steps: int) -> torch.Tensor:
    """Counting sequences (next = previous + 1 mod 64) from random starts: learnable in a few steps."""
    g = torch.Generator().manual_seed(5)
    return (torch.randint(0, 64, (steps, 4, 1), generator=g) + torch.arange(17)) % 64


def _muon(model):
    return build_optimizer(model, name="muon", lr=LR, weight_decay=WD, betas=BETAS, eps=EPS, momentum=MU)


# --- the reference, from the papers' code --------------------------------------------------------


def newton_schulz5(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's zeropower_via_newtonschulz5 for one 2-D matrix (in fp32)."""
    assert G.ndim == 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.clone()
    if G.size(0) > G.size(1):
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(0) > G.size(1):
        X = X.T
    return X


class ReferenceMuon:
    """Moonlight's Muon.step for the matrices, one expert at a time; torch.optim.AdamW for the rest."""

    def __init__(self, model: torch.nn.Module) -> None:
        named = [(n, p) for n, p in model.named_parameters()]
        self.matrices = [p for n, p in named if p.ndim >= 2 and not n.endswith(ADAMW_NAMES)]
        decay = [p for n, p in named if n.endswith(ADAMW_NAMES)]
        vectors = [p for n, p in named if p.ndim < 2]
        assert len(self.matrices) + len(decay) + len(vectors) == len(named)
        self.adamw = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                                        {"params": vectors, "weight_decay": 0.0}], lr=LR, betas=BETAS, eps=EPS,
                                       fused=True)
        self.momentum = {id(p): torch.zeros_like(p) for p in self.matrices}

    @torch.no_grad()
    def step(self) -> None:
        for p in self.matrices:
            buf = self.momentum[id(p)]
            buf.mul_(MU).add_(p.grad)
            g = p.grad.add(buf, alpha=MU)  # nesterov
            for e in range(p.shape[0]) if p.ndim == 3 else [None]:
                w, u = (p, g) if e is None else (p[e], g[e])
                A, B = u.shape
                adjusted_lr = LR * 0.2 * math.sqrt(max(A, B))
                w.mul_(1 - LR * WD)
                w.add_(newton_schulz5(u), alpha=-adjusted_lr)
        self.adamw.step()


def _train(model, optimizer, batches) -> list[float]:
    losses = []
    for tokens in batches:
        out = model(tokens[:, :-1], tokens[:, 1:])
        out.total_loss.backward()
        optimizer.step()
        for p in model.parameters():
            p.grad = None
        losses.append(out.loss.item())
    return losses


def test_muon_equals_the_published_algorithm():
    """Four steps: every parameter (attention and expert matrices by Muon, embedding, router and norms
    by AdamW) within fp32 rounding of the reference (batched vs per-expert matmuls round differently)."""
    batches = _batches(4)
    model, ref = _model(), _model()
    losses = _train(model, _muon(model), batches)
    ref_losses = _train(ref, ReferenceMuon(ref), batches)
    assert losses[-1] < losses[0] - 0.1  # it learns
    for a, b in zip(losses, ref_losses, strict=True):
        assert a == pytest.approx(b, rel=1e-6)
    start = dict(_model().named_parameters())
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        moved = (q - start[name]).abs().max().item()
        assert moved > 1e-4, name  # every parameter trains
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6 * moved, msg=name)


def test_parameter_selection_and_lora_adapters():
    model = _model()
    groups = {g["name"]: g for g in _muon(model).param_groups}
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for p in groups["muon"]["params"]}
    assert all(groups[k]["muon"] is (k == "muon") for k in groups)
    assert {names[id(p)] for p in groups["decay"]["params"]} == {"tok_embeddings.weight",
                                                                 "layers.0.feed_forward.router.gate.weight"}
    assert all(names[id(p)].endswith("norm.weight") for p in groups["no_decay"]["params"])
    assert "layers.0.feed_forward.experts.w1" in muon and "layers.0.attention.wq.weight" in muon
    assert len(muon) == 4 * 2 + 2 + 2  # attention x 2 blocks, dense w1/w2, experts w1/w2
    # LoRA: the base weights freeze; the adapters (expert ones stacked [E, I, R]) are Muon's.
    lora = _model()
    cfg = load_config(None, ["--finetune.lora_rank=4", "--finetune.lora_targets=[attention,experts]"]).finetune
    apply_lora(lora, cfg, seed=0)
    names = {id(p): n for n, p in lora.named_parameters()}
    muon = {names[id(p)] for p in next(g for g in _muon(lora).param_groups if g["muon"])["params"]}
    assert "layers.0.feed_forward.experts.lora_a_w1" in muon and "layers.0.attention.wq.lora_b" in muon
    assert not any(n.endswith(("experts.w1", "wq.weight")) for n in muon)


def test_every_pipeline_stage_splits_its_parameters_as_the_whole_model_does():
    """Muon or AdamW by parameter name, the same on each pp = 2 stage as in one process: the last
    stage's untied output head stays AdamW's."""
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=4, num_heads=2, max_seq_len=16, moe_every=2,
                      tie_embeddings=False)
    full = Transformer(cfg, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=32), seed=7)
    whole = {n for n, p in full.named_parameters() if id(p) in muon_param_ids(full)}
    assert "output.weight" not in whole and "layers.0.attention.wq.weight" in whole
    for pp_rank in (0, 1):
        stage = build_pipeline_model(full, pp_rank=pp_rank, pp=2)
        names = {n for n, _ in stage.named_parameters()}
        assert "output.weight" in names or pp_rank == 0
        assert {n for n, p in stage.named_parameters() if id(p) in muon_param_ids(stage)} == whole & names


def test_orthogonalize_and_update_scale():
    """Singular values land near 1 (the quintic's band, about [0.7, 1.2]), for a batch as for each
    matrix alone; the scaled update has Moonlight's RMS of about 0.2 for any shape."""
    g = torch.Generator().manual_seed(0)
    u = torch.randn(3, 48, 16, generator=g)
    o = orthogonalize(u, steps=5)
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.6 and s.max() < 1.25
    torch.testing.assert_close(o[1], orthogonalize(u[1], steps=5), rtol=1e-5, atol=1e-6)
    for shape in ((48, 16), (16, 48), (128, 128)):
        rms = (update_scale(shape) * orthogonalize(torch.randn(*shape, generator=g), steps=5)).square().mean().sqrt()
        assert 0.15 < rms < 0.25, shape


def test_exact_resume_through_a_checkpoint(tmp_path):
    """Two steps, save (moetrain's checkpoint files), two more; against a fresh model and Muon loaded
    from that checkpoint taking the same two steps: bit for bit, weights and momenta."""
    batches = _batches(4)
    model = _model()
    opt = _muon(model)
    _train(model, opt, batches[:2])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is", category=UserWarning)
        path = save_checkpoint(tmp_path / "ckpt", 2, model=model, optimizer=opt, trainer_state={"step": 2})
        resumed = _model()
        resumed_opt = _muon(resumed)
        load_checkpoint(path, model=resumed, optimizer=resumed_opt)
    want = _train(model, opt, batches[2:])
    got = _train(resumed, resumed_opt, batches[2:])
    assert got == want
    for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name
        for key, value in opt.state[p].items():
            assert torch.equal(value, resumed_opt.state[q][key]), (name, key)
    assert set(opt.state[model.layers[0].attention.wq.weight]) == {"momentum_buffer"}


@pytest.mark.parametrize("overrides,field", [
    (["--parallel.tp=2"], "parallel.tp"),
    (["--parallel.etp=2"], "parallel.etp"),
    (["--dp.grad_compression=onebit"], "dp.grad_compression"),
    (["--parallel.zero_stage=3", "--zero.offload_param=cpu"], "zero.offload_param"),
    (["--optim.muon_momentum=1.0"], "optim.muon_momentum"),
    (["--optim.muon_ns_steps=0"], "optim.muon_ns_steps"),
])
def test_config_refusals_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as e:
        load_config("tiny", ["--optim.name=muon", *overrides])
    assert "optim.name" in str(e.value) or field.startswith("optim.muon")


def test_muon_fields_warn_under_adamw():
    with pytest.warns(UserWarning, match=r"optim\.muon_ns_steps \(3\) is ignored"):
        load_config("tiny", ["--optim.muon_ns_steps=3"])


# --- the planner -----------------------------------------------------------------------------------


def test_planner_state_bytes_by_hand():
    """One momentum (4 bytes) per Muon element, no step counter; AdamW's 8 + 4 for the rest; the
    transient whole matrix and Newton-Schulz temporaries only under Muon."""
    specs = [ParamSpec("w", (8, 6), expert=False, matrix=True), ParamSpec("x", (4, 6, 5), expert=True, matrix=True),
             ParamSpec("n", (6,), expert=False)]
    adam = rank_state_bytes(specs, Layout(world=2, ep=2, zero_stage=0), 0)
    muon = rank_state_bytes(specs, Layout(world=2, ep=2, zero_stage=0, optimizer="muon"), 0)
    assert adam.optim == (48 + 2 * 30 + 6) * 8 + 3 * 4
    assert muon.optim == (48 + 2 * 30) * 4 + 6 * 8 + 4
    zero1 = rank_state_bytes(specs, Layout(world=2, ep=1, zero_stage=1, optimizer="muon"), 1)
    assert zero1.optim == (24 + 60) * 4 + 3 * 8 + 4
    extra = (transient_state_bytes(specs, Layout(world=2, ep=1, zero_stage=3, optimizer="muon"))
             - transient_state_bytes(specs, Layout(world=2, ep=1, zero_stage=3)))
    assert extra == (4 * 120 + 3 * 4 * 25) * 4  # the 4 experts [6, 5]: the largest Muon tensor


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dry_run_muon_states_equal_the_planner(stage):
    """The real optimizer built and stepped for one rank of 4 (ep 2, fake process group, meta
    device) holds exactly the planned bytes, and fewer than AdamW's."""
    cfg = load_config("tiny", [f"--parallel.zero_stage={stage}", "--optim.name=muon"])
    d = dry_run(cfg, nproc=4)
    assert d.measured == d.planned, (d.measured, d.planned)
    adam = dry_run(load_config("tiny", [f"--parallel.zero_stage={stage}"]), nproc=4)
    assert d.measured.optim < 0.7 * adam.measured.optim
