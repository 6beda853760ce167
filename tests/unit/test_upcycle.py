"""``moetrain upcycle``: a dense Llama / Qwen3 built by `transformers` from its config class becomes
a moetrain MoE whose logits equal transformers' own forward of the dense model (identical experts,
renormalised top-k gates; and the granular split, whose slices carry a down-projection scaled by
G), also after converting the MoE back to Hugging Face (Mixtral, Qwen3-MoE). With noise the
logits move a little. The tensors are checked by hand (which slice each expert holds, the router's
virtual groups), and every option a user can get wrong is refused naming it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from moetrain.cli import main as cli_main
from moetrain.interop.export import build_model, read_export
from moetrain.interop.generation import load_tokenizer
from moetrain.interop.upcycle import upcycle_hf
from moetrain.utils.safetensors_io import SafetensorsFolder
from tests.helpers.hf_tiny_dense import DENSE_FAMILIES, input_ids, tiny_dense

TOL = 1e-4
F = 48  # the tiny models' intermediate_size

CASES = {
    "E4-K2": ["--num-experts", "4", "--top-k", "2"],
    "E8-K4-G2": ["--num-experts", "8", "--top-k", "4", "--granularity", "2"],
    "E6-K3-G3": ["--num-experts", "6", "--top-k", "3", "--granularity", "3"],
    "E4-K4-G4": ["--num-experts", "4", "--top-k", "4", "--granularity", "4"],
    "every2": ["--num-experts", "4", "--top-k", "2", "--moe-every", "2", "--moe-layer-offset", "1"],
}


@pytest.fixture(scope="module", params=DENSE_FAMILIES)
def dense(request, tmp_path_factory):
    """``(family, transformers model, its folder)``."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = tiny_dense(request.param)
    hf.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text("{}")
    return request.param, hf, folder


def _upcycled(tmp_path, folder, args: list[str]):
    assert cli_main(["upcycle", "--from-hf", str(folder), "--to", str(tmp_path / "up"), *args]) == 0
    config, sd, info = read_export(tmp_path / "up")
    return config, sd, info


@pytest.mark.parametrize("case", list(CASES))
def test_upcycled_logits_equal_the_dense_models(tmp_path, dense, case):
    family, hf, folder = dense
    config, sd, info = _upcycled(tmp_path, folder, CASES[case])
    moe = config["moe"]
    assert info["upcycled_from"] == family
    assert moe["renormalize"] is True and moe["capacity_factor"] is None and moe["num_shared_experts"] == 0
    G = int(CASES[case][CASES[case].index("--granularity") + 1]) if "--granularity" in CASES[case] else 1
    assert moe["expert_hidden_dim"] == F // G and moe["activation"] == "swiglu"
    model = build_model(config, sd).eval()
    assert [i for i, b in enumerate(model.layers) if b.is_moe] == ([1] if case == "every2" else [0, 1, 2])
    x = input_ids()
    with torch.no_grad():
        want, got = hf(x).logits, model(x).logits
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_each_expert_holds_its_slice_and_the_router_its_virtual_groups(tmp_path, dense):
    _, _, folder = dense
    _, sd, _ = _upcycled(tmp_path, folder, ["--num-experts", "6", "--top-k", "4", "--granularity", "2"])
    hf = SafetensorsFolder(folder)
    f = F // 2
    for layer in range(3):
        gate, up, down = (hf.get(f"model.layers.{layer}.mlp.{p}_proj.weight") for p in ("gate", "up", "down"))
        mt = f"layers.{layer}.feed_forward"
        w1, w3, w2 = (sd[f"{mt}.experts.{w}"] for w in ("w1", "w3", "w2"))
        assert w1.shape == w3.shape == (6, 32, f) and w2.shape == (6, f, 32)
        for e in range(6):
            g = e % 2  # expert c * G + g holds slice g
            rows = slice(g * f, (g + 1) * f)
            assert torch.equal(w1[e], gate[rows].t()) and torch.equal(w3[e], up[rows].t())
            assert torch.equal(w2[e], 2 * down[:, rows].t())
        router = sd[f"{mt}.router.gate.weight"]
        assert router.shape == (6, 32)
        for c in range(3):
            assert torch.equal(router[2 * c], router[2 * c + 1])  # one copy's slices score alike
        assert not torch.equal(router[0], router[2]) and not torch.equal(router[2], router[4])
        assert 0.01 < float(router.std()) < 0.03  # normal(initializer_range 0.02)


def test_dense_blocks_and_backbone_are_copied(tmp_path, dense):
    _, _, folder = dense
    _, sd, _ = _upcycled(tmp_path, folder, CASES["every2"])
    hf = SafetensorsFolder(folder)
    for layer in (0, 2):
        for p, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            assert torch.equal(sd[f"layers.{layer}.feed_forward.{w}.weight"],
                               hf.get(f"model.layers.{layer}.mlp.{p}_proj.weight"))
    assert torch.equal(sd["tok_embeddings.weight"], hf.get("model.embed_tokens.weight"))
    assert torch.equal(sd["layers.1.attention.wq.weight"], hf.get("model.layers.1.self_attn.q_proj.weight"))


def test_noise_moves_the_logits_a_little(tmp_path, dense):
    _, hf, folder = dense
    config, sd, _ = _upcycled(tmp_path, folder, ["--num-experts", "4", "--top-k", "2", "--noise", "0.01"])
    w1 = sd["layers.0.feed_forward.experts.w1"]
    gate_DF = SafetensorsFolder(folder).get("model.layers.0.mlp.gate_proj.weight").t()
    for e in range(4):
        rel = float((w1[e] - gate_DF).std() / gate_DF.std())
        assert 0.008 < rel < 0.012, rel  # noise * std(w), every expert
    assert not torch.equal(w1[0], w1[1])
    x = input_ids()
    with torch.no_grad():
        diff = (build_model(config, sd).eval()(x).logits - hf(x).logits).abs().max()
    assert 1e-3 < float(diff) < 0.05, float(diff)


