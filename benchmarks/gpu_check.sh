#!/usr/bin/env bash
# The device check, one run of at most 8 minutes on the lent GPU machine (its own python: torch 2.11,
# transformers 5.17; nothing installed, nothing downloaded). From the repository root:
#   device run: bash benchmarks/gpu_check.sh        (timeout_s 500)
# Writes $OUT/gpu_check.json (verify-cost curves and loop overhead on random 1B/8B Llamas in bf16)
# and $OUT/peers.json (the quick peers table on stories260K, benchmarks/experiments/peers.json).
set -uo pipefail
export PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
GPU_CHECK_SECONDS=300 timeout 330 python3 benchmarks/gpu_check.py
timeout 140 python3 -m benchmarks.run peers --quick --target stories260K --threads 8 --out "$OUT" || true
