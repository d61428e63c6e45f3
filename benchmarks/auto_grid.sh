#!/usr/bin/env bash
# The check-split grid of bench_auto.py (one cell per run, resumable: a cell whose result exists is skipped).
# Usage: [SPLIT=tuning OUT=DIR CORE=N TWIN=1 ONLY=GLOB] bash benchmarks/auto_grid.sh [PHASE...]   phases: b1 t07 b4 t10 b16 t07b4 t10b4 t07b16 t10b16 (default: all)
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SPLIT=${SPLIT:-check}  # tuning: even prompt lines, check: odd ones (bench_auto.py)
OUT=${OUT:-benchmarks/results/cache/auto-grid}  # one JSON per cell (ignored by git); merged at the end
run() {  # name, then bench_auto arguments
  local name=$1; shift
  [ -f "$OUT/$name.json" ] && return 0
  [[ "$name" == ${ONLY:-*} ]] || return 0  # (ONLY: the cells whose name matches, e.g. 'stories260K_*')
  echo "== $name: $*"
  OMP_NUM_THREADS=1 taskset -c "${CORE:-1}" "$PY" benchmarks/bench_auto.py "$@" ${TWIN:+--twin} --name "$name" --split "$SPLIT" \
    --results "$OUT" 2>&1 | grep -v "Loading\|^batch" | tail -3
}
cells() {  # temperature, batch, prompts for stories260K, prompts for demo-llama
  local t=$1 b=$2 ns=$3 nd=$4 tag="T${1}_b${2}"
  local eagle=benchmarks/adapters/stories260K-eagle
  [ "$t" != 0 ] && eagle=benchmarks/adapters/stories260K-eagle-T0.7
  run "stories260K_medusa_$tag" --target stories260K --mix stories --drafter medusa=benchmarks/adapters/stories260K-medusa --temperature "$t" --batch "$b" --prompts "$ns" --max-new-tokens 128
  run "stories260K_eagle_$tag" --target stories260K --mix stories --drafter eagle=$eagle --temperature "$t" --batch "$b" --prompts "$ns" --max-new-tokens 128
  run "stories260K_lookup_$tag" --target stories260K --mix stories --drafter lookup --temperature "$t" --batch "$b" --prompts "$ns" --max-new-tokens 128
  run "stories260K_hybrid_$tag" --target stories260K --mix stories --drafter medusa=benchmarks/adapters/stories260K-medusa+lookup --temperature "$t" --batch "$b" --prompts "$ns" --max-new-tokens 128
  for mix in code prose; do
    run "demo-llama_${mix}_lookup_$tag" --target demo-llama --mix $mix --drafter lookup --temperature "$t" --batch "$b" --prompts "$nd" --max-new-tokens 96
    run "demo-llama_${mix}_draft_$tag" --target demo-llama --mix $mix --drafter draft=benchmarks/targets/demo-draft --temperature "$t" --batch "$b" --prompts "$nd" --max-new-tokens 96
    for kind in medusa eagle; do
      [ -d "benchmarks/adapters/demo-llama-$kind" ] && run "demo-llama_${mix}_${kind}_$tag" --target demo-llama --mix $mix --drafter $kind=benchmarks/adapters/demo-llama-$kind --temperature "$t" --batch "$b" --prompts "$nd" --max-new-tokens 96
    done
    run "demo-draft_${mix}_lookup_$tag" --target demo-draft --mix $mix --drafter lookup --temperature "$t" --batch "$b" --prompts "$nd" --max-new-tokens 96
    for kind in medusa eagle; do
      [ -d "benchmarks/adapters/demo-draft-$kind" ] && run "demo-draft_${mix}_${kind}_$tag" --target demo-draft --mix $mix --drafter $kind=benchmarks/adapters/demo-draft-$kind --temperature "$t" --batch "$b" --prompts "$nd" --max-new-tokens 96
    done
  done
}
phases=${*:-b1 t07 b4 t10 b16 t07b4 t10b4 t07b16 t10b16}
for phase in $phases; do
  case $phase in
    b1) cells 0 1 12 8 ;;
    t07) cells 0.7 1 12 8 ;;
    b4) cells 0 4 16 16 ;;
    t10) cells 1.0 1 12 8 ;;
    b16) cells 0 16 32 32 ;;
    t07b4) cells 0.7 4 16 16 ;;
    t10b4) cells 1.0 4 16 16 ;;
    t07b16) cells 0.7 16 32 32 ;;
    t10b16) cells 1.0 16 32 32 ;;
  esac
done
"$PY" benchmarks/bench_auto.py --merge "$OUT"  # -> benchmarks/results/auto.json