def test_same_seed_same_export_other_seed_other_router(tmp_path, dense):
    _, _, folder = dense
    args = ["--num-experts", "4", "--top-k", "2", "--noise", "0.01"]
    _, a, _ = _upcycled(tmp_path / "a", folder, args)
    _, b, _ = _upcycled(tmp_path / "b", folder, args)
    _, c, _ = _upcycled(tmp_path / "c", folder, [*args, "--seed", "1"])
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["layers.0.feed_forward.router.gate.weight"], c["layers.0.feed_forward.router.gate.weight"])
    assert not torch.equal(a["layers.0.feed_forward.experts.w2"], c["layers.0.feed_forward.experts.w2"])


def test_the_dense_models_tokenizer_travels_with_the_export(tmp_path, dense, capsys):
    """tokenizer.json and tokenizer_config.json byte for byte, read by generate's loader with the ids
    of the `tokenizers` library and the end-of-text id of the dense model's config.json; without a
    tokenizer.json the upcycle succeeds, writes none and says why."""
    _, hf, folder = dense
    with_tokenizer = tmp_path / "dense"
    shutil.copytree(folder, with_tokenizer)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<s>", "</s>"]
    bpe.train_from_iterator(["the king and the queen", "thou art the sword of love"],
                            trainers.BpeTrainer(vocab_size=40, special_tokens=specials, show_progress=False))
    bpe.save(str(with_tokenizer / "tokenizer.json"))
    config_json = json.loads((with_tokenizer / "config.json").read_text())
    config_json["eos_token_id"] = 2  # "</s>", named only here: the export has no config.json
    (with_tokenizer / "config.json").write_text(json.dumps(config_json))
    _upcycled(tmp_path, with_tokenizer, CASES["E4-K2"])
    up = tmp_path / "up"
    assert (up / "tokenizer.json").read_bytes() == (with_tokenizer / "tokenizer.json").read_bytes()
    tokenizer = load_tokenizer(yaml.safe_load((up / "config.yaml").read_text()), None, source=str(up))
    text = "the queen and the sword"
    assert tokenizer.encode(text) == Tokenizer.from_file(str(with_tokenizer / "tokenizer.json")).encode(text).ids
    assert tokenizer.eos_id == 2

    capsys.readouterr()
    _upcycled(tmp_path, folder, CASES["E4-K2"])  # the fixture's folder: tokenizer_config.json only
    assert not (up / "tokenizer.json").exists()  # the previous export's is removed, not taken for this one's
    assert "no tokenizer files" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["E4-K2", "E8-K4-G2"])
def test_upcycled_model_in_transformers_gives_the_dense_logits(tmp_path, dense, case):
    family, hf, folder = dense
    _upcycled(tmp_path, folder, CASES[case])
    assert cli_main(["convert", str(tmp_path / "up"), "--to-hf", str(tmp_path / "moe")]) == 0
    moe, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe", output_loading_info=True)
    assert not any(info.values()), info
    assert moe.config.model_type == {"llama": "mixtral", "qwen3": "qwen3_moe"}[family]
    x = input_ids()
    with torch.no_grad():
        torch.testing.assert_close(moe.eval()(x).logits, hf(x).logits, atol=TOL, rtol=0)


@pytest.mark.parametrize(("args", "message"), [
    (["--num-experts", "4", "--top-k", "1"], r"--top-k \(1\) must be >= 2"),
    (["--num-experts", "4", "--top-k", "6"], r"--top-k \(6\) must be <= --num-experts \(4\)"),
    (["--num-experts", "6", "--top-k", "4", "--granularity", "4"], r"--num-experts \(6\) must be a multiple"),
    (["--num-experts", "8", "--top-k", "3", "--granularity", "2"], r"--top-k \(3\) must be a multiple"),
    (["--num-experts", "5", "--top-k", "5", "--granularity", "5"], r"--granularity \(5\) must divide .* \(48\)"),
    (["--num-experts", "4", "--top-k", "2", "--moe-layer-offset", "3"], r"--moe-layer-offset \(3\) must be in"),
    (["--num-experts", "4", "--top-k", "2", "--moe-every", "0"], r"--moe-every \(0\)"),
    (["--num-experts", "4", "--top-k", "2", "--noise", "-0.1"], r"--noise \(-0.1\)"),
])
def test_options_that_break_a_rule_are_refused(tmp_path, dense, args, message):
    _, _, folder = dense
    with pytest.raises(ValueError, match=message):
        upcycle_hf(folder, tmp_path / "up", **_kwargs(args))
    assert not (tmp_path / "up").exists()


def _kwargs(args: list[str]) -> dict:
    out = {}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        key = flag.lstrip("-").replace("-", "_")
        out[key] = float(value) if key == "noise" else int(value)
    return out


def test_cli_reports_a_broken_rule_in_one_line(tmp_path, dense, capsys):
    _, _, folder = dense
    code = cli_main(["upcycle", "--from-hf", str(folder), "--num-experts", "4", "--top-k", "1", "--to",
                     str(tmp_path / "up")])
    assert code == 2
    assert "--top-k (1) must be >= 2" in capsys.readouterr().err


def test_an_moe_source_is_refused(tmp_path):
    from tests.helpers.hf_tiny_models import tiny_model

    tiny_model("mixtral").save_pretrained(tmp_path / "mixtral")
    with pytest.raises(ValueError, match="already an MoE"):
        upcycle_hf(tmp_path / "mixtral", tmp_path / "up", num_experts=4, top_k=2)
