"""The JSON of benchmarks/gpu.sh: the CUDA tests (`make test-gpu`), the layer benchmark and the
training run of one GPU call, in one file.

    python benchmarks/gpu_report.py OUT RUN      # reads OUT/{device.txt, tests.xml, tests.rc,
                                                 # layer.jsonl} and RUN/metrics.jsonl, writes OUT/gpu.json

Every part is optional: a part that did not run (no pytest on the machine, a benchmark that
failed) is reported as missing, with the reason when there is one, and the rest is still written.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TRAIN_KEYS = ("step", "loss", "tokens_per_s", "mfu", "step_time_s")


def read_tests(xml_path: Path, rc_path: Path) -> dict:
    """pytest's exit code and per-test outcomes from its JUnit XML: ``{"exit_code", "counts",
    "cases": [{"name", "outcome", "time_s", "message"?}]}``. Exit code 5 means nothing ran (no
    ``cuda`` test selected: torch saw no GPU)."""
    exit_code = int(rc_path.read_text().strip()) if rc_path.exists() else None
    if not xml_path.exists():
        skipped = rc_path.parent / "tests.skipped"
        reason = skipped.read_text().strip() if skipped.exists() else "pytest wrote no report"
        return {"exit_code": exit_code, "missing": reason}
    cases = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (found.get("message") or found.text or "").strip()[:2000]
                break
        entry = {"name": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                 "time_s": float(case.get("time") or 0.0)}
        if message:
            entry["message"] = message
        cases.append(entry)
    counts = {outcome: sum(c["outcome"] == outcome for c in cases)
              for outcome in ("passed", "failed", "error", "skipped")}
    return {"exit_code": exit_code, "counts": counts, "cases": cases}


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def build_report(out: Path, run: Path) -> dict:
    layer = read_jsonl(out / "layer.jsonl")
    steps = read_jsonl(run / "metrics.jsonl")
    # The first window holds compilation and allocator warm-up: report the later ones.
    later = [m for m in steps if "tokens_per_s" in m][1:] or steps
    device = (out / "device.txt").read_text().strip() if (out / "device.txt").exists() else None
    return {"device": device,
            "tests": read_tests(out / "tests.xml", out / "tests.rc"),
            "layer": layer,
            "train": [{k: m[k] for k in TRAIN_KEYS if k in m} for m in later],
            "train_peak_memory": {k: v for k, v in steps[-1].items() if k.startswith("mem/")} if steps else {}}


def main(argv: list[str]) -> int:
    out, run = Path(argv[0]), Path(argv[1])
    report = build_report(out, run)
    (out / "gpu.json").write_text(json.dumps(report, indent=1))
    tests = report["tests"]
    print("tests:", json.dumps(tests.get("counts", tests.get("missing"))), "| exit code", tests["exit_code"])
    print("train:", json.dumps(report["train"][-1] if report["train"] else None))
    print(f"wrote {out / 'gpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
