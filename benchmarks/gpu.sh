#!/usr/bin/env bash
# The one prepared GPU measurement, under 10 minutes on one H100/H200. From the repository root:
#     MOETRAIN_CACHE=DIR bash benchmarks/gpu.sh     # writes ${OUT:-runs/gpu}/gpu.json
# 1. the MoE layer benchmark in bf16 at shapes A, B and M (Mixtral-like), each against dense GEMMs
#    of the same active FLOPs (benchmarks/moe_layer.py);
# 2. 40 training steps of the single-gpu config (~2.4B-parameter MoE, bf16, world 1 over NCCL),
#    whose tokens/s and MFU (the trainer's FLOP count over the datasheet peak) it reports.
# GPU machines have no network: DIR must hold the cached corpus and tokenizer, made where there is
# one with `MOETRAIN_CACHE=DIR moetrain data fetch shakespeare` and one CPU step of the same
# data settings. Without a CUDA device it stops at once, before importing anything.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "benchmarks/gpu.sh: no CUDA device here (nvidia-smi lists no GPU). This script measures on a" \
         "GPU only; on a CPU run python benchmarks/moe_layer.py instead." >&2
    exit 2
fi
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The machine's own torch (with CUDA) runs the checkout; nothing is installed.
"$PY" -c "import torch, moetrain; assert torch.cuda.is_available(), 'torch sees no CUDA device'; \
print('device:', torch.cuda.get_device_name(), '| torch', torch.__version__)" | tee "$OUT/device.txt"

"$PY" benchmarks/moe_layer.py --device cuda --dtype bfloat16 --shapes A,B,M --runs 20 --warmup 5 --json \
    | tee "$OUT/layer.jsonl"

RUN=runs/gpu-train
rm -rf "$RUN"
"$PY" -m moetrain.cli train --config single-gpu --nproc 1 --log.run_dir="$RUN" 2>&1 | tail -n 30 \
    | tee "$OUT/train.log"

"$PY" - "$OUT" "$RUN" <<'PYEOF'
import json, pathlib, sys
out, run = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
layer = [json.loads(line) for line in (out / "layer.jsonl").read_text().splitlines() if line.startswith("{")]
steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
# The first window holds compilation and allocator warm-up: report the later ones.
later = [m for m in steps if "tokens_per_s" in m][1:] or steps
keys = ("step", "loss", "tokens_per_s", "mfu", "step_time_s")
result = {"device": (out / "device.txt").read_text().strip(), "layer": layer,
          "train": [{k: m[k] for k in keys if k in m} for m in later],
          "train_peak_memory": {k: v for k, v in steps[-1].items() if k.startswith("mem/")}}
(out / "gpu.json").write_text(json.dumps(result, indent=1))
print(json.dumps(result["train"][-1]))
PYEOF
echo "wrote $OUT/gpu.json"
