"""`moetrain compare`: final figures against the runs' metrics.jsonl, config differences, runs of
different lengths, a dense run (no load metrics) and a run without evaluation.

The slow test compares three short real training runs; the fast ones hand-written jsonl files.
"""

import json
import random
from pathlib import Path

import pytest
import yaml

from moetrain.cli import main
from moetrain.train.compare import MISSING, compare_runs, config_differences, load_run
from tests.helpers.dist_launcher import run_ranks


def write_run(folder: Path, records: list[dict], config: dict | None) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder


def jsonl(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


def last(records: list[dict], key: str):
    """The last logged value of ``key``, per-layer lists averaged (the rule of the table)."""
    values = [r[key] for r in records if r.get(key) is not None]
    if not values:
        return None
    value = values[-1]
    return sum(value) / len(value) if isinstance(value, list) else value


def table_rows(md: str, heading: str) -> dict[str, list[str]]:
    """First cell -> the other cells of the table under ``## heading``."""
    section = md.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split(" | ") for line in section.splitlines() if line.startswith("| ")]
    return {row[0].strip(): [c.strip() for c in row[1:]] for row in rows[1:]}


def test_synthetic_runs_table_differences_and_missing_values(tmp_path):
    moe = write_run(tmp_path / "moe", [
        {"step": 1, "loss": 5.0, "load_cv": [0.5, 0.7], "dropped_fraction": [0.0, 0.1], "tokens_per_s": 100.0},
        {"step": 2, "event": "world_size_changed"},
        {"step": 2, "loss": 4.0, "load_cv": [0.3, 0.5], "dropped_fraction": [0.0, 0.2], "tokens_per_s": 120.0,
         "val_loss": 4.5},
    ], {"moe": {"router": "softmax", "top_k": 2}, "log": {"run_dir": "runs/a"},
        "data": {"sources": [{"path": "a|b", "weight": 1.0}]}})
    dense = write_run(tmp_path / "dense", [{"step": 3, "loss": 3.5, "tokens_per_s": 200.0}],
                      {"moe": {"router": "sigmoid", "top_k": 2}, "log": {"run_dir": "runs/b"}})
    no_config = write_run(tmp_path / "old", [{"step": 1, "loss": 6.0}], None)
    files = compare_runs([moe, dense, no_config], tmp_path / "out")
    assert [f.name for f in files[:2]] == ["summary.md", "summary.json"]
    assert {f.name for f in files[2:]} == {"loss.png", "val_loss.png", "load_cv.png", "dropped_fraction.png",
                                           "tokens_per_s.png"}
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["final"] == {"loss": [4.0, 3.5, 6.0], "val_loss": [4.5, None, None],
                                "load_cv": [pytest.approx(0.4), None, None],
                                "dropped_fraction": [pytest.approx(0.1), None, None],
                                "tokens_per_s": [120.0, 200.0, None]}
    assert summary["config_differences"] == {
        "data.sources": [[{"path": "a|b", "weight": 1.0}], MISSING, MISSING],
        "moe.router": ["softmax", "sigmoid", MISSING], "moe.top_k": [2, 2, MISSING]}
    md = (tmp_path / "out" / "summary.md").read_text()
    finals = table_rows(md, "Final figures")
    assert finals["val loss (`val_loss`)"] == ["4.5", MISSING, MISSING]
    assert finals["load CV (std / mean), mean over MoE layers (`load_cv`)"] == ["0.4", MISSING, MISSING]
    differences = table_rows(md, "Config fields that differ")
    assert differences["`moe.router`"] == ["softmax", "sigmoid", MISSING]
    assert differences["`data.sources`"][0] == '[{"path": "a\\|b", "weight": 1.0}]'  # pipe escaped
    assert "(no config.yaml)" in md and "log.run_dir" not in differences


def test_summary_json_is_standard_json_with_null_for_non_finite_values(tmp_path):
    a = write_run(tmp_path / "a", [{"step": 1, "loss": 2.0, "tokens_per_s": 10.0},
                                   {"step": 2, "loss": float("nan"), "tokens_per_s": float("inf")}], None)
    b = write_run(tmp_path / "b", [{"step": 2, "loss": 1.5, "tokens_per_s": 20.0}], None)
    compare_runs([a, b], tmp_path / "out")

    def refuse(constant):
        raise ValueError(f"{constant} is not standard JSON")

    summary = json.loads((tmp_path / "out" / "summary.json").read_text(), parse_constant=refuse)
    assert summary["final"] == {"loss": [None, 1.5], "tokens_per_s": [None, 20.0]}


