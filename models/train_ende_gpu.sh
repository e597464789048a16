#!/usr/bin/env bash
# Recipe: ende-base continued on one GPU, its Seq-KD data and the blockwise heads.
#   bash models/train_ende_gpu.sh ar seqkd heads
# Stages run in the order given. DATA (default ../shared/data/ende) holds train.tsv / valid.tsv;
# everything is written under RUNS (default runs/gpu). Minutes per stage: AR_MIN, HD_MIN.
set -euo pipefail
DATA=${DATA:-../shared/data/ende}
RUNS=${RUNS:-runs/gpu}
PY=${PY:-python3}
AR_MIN=${AR_MIN:-4} HD_MIN=${HD_MIN:-1.2}
export PYTHONUNBUFFERED=1
mkdir -p "$RUNS"
for stage in "$@"; do
  case $stage in
  ar)
    $PY -m aggdec.train.ar --train "$DATA/train.tsv" --valid "$DATA/valid.tsv" --src-col en --tgt-col de \
      --init-from models/ende-base --out "$RUNS/ende-base" --device cuda --bf16 --max-tokens 16384 --lr 2e-3 \
      --max-minutes "$AR_MIN" --eval-minutes 0.5 --log-interval 200 --seed 3 ;;
  seqkd)
    $PY -m aggdec.train.seqkd --model "$RUNS/ende-base" --data "$DATA/train.tsv" --column en \
      --out "$RUNS/ende-kd.tsv" --device cuda --batch-size 512 ;;
  heads)
    $PY -m aggdec.train.heads --verifier "$RUNS/ende-base" --data "$RUNS/ende-kd.tsv" \
      --out "$RUNS/ende-base-heads" --block-size 8 --device cuda --bf16 --max-tokens 16384 --lr 1e-3 \
      --max-minutes "$HD_MIN" --log-interval 200 ;;
  *) echo "unknown stage $stage (ar | seqkd | heads)" >&2; exit 2 ;;
  esac
done
