#!/usr/bin/env bash
# The device check, one run of at most 8 minutes on the lent GPU machine (its own python: torch 2.11,
# transformers 5.17; nothing installed, nothing downloaded). From the repository root:
#   device run: bash benchmarks/gpu_check.sh        (timeout_s 500)
# Writes $OUT/gpu_check.json (verify-cost curves and loop overhead on random 1B/8B Llamas in bf16)
# and $OUT/peers_gpu.json (the peers table on the shipped targets, reduced size).
set -uo pipefail
export PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
GPU_CHECK_SECONDS=300 timeout 330 python3 benchmarks/gpu_check.py
timeout 140 python3 benchmarks/bench_peers.py --prompts 3 --max-new-tokens 64 --threads 8 \
    --adapter medusa=stories260K:benchmarks/adapters/stories260K-medusa --out "$OUT/peers_gpu.json" || true
