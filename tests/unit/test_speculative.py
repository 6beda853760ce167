"""Self-speculative decoding with the multi-token modules (``generate_speculative``): its output is
greedy decoding's token for token, with the model's own drafts (random weights: mostly rejected)
and with a drafter that proposes greedy's tokens with every third one wrong (long accepted runs,
rejections mid-run, the caches rewound after each), for MoE and dense blocks, latent attention,
depths 2 and 3 and a stop token."""

from __future__ import annotations

import pytest
import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.rope import RopeScaling
from moetrain.models.transformer import Transformer
from moetrain.train import generation
from moetrain.train.generation import generate, generate_speculative

V = 64


def _model(depth: int, **kw) -> Transformer:
    cfg = ModelConfig(vocab_size=V, dim=32, num_layers=2, num_heads=4, max_seq_len=64, mtp_depth=depth, **kw)
    return Transformer(cfg, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=16), seed=1).eval()


def _prompt(n: int = 5) -> torch.Tensor:
    return torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize(("depth", "kw"), [(3, {}),
                                           (2, {"moe_every": 0, "attention": "mla", "kv_lora_rank": 8,
                                                "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8})])
def test_equals_greedy_with_the_models_own_drafts(depth, kw):
    model = _model(depth, **kw)
    want = generate(model, _prompt(), max_new_tokens=12, temperature=0)
    got = generate_speculative(model, _prompt(), max_new_tokens=12)
    assert torch.equal(got.ids_BS, want.ids_BS)
    assert got.num_new == 12 and got.num_steps == 12 - 1 - got.num_accepted
    assert 0 < got.num_drafted <= depth * got.num_steps


def test_equals_greedy_when_drafts_are_mostly_right(monkeypatch):
    model = _model(3)
    want = generate(model, _prompt(1), max_new_tokens=24, temperature=0).ids_BS[0].tolist()

    def oracle(self, tokens, *, num):
        # greedy's next tokens, wrong at every fifth position: runs of 0 to 3 accepted drafts
        return [t if i % 5 else (t + 1) % V for i, t in enumerate(want[len(tokens):len(tokens) + num], len(tokens))]

    monkeypatch.setattr(generation._MtpDrafter, "propose", oracle)
    got = generate_speculative(model, _prompt(1), max_new_tokens=24)
    assert got.ids_BS[0].tolist() == want
    assert got.num_accepted >= 8 and got.num_steps <= 15


def test_stops_at_the_stop_token_and_refuses_what_it_cannot_do():
    model = _model(2)
    free = generate(model, _prompt(), max_new_tokens=10, temperature=0).ids_BS[0].tolist()
    stop = free[8]
    want = generate(model, _prompt(), max_new_tokens=10, temperature=0, stop_id=stop).ids_BS[0].tolist()
    got = generate_speculative(model, _prompt(), max_new_tokens=10, stop_id=stop).ids_BS[0].tolist()
    assert got == want[:want.index(stop, 5) + 1] and got[-1] == stop
    with pytest.raises(ValueError, match="model.mtp_depth"):
        generate_speculative(_model(0), _prompt(), max_new_tokens=4)
    with pytest.raises(ValueError, match="batch size"):
        generate_speculative(model, _prompt().repeat(2, 1), max_new_tokens=4)
    # Dynamic rope scaling: identical within the original length, refused past it (the verifying
    # forward would rotate the drafts with another stretch than greedy decoding does).
    dynamic = _model(2, rope_scaling=RopeScaling(rope_type="dynamic", factor=2.0, original_max_seq_len=16))
    within = generate_speculative(dynamic, _prompt(), max_new_tokens=11)
    assert torch.equal(within.ids_BS, generate(dynamic, _prompt(), max_new_tokens=11, temperature=0).ids_BS)
    with pytest.raises(ValueError, match=r"must be <= model.rope_scaling.original_max_seq_len \(16\) for "
                                         "speculative decoding with rope_type 'dynamic'"):
        generate_speculative(dynamic, _prompt(), max_new_tokens=12)


def test_the_command_line_prints_greedys_text_and_the_acceptance(tmp_path, capsys):
    import json

    from moetrain.cli import main as cli_main
    from moetrain.interop.export import write_export

    cfg = ModelConfig(vocab_size=256, dim=32, num_layers=2, num_heads=4, max_seq_len=64, mtp_depth=2)
    model = Transformer(cfg, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=16), seed=1)
    config = {"model": json.loads(json.dumps(model.config.__dict__, default=list)),
              "moe": dict(model.moe_config.__dict__)}
    write_export(tmp_path / "mt", config=config, state_dict=model.state_dict())
    base = ["generate", str(tmp_path / "mt"), "--prompt", "ROMEO:", "--max-new-tokens", "8", "--tokenizer", "bytes",
            "--device", "cpu", "--ignore-eos"]
    assert cli_main([*base, "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out.splitlines()
    assert cli_main([*base, "--speculative"]) == 0
    spec = capsys.readouterr().out.splitlines()
    assert spec[:-1] == greedy[:-1]  # the text
    assert "speculative: " in spec[-1] and "drafts accepted" in spec[-1] and "speculative" not in greedy[-1]
    assert cli_main([*base, "--speculative", "--temperature", "0.8"]) == 2
    assert "--temperature (0.8) cannot be used with --speculative" in capsys.readouterr().err
