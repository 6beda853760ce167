"""``moetrain data prepare`` killed with SIGKILL (with its worker processes) once some shards exist,
then rerun: the output equals, byte for byte, that of a run never killed (with another number of
workers, so the bytes depend on neither the kill nor the workers)."""

import json
import os
import random
import signal
import subprocess
import sys
import time

from moetrain.data.tokenizer import EOS_TOKEN, train_bpe


def prepare_command(inp, out, tokenizer, workers):
    return [sys.executable, "-m", "moetrain.cli", "data", "prepare", str(inp), "--out", str(out), "--workers",
            str(workers), "--shard-docs", "200", "--tokenizer", str(tokenizer)]


def test_prepare_killed_and_rerun_equals_an_uninterrupted_run(tmp_path):
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(2000)]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 120))) for _ in range(2400)]
    inp = tmp_path / "corpus.jsonl"
    inp.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = tmp_path / "tok"
    tok.mkdir()
    train_bpe(docs[:300], vocab_size=1000).save(tok / "tokenizer.json")
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN}))

    out = tmp_path / "killed"
    proc = subprocess.Popen(prepare_command(inp, out, tok / "tokenizer.json", 2), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(list(out.glob("shard-*.bin"))) < 2:
        assert proc.poll() is None, f"prepare ended before it could be killed: {proc.stderr.read().decode()}"
        assert time.monotonic() < deadline, "no shard written within 120 s"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the command and its workers, as a scheduler kills a job
    proc.wait()
    proc.stderr.close()
    assert not (out / "manifest.json").exists() and (out / "progress.json").exists()
    num_shards_at_kill = len(list(out.glob("shard-*.bin")))
    assert num_shards_at_kill < 12  # 2400 records / 200 per shard

    subprocess.run(prepare_command(inp, out, tok / "tokenizer.json", 2), check=True, capture_output=True)
    reference = tmp_path / "reference"
    subprocess.run(prepare_command(inp, reference, tok / "tokenizer.json", 1), check=True, capture_output=True)

    def files(folder):
        return {p.name: p.read_bytes() for p in folder.iterdir()}

    resumed, uninterrupted = files(out), files(reference)
    assert sorted(resumed) == sorted(uninterrupted)  # no partial file left behind, no progress.json
    assert [name for name in resumed if resumed[name] != uninterrupted[name]] == []
    assert len([n for n in resumed if n.endswith(".bin")]) == 12
    assert json.loads(resumed["manifest.json"])["num_documents"] == 2400
