#!/usr/bin/env bash
# Small-budget recipe choices judged downstream. Each FACTOR changes one
# thing against the gain curve's 8M-token `mini` (benchmarks/studies/gain_curve_cpu/run.sh: the
# same shards, schedule, seed and 62,496 sequences of 128 tokens; AdamW 1e-3, bf16, 1 rank x 32):
#   dropout0   no dropout while pretraining (Cramming; the export keeps 0.1 for fine-tuning)
#   mask25     25% of the tokens masked instead of 15% (Wettig et al. 2022)
#   mask40     40%
#   vocab8k    an 8,192-token WordPiece vocabulary trained on the same corpus instead of BERT's
#              30,522 (its own shards, the same 62,496 sequences of 128 tokens; random init is
#              fine-tuned beside it, since the vocabulary changes what random init sees too)
# The masking and dropout factors go through the config's "commodity_bert.pretraining" section,
# so the shards stay the same.
# Then party and polarity at 1,000 labels (the gain curve's largest leads), seeds 1-3, at a fixed
# lr 1e-3 so that the rate does not move with the model (the rate the 15% model's selection chose
# on party, and the best fixed rate on polarity); two one-thread queues. Compared with the gain
# curve's 8M model (results/gain_curve/cpu_mini_8M_{party,polarity}_1000*.json) and random init at
# the same rate (polarity's from the gain curve; party's run here once, FACTOR=random). ~22 min
# of pretraining + ~4 min of fine-tuning per factor on an Intel Xeon with AMX, 2 cores.
# LR=auto fine-tunes with the rate chosen per arm instead. Run again to resume; figures:
# benchmarks/RESULTS.md.
#
#   bash benchmarks/studies/small_budget/run.sh FACTOR [WORK]    # WORK: default runs/small_budget
set -euo pipefail
cd "$(dirname "$0")/../../.."
FACTOR=$1
LR=${LR:-1e-3}
WORK=${2:-runs/small_budget}/$FACTOR
PY=${PYTHON:-.venv/bin/python}
OUT=benchmarks/results/small_budget
DATA=${DATA:-runs/gc8m/corpus_seq128}  # the gain curve's shards (dynamic masks)
mkdir -p "$WORK" "$OUT"
[ -f "$DATA/manifest.json" ] || { echo "no shards at $DATA: run benchmarks/studies/gain_curve_cpu/run.sh first"; exit 2; }
if [ "$FACTOR" = random ]; then  # random init on party at the fixed rate, with the gain curve's vocabulary
    json=$OUT/random_init_party_1000_lr$LR.json
    [ -f "$json" ] || OMP_NUM_THREADS=1 $PY -m commodity_bert.finetune --model runs/gc8m/run/checkpoints/step_00001953 \
        --task embedded:party --train-examples 1000 --seeds 1 2 3 --lr "$LR" --random-init --threads 1 --quiet \
        --json "$json"
    exit
fi
$PY - "$FACTOR" "$WORK/ds_config.json" <<'PY'
import json, sys
factor, path = sys.argv[1:]
settings = {"dropout0": {"dropout": 0.0}, "mask25": {"mask_prob": 0.25}, "mask40": {"mask_prob": 0.40},
            "vocab8k": {}}
if factor not in settings:
    sys.exit(f"FACTOR {factor!r}: give one of {', '.join(settings)} or random")
c = json.load(open("ds_configs/cpu_mini_adamw_bf16.json"))
c["scheduler"]["params"].update(warmup_num_steps=195, total_num_steps=1953)
if settings[factor]:
    c.setdefault("commodity_bert", {})["pretraining"] = settings[factor]
json.dump(c, open(path, "w"), indent=1)
PY
RANDOM_ARM=()
if [ "$FACTOR" = vocab8k ]; then  # the gain curve's shard settings with a vocabulary of the corpus's own
    DATA=$WORK/corpus_seq128
    [ -f "$WORK/vocab.txt" ] || $PY -m data_prep vocab --input runs/corpus/corpus.txt --vocab-size 8192 \
        --output "$WORK/vocab.txt"
    [ -f "$DATA/manifest.json" ] || $PY -m data_prep shards --input runs/corpus/corpus.txt --vocab "$WORK/vocab.txt" \
        --output "$DATA" --seq-len 128 --no-nsp --masking dynamic --num-shards 2 --val-fraction 0.02
    RANDOM_ARM=(--random-init)
fi
[ -f "$WORK/run/summary.json" ] || OMP_NUM_THREADS=2 "$(dirname "$PY")/deepspeed" --num_gpus 1 train.py \
    --deepspeed_config "$WORK/ds_config.json" --data "$DATA" --model mini --output-dir "$WORK/run" --seed 1 \
    --save-every 1953 --eval-every 244
for task in party polarity; do
    json=$OUT/mini_8M_${FACTOR}_${task}_1000_lr$LR.json
    [ -f "$json" ] || OMP_NUM_THREADS=1 $PY -m commodity_bert.finetune --model "$WORK/run" --task embedded:$task \
        --train-examples 1000 --seeds 1 2 3 --lr "$LR" "${RANDOM_ARM[@]}" --threads 1 --quiet --json "$json" > "$WORK/ft_${task}_$LR.log" 2>&1 &
done
wait
