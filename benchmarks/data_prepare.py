"""Tokens per second per core of ``moetrain data prepare`` against Hugging Face ``datasets``'
``map(batched=True, num_proc=N)``, same tokenizer, same input, same ids; and the peak memory of a
prepare on a corpus ten times larger than its in-flight bound.

    .venv/bin/python benchmarks/data_prepare.py [--mb 200] [--workers 2] [--repeats 3] [--json]

1. A jsonl of ``--mb`` MB is generated from the registered corpus ``shakespeare`` (paragraphs
   grouped into documents of about 2 kB, the plays shuffled differently on each pass) and cached
   under /tmp/moetrain-bench/; a byte-level BPE of 8192 tokens is trained on its first 8 MB
   (cached beside it) and is the tokenizer.json both tools use.
2. moetrain: ``prepare_corpus`` with N workers (what ``moetrain data prepare --workers N`` runs) in
   a fresh process, from the jsonl to token shards.
3. datasets: ``load_dataset("json")`` (jsonl -> arrow, timed apart) then ``map(batched=True,
   num_proc=N)`` with the same tokenizer's ``encode_batch`` (no special tokens, eos appended: the
   ids moetrain writes), in a fresh process with a fresh cache. The ids of both are asserted equal.
4. tokens/s per core = tokens / wall seconds / N. The headline ratio divides moetrain's figure
   (which includes reading and parsing the jsonl) by ``map``'s alone (which does not: its JSON
   parsing is in ``load_dataset``); the end-to-end ratio, with load_dataset's time added, is printed
   beside it. Medians of ``--repeats`` runs; the load average is printed with each. On a machine
   shared with other jobs wall time per core understates both; tokens per CPU second (user + system
   time of the process and its workers, map's alone for datasets) is printed too, as the figure that
   contention moves least.
5. Memory: each moetrain run reports the peak RSS of its main process (VmHWM, reset after the
   imports) over its floor, and the largest peak RSS among its workers, on the full corpus and on
   one a tenth of its size: with a bound of 2 * N batches of 1 MB of text in flight, the peaks stay
   flat while the corpus grows tenfold.

``--json`` prints the figures as one JSON object (``moetrain_tokens_per_s_per_core``,
``datasets_tokens_per_s_per_core``, ``ratio_vs_datasets``, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path("/tmp/moetrain-bench/data_prepare")

MOETRAIN_CHILD = r"""
import json, resource, sys, time
from moetrain.data.prepare_corpus import PrepareOptions, prepare_corpus

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) from here on, not the imports'
    f.write("5")
floor = status("VmRSS")
inp, out, tokenizer, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

def cpu_seconds():  # this process and its finished workers
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

start, cpu = time.perf_counter(), cpu_seconds()
manifest = prepare_corpus([inp], PrepareOptions(out_dir=out, tokenizer=tokenizer, num_workers=workers),
                          log=lambda m: None)
seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
worker_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "tokens": manifest["num_tokens"], "floor": floor,
                  "peak": status("VmHWM"), "worker_peak": worker_peak}))
"""

DATASETS_CHILD = r"""
import json, os, resource, sys, time
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per process, as in moetrain's workers
import datasets, numpy as np, pyarrow.compute as pc
from tokenizers import Tokenizer
datasets.disable_progress_bars()
inp, cache, tokenizer, eos, workers, ids_out = sys.argv[1:7]
eos, workers = int(eos), int(workers)
tok = Tokenizer.from_file(tokenizer)

def encode(batch):
    return {"input_ids": [e.ids + [eos] for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}

def cpu_seconds():  # this process and its finished workers
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

start = time.perf_counter()
ds = datasets.load_dataset("json", data_files=inp, split="train", cache_dir=cache)
loaded, cpu = time.perf_counter(), cpu_seconds()
out = ds.map(encode, batched=True, num_proc=workers, remove_columns=ds.column_names)
mapped, cpu = time.perf_counter(), cpu_seconds() - cpu
ids = pc.list_flatten(out.data.column("input_ids").combine_chunks()).to_numpy()
ids.astype(np.uint16).tofile(ids_out)
print(json.dumps({"load_seconds": loaded - start, "map_seconds": mapped - loaded, "map_cpu_seconds": cpu,
                  "tokens": int(len(ids))}))
"""


def make_corpus(mb: int) -> Path:
    """A jsonl of about ``mb`` MB from shakespeare's plays (cached)."""
    path = CACHE / f"shakespeare-{mb}mb.jsonl"
    if path.is_file():
        return path
    from moetrain.data import cached_corpus_files, fetch_corpus

    fetch_corpus("shakespeare")
    plays = [f.read_text(encoding="utf-8") for f in cached_corpus_files("shakespeare")]
    paragraphs = [p.strip() for play in plays for p in play.split("\n\n") if p.strip()]
    rng = random.Random(0)
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    written = 0
    with open(tmp, "w", encoding="utf-8") as f:
        while written < mb << 20:
            rng.shuffle(paragraphs)
            doc: list[str] = []
            for p in paragraphs:
                doc.append(p)
                if sum(map(len, doc)) >= 2000:
                    line = json.dumps({"text": "\n\n".join(doc)}) + "\n"
                    f.write(line)
                    written += len(line)
                    doc = []
    tmp.rename(path)
    return path


def make_tokenizer(corpus: Path) -> Path:
    folder = CACHE / "tokenizer-8192"
    path = folder / "tokenizer.json"
    if path.is_file():
        return path
    from moetrain.data.tokenizer import EOS_TOKEN, train_bpe

    texts, num_chars = [], 0
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            num_chars += len(texts[-1])
            if num_chars >= 8 << 20:
                break
    folder.mkdir(parents=True, exist_ok=True)
    train_bpe(texts, vocab_size=8192).save(path)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN}))
    return path