def test_compare_needs_two_runs_with_metrics(tmp_path, capsys):
    run = write_run(tmp_path / "a", [{"step": 1, "loss": 1.0}], {})
    with pytest.raises(ValueError, match="at least two runs"):
        compare_runs([run], tmp_path / "out")
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(run), str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
    same_name = write_run(tmp_path / "x" / "a", [{"step": 1, "loss": 2.0}], {})
    assert [r.name for r in map(load_run, [run, same_name], ["a", "b"])] == ["a", "b"]
    compare_runs([run, same_name], tmp_path / "out")
    md = (tmp_path / "out" / "summary.md").read_text()
    assert f"| {run} | " in md and f"| {same_name} | " in md  # same folder names: the paths tell them apart
    assert config_differences([load_run(run, "a"), load_run(same_name, "b")]) == {}


def _text_folder(root: Path) -> Path:
    rng = random.Random(0)
    words = ["thou", "art", "the", "king", "queen", "night", "love", "sword", "hence", "good", "lord"]
    root.mkdir()
    for i in range(4):
        (root / f"{i}.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(12))
                                                 for _ in range(300)))
    return root


def _train(rank: int, world_size: int, run_dir: Path, data: Path, *overrides: str) -> None:
    """One short run (called through ``run_ranks``: a forked one-rank process, so this pytest
    process never touches gloo and later tests can still fork ranks)."""
    from moetrain.config.loader import load_config
    from moetrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, [
        "--model.dim=32", "--model.num_layers=2", "--model.num_heads=2", "--model.max_seq_len=32",
        "--moe.num_experts=4", "--moe.top_k=1", "--moe.expert_hidden_dim=32",
        "--data.corpus=path", f"--data.path={data}", "--data.tokenizer=bytes", "--data.seq_len=32",
        "--data.val_fraction=0.1", "--train.global_batch_size=4", "--train.micro_batch_size=4",
        "--train.device=cpu", "--train.eval_steps=2", "--checkpoint.every=0", "--checkpoint.save_final=false",
        f"--log.run_dir={run_dir}", "--log.every=1", "--log.progress_bar=false", "--log.tensorboard=false",
        *overrides]))
    try:
        trainer.fit()
    finally:
        trainer.close()


@pytest.mark.slow
def test_three_real_runs_side_by_side(tmp_path, capsys):
    data = _text_folder(tmp_path / "text")
    runs = [tmp_path / "softmax", tmp_path / "sigmoid", tmp_path / "dense"]
    run_ranks(_train, 1, runs[0], data, "--train.steps=6", "--train.eval_every=3", timeout_s=120)
    run_ranks(_train, 1, runs[1], data, "--train.steps=4", "--train.eval_every=0", "--moe.router=sigmoid",
              timeout_s=120)
    run_ranks(_train, 1, runs[2], data, "--train.steps=3", "--train.eval_every=3", "--model.moe_every=0",
              timeout_s=120)
    out = tmp_path / "cmp"
    assert main(["compare", *map(str, runs), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[0] == str(out / "summary.md") and str(out / "load_cv.png") in printed

    summary = json.loads((out / "summary.json").read_text())
    records = [jsonl(r) for r in runs]
    for key in ("loss", "val_loss", "load_cv", "load_max_over_mean", "dropped_fraction", "tokens_per_s"):
        assert summary["final"][key] == pytest.approx([last(r, key) for r in records]), key
    assert summary["final"]["val_loss"][1] is None  # no evaluation
    assert summary["final"]["load_cv"][2] is None  # dense: no routing
    assert [r["last_step"] for r in summary["runs"]] == [6, 4, 3]
    differences = summary["config_differences"]
    assert differences["moe.router"] == ["softmax", "sigmoid", "softmax"]
    assert differences["model.moe_every"] == [1, 1, 0] and differences["train.steps"] == [6, 4, 3]
    assert "model.dim" not in differences and "log.run_dir" not in differences

    finals = table_rows((out / "summary.md").read_text(), "Final figures")
    assert finals["train loss (`loss`)"] == [f"{last(r, 'loss'):.6g}" for r in records]
    assert finals["val loss (`val_loss`)"][1] == MISSING
