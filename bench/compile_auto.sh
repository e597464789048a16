#!/usr/bin/env bash
# `compile = "auto"` after `--compile true` runs, per method, as a user meets it (docs/benchmarks.md,
# "Compiled steps, stored through torch's public APIs"): a `--compile true` run first (it builds the
# programs), then the default, `--compile false` and `--compile true`, twice in turn, each a fresh
# `aggdec decode` process; prints each run's sentences/s, an md5 of its output and the line auto printed.
# Usage: bench/compile_auto.sh EN_TXT GEC_TXT [BATCH_SIZE] [METHODS...]   (AGGDEC_CACHE_DIR: the store)
set -u
cd "$(dirname "$0")/.."
en=$1 gec=$2 bs=${3:-1}
shift $(( $# < 3 ? $# : 3 ))
work=$(mktemp -d)
run() {  # name model input options...
  local name=$1 model=$2 input=$3; shift 3
  aggdec decode -m "$model" --batch-size "$bs" --compile true "$@" < "$input" > /dev/null 2> "$work/build.err"
  for rep in 1 2; do
    for c in auto false true; do
      aggdec decode -m "$model" --batch-size "$bs" --compile $c "$@" < "$input" > "$work/out" 2> "$work/err"
      rate=$(grep -o "[0-9]* sentences in [0-9.]*s ([0-9.]*/s)" "$work/err" | tail -1)
      echo "$name batch $bs run $rep compile=$c: $rate | md5 $(md5sum < "$work/out" | cut -c1-8) | $(grep "compile=auto" "$work/err" | head -1)"
    done
  done
}
for m in ${@:-greedy iad gad gad++ blockwise double}; do
  case $m in
  greedy) run greedy models/ende-base "$en" --method greedy ;;
  iad) run iad models/gec-base "$gec" --method iad ;;
  gad) run gad models/ende-base "$en" --method gad --drafter models/ende-base-draft-head --block-size 4 ;;
  gad++) run gad++ models/ende-base "$en" --method gad++ --drafter models/ende-base-draft-head --top-beta 3 --tau 1 ;;
  blockwise) run blockwise models/ende-base "$en" --method blockwise --drafter models/ende-base-heads ;;
  double) run double-token models/ende-base-double-token "$en" --method greedy ;;
  esac
done
rm -rf "$work"
