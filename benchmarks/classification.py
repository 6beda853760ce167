"""The classification results table, per data set: a linear baseline (TF-IDF + linear SVM), the dense
model, the MoE model on 1 process and the MoE model with ep=2 on 2 processes; each trained row as the
mean and min of ``--seeds`` seeds (``train.seed`` 0, 1, ...).

    python benchmarks/classification.py --task thucnews          (about 3 x 3 x 20 min on 2 quiet cores)
    python benchmarks/classification.py --task r8 --json
    python benchmarks/classification.py --task r52 --only linear   (seconds)
    python benchmarks/classification.py --task thucnews --only moe --seeds 1 --steps 200   (a quick check)

The linear row reads the same train / validation / test splits as the runs (``load_splits`` with the
task's config), fits scikit-learn's TfidfVectorizer on the train split (character 1-2-grams with
sublinear tf for Chinese, which has no spaces; whitespace words with raw tf otherwise), trains LinearSVC
for each C in ``LINEAR_C`` on the train split and keeps the C with the best validation accuracy; the test
split is read once, by that model. It is deterministic, so it has no seeds.

Each trained row runs the exact command it prints (`moetrain train --config <shipped config> ...`, with
``--log.run_dir`` in a temporary folder), then `moetrain eval RUN` on its checkpoint, and reads:

* test_accuracy / test_macro_f1: the run's final evaluation over the whole test split (last record of
  metrics.jsonl), checked equal to what `moetrain eval` prints from the saved checkpoint;
* samples_per_s: training examples per second, the mean over the run's log windows (evaluation and
  checkpoint time excluded); wall_s: the whole command, data preparation and evaluation included;
* load_1m: the 1-minute load average (``os.getloadavg``) when the run ended: the machine is shared, and
  a load above the core count inflates wall_s.

* cpu_s: the CPU seconds of every process the row ran (user + system, evaluation included): the
  machine's load inflates wall_s but not this;
* best_val_*: the test figures of the checkpoint with the best validation accuracy (the earliest of
  equal ones), read by `moetrain eval RUN --checkpoint ...` where that is not the last step's; only
  for configs that keep their checkpoints (``checkpoint.keep_last: 0``).

The ``pretrained`` rows are the pretrain-then-classify route, each seed run whole: the language model
(``thucnews-pretrain`` / ``r8-pretrain``: the MoE encoder on the train split's texts), `moetrain export`,
then the classifier from that export with a fresh head (``thucnews-pretrained`` / ``r8-pretrained``);
wall_s and cpu_s count all three.

The dense configs have the same active parameters per token as the MoE ones (dense hidden dim =
top_k * expert hidden dim) and train the same steps on the same batches. R52 and 20 Newsgroups run the
R8 configs with the corpus and class count overridden.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINEAR_C = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)


def _reuters_like(corpus: str, num_classes: int) -> dict[str, tuple[str, int, tuple[str, ...]]]:
    extra = (f"--data.corpus={corpus}", f"--model.num_classes={num_classes}")
    return {"dense": ("r8-dense", 1, extra), "moe": ("r8", 1, extra), "moe_ep2": ("r8-ep2", 2, extra)}


ROWS = {  # task -> trained row name -> (shipped config, processes, overrides)
    "thucnews": {"dense": ("thucnews-dense", 1, ()), "moe": ("thucnews", 1, ()), "moe_ep2": ("thucnews-ep2", 2, ()),
                 "pretrained": ("thucnews-pretrained", 1, ())},
    "r8": {"dense": ("r8-dense", 1, ()), "moe": ("r8", 1, ()), "moe_ep2": ("r8-ep2", 2, ()),
           "pretrained": ("r8-pretrained", 1, ())},
    "r52": _reuters_like("r52", 52),
    "20newsgroups": _reuters_like("20newsgroups", 20),
}


PRETRAIN = {"thucnews-pretrained": "thucnews-pretrain", "r8-pretrained": "r8-pretrain"}
"""A classifier config that starts from an export -> the language-model config whose run it exports."""


def linear_row(task: str) -> dict:
    """TF-IDF + LinearSVC on the task's splits, C picked on the validation split."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.metrics import accuracy_score, f1_score
    from sklearn.svm import LinearSVC

    from moetrain.config.loader import load_config
    from moetrain.data.labelled import load_splits

    config, _, overrides = ROWS[task]["moe"]
    cfg = load_config(config, overrides)
    t0, cpu0 = time.perf_counter(), time.process_time()
    splits = load_splits(cfg.data, cfg.classify)
    chinese = task == "thucnews"
    vectorizer = TfidfVectorizer(analyzer="char" if chinese else "word", ngram_range=(1, 2) if chinese else (1, 1),
                                 sublinear_tf=chinese)
    x_train = vectorizer.fit_transform(splits.train.texts)
    x_val, x_test = vectorizer.transform(splits.val.texts), vectorizer.transform(splits.test.texts)
    y_train, y_val, y_test = (splits.label_ids(s) for s in ("train", "val", "test"))
    fits = [(accuracy_score(y_val, m.predict(x_val)), c, m)
            for c in LINEAR_C for m in [LinearSVC(C=c, max_iter=5000, random_state=0).fit(x_train, y_train)]]
    val_accuracy, c, model = max(fits, key=lambda f: f[0])  # the first of equal ones: the smaller C
    predicted = model.predict(x_test)
    features = "char 1-2-gram TF-IDF (sublinear tf)" if chinese else "word TF-IDF"
    return {"command": f"{features} + LinearSVC, C={c} (picked on validation from {list(LINEAR_C)})",
            "seeds": 1, "test_accuracy": float(accuracy_score(y_test, predicted)),
            "test_macro_f1": float(f1_score(y_test, predicted, average="macro")), "val_accuracy": float(val_accuracy),
            "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0, "load_1m": os.getloadavg()[0],
            "eval_matches": True}


