#!/usr/bin/env bash
# One prepared check for a machine with a CUDA GPU: measures a few setups with the caching allocator's
# counters and prints measured vs estimated per phase. Record the table in docs/gpu_check.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
"$PY" -c "import torch, transformers; assert torch.cuda.is_available(), 'no CUDA device'" 
PYTHONPATH=. "$PY" -m pytest -q tests/test_measure_engine.py -k cuda
PYTHONPATH=. "$PY" bench/gpu_check.py
