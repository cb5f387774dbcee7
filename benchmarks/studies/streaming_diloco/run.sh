#!/usr/bin/env bash
# The DiLoCo int4 study, exploration on short runs: how DiLoCo's int4 pseudo-gradient should be
# rounded (nearest or stochastic) and whether error feedback helps, beside bf16 and LAMB, on
# the slow-links study's setting: mini, 300 steps of 64 sequences, 2 ranks on one machine, DiLoCo with plain
# averaging (outer lr 1, no momentum) at H = 50. Run again to resume. Figures: benchmarks/RESULTS.md.
#
#   bash benchmarks/studies/streaming_diloco/run.sh [WORK]        # default /tmp/streaming_diloco
set -euo pipefail
cd "$(dirname "$0")/../../.."
WORK=${1:-/tmp/streaming_diloco}
PY=${PYTHON:-.venv/bin/python}
S3=benchmarks/studies/slow_links
PY=$PY bash benchmarks/studies/sotu_seq128.sh "$WORK"
COMMON="--data $WORK/seq128 --model mini --ranks 2 --samples 19200 --eval-every 25 --seeds 1
        --train-args=--num-workers=1 --out $WORK/mini"
PLAIN="--vary commodity_bert.diloco.inner_steps=50 --vary commodity_bert.diloco.outer_lr=1.0
       --vary commodity_bert.diloco.outer_momentum=0.0"
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $PLAIN --vary commodity_bert.diloco.compression=bf16 $COMMON
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $PLAIN --vary commodity_bert.diloco.compression=int4 \
    --vary commodity_bert.diloco.rounding=nearest,stochastic --vary commodity_bert.diloco.error_feedback=false,true $COMMON
$PY -m commodity_bert.ablate --configs $S3/lamb.json $COMMON

# Second part: runs long enough for the schedules to matter (1,000 steps of 64 sequences), seed 1:
# LAMB against DiLoCo at H = 104 (≥ 400× fewer bytes than LAMB in int4), plain averaging, int4
# rounded to the nearest level with error feedback.
LONG="--data $WORK/seq128 --model mini --ranks 2 --samples 64000 --eval-every 100 --seeds 1
      --train-args=--num-workers=1 --out $WORK/mini_1000"
$PY -m commodity_bert.ablate --configs $S3/lamb.json $LONG
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json --vary commodity_bert.diloco.inner_steps=104 \
    --vary commodity_bert.diloco.outer_lr=1.0 --vary commodity_bert.diloco.outer_momentum=0.0 \
    --vary commodity_bert.diloco.compression=int4 --vary commodity_bert.diloco.error_feedback=true $LONG
# H = 112: at most 9 syncs in the 1,000 steps (the last step's included), ≥ 400× fewer bytes than LAMB
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json --vary commodity_bert.diloco.inner_steps=112 \
    --vary commodity_bert.diloco.outer_lr=1.0 --vary commodity_bert.diloco.outer_momentum=0.0 \
    --vary commodity_bert.diloco.compression=int4 --vary commodity_bert.diloco.error_feedback=true $LONG

# Third part: the chosen setting (H = 112, int4 nearest with feedback, plain averaging) and LAMB,
# second seed on 2 workers; then 4 workers (4 ranks on this machine, micro-batch 16: the same
# global batch of 64, as the slow-links study's third part).
SEED2=${LONG/--seeds 1/--seeds 1 2}
CHOSEN="--vary commodity_bert.diloco.inner_steps=112 --vary commodity_bert.diloco.outer_lr=1.0
        --vary commodity_bert.diloco.outer_momentum=0.0 --vary commodity_bert.diloco.compression=int4
        --vary commodity_bert.diloco.error_feedback=true"
$PY -m commodity_bert.ablate --configs $S3/lamb.json $SEED2
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $CHOSEN $SEED2
LONG4="--data $WORK/seq128 --model mini --ranks 4 --samples 64000 --eval-every 100 --seeds 1 2
       --train-args=--num-workers=1 --out $WORK/mini_1000_4ranks"
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json --vary train_micro_batch_size_per_gpu=16 $CHOSEN $LONG4
$PY -m commodity_bert.ablate --base $S3/lamb.json --vary train_micro_batch_size_per_gpu=16 $LONG4

