#!/usr/bin/env bash
# One prepared GPU measurement: the MoE layer benchmark in bf16 on CUDA for shapes A, B and
# M (Mixtral-like), printing one JSON object per shape. Run from the repository root:
#     bash benchmarks/gpu.sh
# It installs the package into a fresh venv only if moetrain is not importable already.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import moetrain" 2>/dev/null; then
    "$PY" -m pip install -q -e . >/dev/null
fi
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('device:', torch.cuda.get_device_name())"
"$PY" benchmarks/moe_layer.py --device cuda --dtype bfloat16 --shapes A,B,M --runs 20 --warmup 5 --json