def _records(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _moetrain(*args: str, capture: bool = False) -> str:
    done = subprocess.run([sys.executable, "-m", "moetrain.cli", *args], check=True, cwd=ROOT, text=True,
                          stdout=subprocess.PIPE if capture else subprocess.DEVNULL)
    return done.stdout or ""


def _train(config: str, nproc: int, run_dir: Path, extra: list[str]) -> str:
    """Train ``config`` into ``run_dir`` (after its language model and export for a pretrained config);
    the commands as shown."""
    procs = ["--nproc", str(nproc)] if nproc > 1 else []
    shown = [" ".join(["moetrain", "train", "--config", config, *extra, *procs])]
    if config in PRETRAIN:
        lm_dir = run_dir.parent / f"{run_dir.name}-pretrain"
        _moetrain("train", "--config", PRETRAIN[config], *extra, f"--log.run_dir={lm_dir}")
        _moetrain("export", str(lm_dir), "--to", str(lm_dir / "export"))
        shown = [" ".join(["moetrain", "train", "--config", PRETRAIN[config], *extra]),
                 "moetrain export LM --to EXPORT", f"{shown[0]} --checkpoint.init_from=EXPORT"]
        extra = [*extra, f"--checkpoint.init_from={lm_dir / 'export'}"]
    _moetrain("train", "--config", config, *extra, *procs, f"--log.run_dir={run_dir}")
    return "; ".join(shown)


def _best_on_val(run_dir: Path, records: list[dict]) -> dict:
    """The test figures of the kept checkpoint with the best validation accuracy (empty if not kept)."""
    evals = [r for r in records if "val_accuracy" in r]
    best = max(evals, key=lambda r: r["val_accuracy"])  # max keeps the first of equal ones: the earliest
    if best is evals[-1]:
        return {"best_val_step": best["step"], "best_val_test_accuracy": best["test_accuracy"],
                "best_val_test_macro_f1": best["test_macro_f1"]}
    checkpoint = run_dir / "checkpoints" / f"step_{best['step']:09d}"
    if not checkpoint.is_dir():
        return {}
    _moetrain("eval", str(run_dir), "--checkpoint", str(checkpoint), "--split", "test", capture=True)
    with open(run_dir / f"eval-test-step{best['step']}.json") as f:
        result = json.load(f)
    return {"best_val_step": best["step"], "best_val_test_accuracy": result["test_accuracy"],
            "best_val_test_macro_f1": result["test_macro_f1"]}


def run_row(config: str, nproc: int, run_dir: Path, extra: list[str]) -> dict:
    """Train one row's config and evaluate its checkpoint; the row's figures."""
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    shown = _train(config, nproc, run_dir, extra)
    wall = time.perf_counter() - t0
    load = os.getloadavg()[0]
    records = _records(run_dir)
    final = records[-1]
    rates = [r["samples_per_s"] for r in records if "samples_per_s" in r]
    evaluated = _moetrain("eval", str(run_dir), capture=True)
    printed = f"test accuracy {final['test_accuracy']:.4f}"
    return {"command": shown, "steps": final["step"], "test_accuracy": final["test_accuracy"],
            "test_macro_f1": final["test_macro_f1"], "val_accuracy": final["val_accuracy"],
            "samples_per_s": sum(rates) / len(rates), "wall_s": wall, "load_1m": load,
            **_best_on_val(run_dir, records), "cpu_s": _children_cpu_s() - cpu0,
            "eval_matches": printed in evaluated}


def seeded_rows(config: str, nproc: int, overrides: tuple[str, ...], folder: Path, extra: list[str],
                num_seeds: int, first_seed: int = 0) -> dict:
    """One trained row over ``num_seeds`` seeds from ``first_seed``: the mean and min of each figure,
    and each seed's."""
    seeds = range(first_seed, first_seed + num_seeds)
    runs = [run_row(config, nproc, folder / f"seed{seed}", [*overrides, f"--train.seed={seed}", *extra])
            for seed in seeds]
    row = {"command": runs[0]["command"].replace(f"--train.seed={first_seed}", "--train.seed=S"),
           "seeds": num_seeds, "first_seed": first_seed,
           "steps": runs[0]["steps"], "eval_matches": all(r["eval_matches"] for r in runs)}
    for key in ("test_accuracy", "test_macro_f1", "val_accuracy", "samples_per_s", "wall_s", "cpu_s",
                "best_val_test_accuracy", "best_val_test_macro_f1"):
        values = [r[key] for r in runs if key in r]
        if len(values) < len(runs):
            continue
        row[key], row[f"{key}_min"], row[f"{key}_per_seed"] = statistics.fmean(values), min(values), values
    row["load_1m"] = max(r["load_1m"] for r in runs)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=sorted(ROWS), default="thucnews")
    p.add_argument("--only", default=None, help="comma-separated rows: linear, " + ", ".join(ROWS["thucnews"]))
    p.add_argument("--seeds", type=int, default=3, help="seeds per trained row (mean and min reported)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="the first seed (seeds first..first+seeds-1): one seed per command, several at once")
    p.add_argument("--steps", type=int, default=None, help="override train.steps (quick checks)")
    p.add_argument("--json", action="store_true", help="print one JSON object per row")
    args = p.parse_args()
    rows = ROWS[args.task]
    names = args.only.split(",") if args.only else ["linear", *rows]
    unknown = sorted(set(names) - {"linear", *rows})
    if unknown:
        p.error(f"--only: unknown rows {unknown}; choose from linear, {', '.join(rows)}")
    extra = [f"--train.steps={args.steps}"] if args.steps else []
    results = {}
    with tempfile.TemporaryDirectory(prefix="moetrain-classify-") as tmp:
        for name in names:
            if name == "linear":
                results[name] = linear_row(args.task)
            else:
                config, nproc, overrides = rows[name]
                results[name] = seeded_rows(config, nproc, overrides, Path(tmp) / name, extra, args.seeds,
                                            args.first_seed)
            if args.json:
                print(json.dumps({"task": args.task, "row": name, **results[name]}), flush=True)
    if not args.json:
        print(f"| {args.task} | seeds | test accuracy mean (min) | macro-F1 mean (min) | wall s | CPU s | command |")
        print("|---|---|---|---|---|---|---|")
        for name, r in results.items():
            acc = f"{r['test_accuracy']:.4f}" + (f" ({r['test_accuracy_min']:.4f})" if r["seeds"] > 1 else "")
            f1 = f"{r['test_macro_f1']:.4f}" + (f" ({r['test_macro_f1_min']:.4f})" if r["seeds"] > 1 else "")
            cpu = f"{r['cpu_s']:.0f}" if "cpu_s" in r else "-"
            print(f"| {name} | {r['seeds']} | {acc} | {f1} | {r['wall_s']:.0f} | {cpu} | `{r['command']}` |")
    if not all(r["eval_matches"] for r in results.values()):
        print("moetrain eval printed another test accuracy than a run's final evaluation", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
