"""``moetrain generate`` end to end: a few training steps of a small MoE (with a capacity factor,
which generation replaces by dropless routing), then text from its checkpoint, with and without
the key/value cache. The generations run ``moetrain generate`` in this process (one thread, as
the command's own process), the refusal as a command of its own (its exit status and stderr)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetrain.cli import main
from tests.helpers.dist_launcher import run_ranks
from tests.integration.conftest import job_overrides, train_job

ROOT = Path(__file__).resolve().parents[2]
FIGURES = re.compile(r"^\[(\d+) new tokens in [\d.]+ s: [\d.]+ tokens/s \(prefill of (\d+) tokens \+ first token "
                     r"[\d.]+ ms; decode [\d.]+ tokens/s\); (kv cache|no cache), cpu, fp32\]$", re.MULTILINE)


def _cli(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "moetrain.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory, shakespeare_cached) -> Path:
    run_dir = tmp_path_factory.mktemp("generate") / "run"
    run_ranks(train_job, 1, job_overrides(run_dir, steps=4, extra=("--moe.capacity_factor=1.5",)), timeout_s=240)
    return run_dir


def _generate(capsys, args: list[str]) -> tuple[str, re.Match, str]:
    """``moetrain generate`` in this process: the text, the figures line, stderr."""
    capsys.readouterr()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["generate", *args]) == 0
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    match = FIGURES.search(out)
    assert match is not None, out + err
    return out[:match.start()].removesuffix("\n"), match, err


@pytest.mark.slow
def test_generate_prints_text_and_tokens_per_s_and_the_cache_changes_nothing(run, capsys):
    base = [str(run), "--prompt", "ROMEO:", "--max-new-tokens", "24", "--device", "cpu"]
    text, figures, err = _generate(capsys, [*base, "--temperature", "0"])
    assert text.startswith("ROMEO:") and len(text.encode()) >= len("ROMEO:") + 1
    assert figures.group(1) == "24" and figures.group(2) == "6" and figures.group(3) == "kv cache"
    assert "moe.capacity_factor 1.5 -> None: generation routes dropless" in err
    uncached_text, uncached, _ = _generate(capsys, [*base, "--temperature", "0", "--no-cache"])
    assert uncached.group(3) == "no cache" and uncached_text == text

    sampled = [*base, "--temperature", "1.2", "--top-k", "40", "--top-p", "0.9", "--seed", "3"]
    a, _, _ = _generate(capsys, sampled)
    assert a.startswith("ROMEO:") and a != text
    checkpoint = next((run / "checkpoints").glob("step*"))
    again, _, _ = _generate(capsys, [*sampled, "--checkpoint", str(checkpoint), "--tokenizer", "bytes"])
    assert again == a  # the same checkpoint, tokenizer and seed


@pytest.mark.slow
def test_generate_refuses_what_does_not_fit_with_one_error_line(run):
    r = _cli(["generate", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "64", "--device", "cpu"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert ("moetrain: error: prompt tokens + max_new_tokens ('6 + 64') must be <= model.max_seq_len (64)"
            in r.stderr)


@pytest.mark.slow
def test_bad_sampling_tokenizer_and_source_are_one_error_each(run, tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "mixtral"}')
    base = ["--prompt", "ROMEO:", "--max-new-tokens", "4", "--device", "cpu"]
    for args, message in [
        ([str(run), *base, "--top-p", "1.5"], "top_p (1.5) must be None or in (0, 1]"),
        ([str(run), *base, "--tokenizer", str(tmp_path / "nope.json")], f"--tokenizer ('{tmp_path}/nope.json') does "
                                                                       "not exist"),
        ([str(hf), *base], f"is a Hugging Face model folder (config.json), not a moetrain run, checkpoint or "
                           f"export: convert it first with `moetrain convert --from-hf {hf} --to EXPORT`")]:
        capsys.readouterr()
        assert main(["generate", *args]) == 2
        assert message in capsys.readouterr().err, args
