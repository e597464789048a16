#!/bin/bash
# gec-base on learner-like data, on one GPU: make the data (models/make_gec_data.py), then continue
# gec-base with aggdec.train.ar. DATA (default ../shared/data) holds gec/ and ende/; everything is
# written under RUNS (default runs/gpu). MIN: training minutes; COPIES: learner-error copies per sentence.
set -euo pipefail
DATA=${DATA:-../shared/data}
RUNS=${RUNS:-runs/gpu}
PY=${PY:-python3}
MIN=${MIN:-5.3} COPIES=${COPIES:-3} WORKERS=${WORKERS:-14}
export PYTHONUNBUFFERED=1
mkdir -p "$RUNS"
$PY models/make_gec_data.py --data "$DATA" --out "$RUNS/gec-data" --copies "$COPIES" --workers "$WORKERS"
$PY -m aggdec.train.ar --train "$RUNS/gec-data/train.tsv" --valid "$RUNS/gec-data/valid.tsv" --src-col noisy \
  --tgt-col clean --init-from models/gec-base --out "$RUNS/gec-base" --device cuda --bf16 --max-tokens 16384 \
  --lr 2e-3 --warmup 400 --max-minutes "$MIN" --eval-minutes 0.5 --log-interval 200 --seed 5
