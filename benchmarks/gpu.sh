#!/usr/bin/env bash
# The one prepared GPU call, under 10 minutes on one H100/H200. From the repository root:
#     MOETRAIN_CACHE=DIR bash benchmarks/gpu.sh     # writes ${OUT:-runs/gpu}/gpu.json
# (the training run's own directory: ${TRAIN_RUN:-runs/gpu-train}; the interpreter: ${PYTHON:-python3})
# 1. the CUDA tests (`make test-gpu`: pytest -m cuda tests/gpu), each test's outcome kept; a failing
#    test does not stop the measurements;
# 2. the MoE layer benchmark in bf16 at shapes A, B and M (Mixtral-like), each against dense GEMMs
#    of the same active FLOPs (benchmarks/moe_layer.py);
# 3. 40 training steps of the single-gpu config (~2.4B-parameter MoE, bf16, world 1 over NCCL),
#    whose tokens/s and MFU (the trainer's FLOP count over the datasheet peak) it reports.
# gpu.json holds all three (benchmarks/gpu_report.py), and is written even when a step fails.
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
RUN=${TRAIN_RUN:-runs/gpu-train}
mkdir -p "$OUT"
rm -f "$OUT"/{tests.xml,tests.rc,tests.skipped,tests.log,layer.jsonl,train.log,gpu.json}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Whatever happens from here on, gpu.json reports what ran.
trap '"$PY" benchmarks/gpu_report.py "$OUT" "$RUN"' EXIT
# The machine's own torch (with CUDA) runs the checkout; nothing is installed.
"$PY" -c "import torch, moetrain; assert torch.cuda.is_available(), 'torch sees no CUDA device'; \
print('device:', torch.cuda.get_device_name(), '| torch', torch.__version__)" | tee "$OUT/device.txt"

if "$PY" -c "import pytest" >/dev/null 2>&1; then
    set +e
    timeout -k 10 240 "$PY" -m pytest -q -rA -p no:cacheprovider -m cuda tests/gpu --junitxml="$OUT/tests.xml" 2>&1 \
        | tee "$OUT/tests.log"
    echo "${PIPESTATUS[0]}" > "$OUT/tests.rc"
    set -e
else
    echo "pytest is not installed for $PY: the CUDA tests did not run" | tee "$OUT/tests.skipped" >&2
fi

timeout -k 10 120 "$PY" benchmarks/moe_layer.py --device cuda --dtype bfloat16 --shapes A,B,M --runs 20 --warmup 5 --json \
    | tee "$OUT/layer.jsonl"

rm -rf "$RUN"
timeout -k 10 180 "$PY" -m moetrain.cli train --config single-gpu --nproc 1 --log.run_dir="$RUN" 2>&1 | tail -n 30 \
    | tee "$OUT/train.log"

if [[ -f "$OUT/tests.skipped" ]]; then  # pytest was missing: the CUDA tests did not run, a failure too
    echo "benchmarks/gpu.sh: the CUDA tests did not run (no pytest for $PY)" >&2
    exit 1
fi
tests_rc=$(cat "$OUT/tests.rc" 2>/dev/null || echo 0)
if [[ "$tests_rc" != 0 ]]; then
    echo "benchmarks/gpu.sh: the CUDA tests failed (pytest exit code $tests_rc; see $OUT/tests.log)" >&2
    exit 1
fi