# Fifth part (before the fourth, which fine-tunes its streamed model too), on 2 workers, seed 1:
# the chosen setting streamed (4 fragments, each overlapped with
# 5 inner steps, merge 0.5: bert-plan's streamed row), and the paper's outer step (lr 0.7,
# Nesterov momentum 0.9) in place of plain averaging at H = 112.
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $CHOSEN --vary commodity_bert.diloco.fragments=4 \
    --vary commodity_bert.diloco.overlap_steps=5 $LONG
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json --vary commodity_bert.diloco.inner_steps=112 \
    --vary commodity_bert.diloco.compression=int4 --vary commodity_bert.diloco.error_feedback=true $LONG

# Sixth part: AdamW as the inner optimizer (DiLoCo's inner optimizer may be LAMB or AdamW), 2
# workers, seed 1: the slow-links study's AdamW alone (lr 1e-3, betas 0.9/0.98, warmup a tenth of the run) and
# DiLoCo around it at the chosen setting (diloco_adamw.json).
$PY -m commodity_bert.ablate --configs $S3/adamw.json $LONG
$PY -m commodity_bert.ablate --configs benchmarks/studies/streaming_diloco/diloco_adamw.json $LONG

# Seventh part: a warm-up before the first round (the original DiLoCo
# starts from a synchronously trained model): the chosen setting after 100 data-parallel steps
# (the lr warm-up's length), 2 workers, seed 1.
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $CHOSEN --vary commodity_bert.diloco.warmup_steps=100 $LONG

# Fourth part: downstream. Each finished 1,000-step model of LAMB and of the chosen DiLoCo setting
# (2 and 4 workers, seeds 1 and 2; streamed, seed 1) is fine-tuned on both embedded tasks
# (lr chosen per arm on the held-out training slice from GRID, seeds SEEDS); the random-init arm,
# the same for every model, runs once beside LAMB seed 1.
SEEDS=${SEEDS:-1 2 3}
GRID=${GRID:-3e-4 1e-3}
H112=diloco_lamb__inner_steps=112__outer_lr=1.0__outer_momentum=0.0__compression=int4__error_feedback=true
DOWN=$WORK/downstream
mkdir -p "$DOWN"
W4=$WORK/mini_1000_4ranks/runs
for run in "$WORK/mini_1000/runs/lamb/seed_1" "$WORK/mini_1000/runs/$H112/seed_1" \
           "$WORK/mini_1000/runs/lamb/seed_2" "$WORK/mini_1000/runs/$H112/seed_2" \
           "$W4/lamb__train_micro_batch_size_per_gpu=16/seed_1" \
           "$W4/diloco_lamb__train_micro_batch_size_per_gpu=16__${H112#diloco_lamb__}/seed_1" \
           "$W4/lamb__train_micro_batch_size_per_gpu=16/seed_2" \
           "$W4/diloco_lamb__train_micro_batch_size_per_gpu=16__${H112#diloco_lamb__}/seed_2" \
           "$WORK/mini_1000/runs/${H112}__fragments=4__overlap_steps=5/seed_1"; do
    for task in party polarity; do
        [ -f "$run/summary.json" ] || continue
        name=$(basename "$(dirname "$run")")_$(basename "$run")
        random=$([ "$name" = lamb_seed_1 ] && echo --random-init || true)
        [ -f "$DOWN/${name}_$task.json" ] || $PY -m commodity_bert.finetune --model "$run" --task embedded:$task \
            $random --seeds $SEEDS --lr-grid $GRID --quiet --threads 1 --json "$DOWN/${name}_$task.json"
    done
done

# The one pair outside LAMB's spread (party, 4 workers, seed 2; each arm's lr chosen on its own
# held-out slice: 1e-3 for DiLoCo, 3e-4 for LAMB), fine-tuned again at the other arm's lr.
FIXED=$WORK/downstream_fixed_lr
mkdir -p "$FIXED"
[ -f "$FIXED/diloco_4w_seed_2_party_lr3e-4.json" ] || $PY -m commodity_bert.finetune \
    --model "$W4/diloco_lamb__train_micro_batch_size_per_gpu=16__${H112#diloco_lamb__}/seed_2" --task embedded:party \
    --seeds $SEEDS --lr 3e-4 --quiet --threads 1 --json "$FIXED/diloco_4w_seed_2_party_lr3e-4.json"
[ -f "$FIXED/lamb_4w_seed_2_party_lr1e-3.json" ] || $PY -m commodity_bert.finetune \
    --model "$W4/lamb__train_micro_batch_size_per_gpu=16/seed_2" --task embedded:party \
    --seeds $SEEDS --lr 1e-3 --quiet --threads 1 --json "$FIXED/lamb_4w_seed_2_party_lr1e-3.json"