def run_child(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def shard_stream(out: Path) -> np.ndarray:
    from moetrain.data.tokens import open_token_file

    return np.concatenate([open_token_file(p)[0] for p in sorted(out.glob("shard-*.bin"))])


def moetrain_run(corpus: Path, tokenizer: Path, workers: int, tag: str) -> tuple[dict, Path]:
    out = CACHE / f"out-{tag}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    result = run_child(MOETRAIN_CHILD, str(corpus), str(out), str(tokenizer), str(workers))
    return {**result, "load": os.getloadavg()[0]}, out


def datasets_run(corpus: Path, tokenizer: Path, eos: int, workers: int) -> tuple[dict, Path]:
    cache, ids = CACHE / "hf-cache", CACHE / "hf-ids.bin"
    subprocess.run(["rm", "-rf", str(cache)], check=True)
    result = run_child(DATASETS_CHILD, str(corpus), str(cache), str(tokenizer), str(eos), str(workers), str(ids))
    subprocess.run(["rm", "-rf", str(cache)], check=True)
    return {**result, "load": os.getloadavg()[0]}, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    corpus = make_corpus(args.mb)
    small = make_corpus(max(1, args.mb // 10))
    tokenizer = make_tokenizer(corpus)
    from moetrain.data.tokenizer import PretrainedTokenizer

    eos = PretrainedTokenizer.from_file(tokenizer).eos_id
    mt_runs, hf_runs = [], []
    for i in range(args.repeats):
        mt, out = moetrain_run(corpus, tokenizer, args.workers, "full")
        hf, ids = datasets_run(corpus, tokenizer, eos, args.workers)
        if i == 0:  # the same ids, in the same order
            assert mt["tokens"] == hf["tokens"], (mt["tokens"], hf["tokens"])
            assert np.array_equal(shard_stream(out), np.fromfile(ids, dtype=np.uint16)), "ids differ"
        mt_runs.append(mt)
        hf_runs.append(hf)
        if not args.json:
            print(f"run {i}: moetrain {mt['seconds']:.1f} s (load {mt['load']:.1f}), datasets load "
                  f"{hf['load_seconds']:.1f} s + map {hf['map_seconds']:.1f} s (load {hf['load']:.1f})", flush=True)
    mt_small, _ = moetrain_run(small, tokenizer, args.workers, "small")
    tokens = mt_runs[0]["tokens"]
    per_core = tokens / args.workers
    mt_rate = statistics.median(per_core / r["seconds"] for r in mt_runs)
    hf_map = statistics.median(per_core / r["map_seconds"] for r in hf_runs)
    hf_e2e = statistics.median(per_core / (r["load_seconds"] + r["map_seconds"]) for r in hf_runs)
    mt_cpu = statistics.median(tokens / r["cpu_seconds"] for r in mt_runs)
    hf_cpu = statistics.median(tokens / r["map_cpu_seconds"] for r in hf_runs)
    mib = 1 << 20
    figures = {
        "corpus_mb": round(corpus.stat().st_size / mib, 1), "tokens": tokens, "workers": args.workers,
        "repeats": args.repeats,
        "moetrain_tokens_per_s_per_core": round(mt_rate), "datasets_tokens_per_s_per_core": round(hf_map),
        "ratio_vs_datasets": round(mt_rate / hf_map, 3),
        "datasets_end_to_end_tokens_per_s_per_core": round(hf_e2e),
        "ratio_vs_datasets_end_to_end": round(mt_rate / hf_e2e, 3),
        "moetrain_tokens_per_cpu_s": round(mt_cpu), "datasets_map_tokens_per_cpu_s": round(hf_cpu),
        "ratio_vs_datasets_cpu": round(mt_cpu / hf_cpu, 3),
        "load_average_median": round(statistics.median([r["load"] for r in mt_runs + hf_runs]), 2),
        "in_flight_bound_mb": 2 * args.workers * 1,
        "peak_main_over_floor_mb": round((mt_runs[0]["peak"] - mt_runs[0]["floor"]) / mib, 1),
        "peak_worker_mb": round(mt_runs[0]["worker_peak"] / mib, 1),
        "small_corpus_mb": round(small.stat().st_size / mib, 1),
        "small_peak_main_over_floor_mb": round((mt_small["peak"] - mt_small["floor"]) / mib, 1),
        "small_peak_worker_mb": round(mt_small["worker_peak"] / mib, 1),
        "floor_mb": round(mt_runs[0]["floor"] / mib, 1),
    }
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:45s} {value}")


if __name__ == "__main__":
    main()
