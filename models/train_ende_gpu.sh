#!/usr/bin/env bash
# Recipe: ende-base continued on one GPU, its Seq-KD data, the GAD drafter and the blockwise heads.
#   bash models/train_ende_gpu.sh ar seqkd drafter heads drafter-more drafter-rounds
# Stages run in the order given. DATA (default ../shared/data/ende) holds train.tsv / valid.tsv;
# everything is written under RUNS (default runs/gpu). Minutes per stage: AR_MIN, DR_MIN, HD_MIN.
set -euo pipefail
DATA=${DATA:-../shared/data/ende}
RUNS=${RUNS:-runs/gpu}
PY=${PY:-python3}
AR_MIN=${AR_MIN:-4} DR_MIN=${DR_MIN:-4} DR2_MIN=${DR2_MIN:-5} HD_MIN=${HD_MIN:-1.2}
export PYTHONUNBUFFERED=1
mkdir -p "$RUNS"
continue_drafter() {  # lr, initial glancing ratio, minutes: train $RUNS/ende-base-drafter further
  $PY -m aggdec.train.drafter drafter --verifier "$RUNS/ende-base" --data "$RUNS/ende-kd.tsv" \
    --init-from "$RUNS/ende-base-drafter" --out "$RUNS/ende-base-drafter" --block-size 10 --device cuda --bf16 \
    --max-tokens 32768 --lr "$1" --glance "$2" --max-minutes "$3" --log-interval 200
}
for stage in "$@"; do
  case $stage in
  ar)
    $PY -m aggdec.train.ar --train "$DATA/train.tsv" --valid "$DATA/valid.tsv" --src-col en --tgt-col de \
      --init-from models/ende-base --out "$RUNS/ende-base" --device cuda --bf16 --max-tokens 16384 --lr 2e-3 \
      --max-minutes "$AR_MIN" --eval-minutes 0.5 --log-interval 200 --seed 3 ;;
  seqkd)
    $PY -m aggdec.train.seqkd --model "$RUNS/ende-base" --data "$DATA/train.tsv" --column en \
      --out "$RUNS/ende-kd.tsv" --device cuda --batch-size 512 ;;
  drafter)
    $PY -m aggdec.train.drafter drafter --verifier "$RUNS/ende-base" --data "$RUNS/ende-kd.tsv" \
      --out "$RUNS/ende-base-drafter" --block-size 10 --device cuda --bf16 --max-tokens 16384 --lr 1e-3 \
      --max-minutes "$DR_MIN" --log-interval 200 ;;
  drafter-more)  # continue the drafter with bigger batches and a weaker glancing start
    continue_drafter 1e-3 0.3 "$DR2_MIN" ;;
  drafter-rounds)  # session 4: three more continuations, lr and glancing lowered each round
    continue_drafter 1e-3 0.3 7.6
    continue_drafter 7e-4 0.2 4.5
    continue_drafter 5e-4 0.1 6.5 ;;
  heads)
    $PY -m aggdec.train.drafter heads --verifier "$RUNS/ende-base" --data "$RUNS/ende-kd.tsv" \
      --out "$RUNS/ende-base-heads" --block-size 8 --device cuda --bf16 --max-tokens 16384 --lr 1e-3 \
      --max-minutes "$HD_MIN" --log-interval 200 ;;
  *) echo "unknown stage $stage (ar | seqkd | drafter | drafter-more | drafter-rounds | heads)" >&2; exit 2 ;;
  esac
done
