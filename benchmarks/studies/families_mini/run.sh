#!/usr/bin/env bash
# The `mini` rows of the three-family table (benchmarks/RESULTS.md#families-mini): the 4M-token
# point of the CPU gain curve fine-tuned on the embedded task of each family at its pretraining
# length (128 tokens), against random init, seeds 1-3.
# Part 1 is gain_curve_cpu/run.sh's pretraining (mini, AdamW 1e-3, the schedule of 1,953 steps:
# warm-up 195, linear decay to 0; seq-128 shards of the registry-prose corpus) stopped at its
# step-976 snapshot = 4.0M processed tokens, mid-decay (lr 5.6e-4), in fp32 (CONFIG: bf16 is
# emulated, several times slower, on CPUs without AVX-512 BF16 or AMX; give the bf16 config there).
# Part 2: QA and tagging at a fixed lr of 1e-3 for both arms (the rate --lr auto gave tiny's
# random arm on squad and its pretrained arm on entities; a 600-step QA fine-tuning of a `mini`
# takes ~18 minutes on one thread, so selecting a rate would triple the study); classification
# on 1,000 labels with --lr auto, as the gain curve was fine-tuned, and at 1e-3 for both arms.
# Each QA seed is its own call (two one-thread queues run side by side); merge_seeds.py joins
# them. Run again to resume.
#
#   bash benchmarks/studies/families_mini/run.sh [WORK] [PART]   # PART: 1, a, b or all (default)
set -euo pipefail
cd "$(dirname "$0")/../../.."
WORK=${1:-runs/gc8m}
PART=${2:-all}
CONFIG=${CONFIG:-ds_configs/cpu_mini_adamw_fp32.json}
PY=${PYTHON:-.venv/bin/python}
OUT=benchmarks/results/families
MODEL=$WORK/run/checkpoints/step_00000976
DATA=$WORK/corpus_seq128
mkdir -p "$OUT" "$WORK"
if [ "$PART" = all ] || [ "$PART" = 1 ]; then  # ~27 minutes on 2 cores of an AMD EPYC without AVX-512, fp32
    [ -f runs/corpus/corpus.txt ] || $PY -m data_prep corpus --output runs/corpus
    [ -f "$DATA/manifest.json" ] || $PY -m data_prep shards --input runs/corpus/corpus.txt --output "$DATA" \
        --seq-len 128 --no-nsp --masking dynamic --num-shards 2 --val-fraction 0.02
    $PY - "$CONFIG" "$WORK/ds_config.json" <<'PYEOF'
import json, sys
c = json.load(open(sys.argv[1]))
c["scheduler"]["params"].update(warmup_num_steps=195, total_num_steps=1953)
json.dump(c, open(sys.argv[2], "w"), indent=1)
PYEOF
    [ -d "$MODEL" ] || OMP_NUM_THREADS=2 "$(dirname "$PY")/deepspeed" --num_gpus 1 train.py \
        --deepspeed_config "$WORK/ds_config.json" --data "$DATA" --model mini --output-dir "$WORK/run" --seed 1 \
        --save-every 488 --keep-checkpoints 10 --eval-every 244 --max-steps 976
fi
finetune() {  # JSON, then bert-finetune's arguments
    local json=$OUT/$1; shift
    [ -f "$json" ] || OMP_NUM_THREADS=1 $PY -m commodity_bert.finetune --model "$MODEL" --random-init \
        --max-seq-len 128 --threads 1 --quiet --json "$json" "$@"
}
queue_a() {
    for seed in 1 2; do finetune mini4M_squad_seed$seed.json --task embedded:squad --lr 1e-3 --seeds $seed; done
    finetune mini4M_party_1000.json --task embedded:party --train-examples 1000 --seeds 1 2 3
    finetune mini4M_party_1000_lr1e-3.json --task embedded:party --train-examples 1000 --seeds 1 2 3 --lr 1e-3
}
queue_b() {
    finetune mini4M_entities.json --task embedded:entities --lr 1e-3 --seeds 1 2 3
    finetune mini4M_squad_seed3.json --task embedded:squad --lr 1e-3 --seeds 3
    finetune mini4M_polarity_1000.json --task embedded:polarity --train-examples 1000 --seeds 1 2 3
    finetune mini4M_polarity_1000_lr1e-3.json --task embedded:polarity --train-examples 1000 --seeds 1 2 3 --lr 1e-3
}
case $PART in
    a) queue_a ;;
    b) queue_b ;;
    1) ;;
    all) queue_a > "$WORK/queue_a.log" 2>&1 & queue_b > "$WORK/queue_b.log" 2>&1; wait ;;
esac
[ -f "$OUT/mini4M_squad_seed1.json" ] && [ -f "$OUT/mini4M_squad_seed2.json" ] && [ -f "$OUT/mini4M_squad_seed3.json" ] &&
    $PY benchmarks/studies/families_mini/merge_seeds.py "$OUT"/mini4M_squad_seed{1,2,3}.json --output "$OUT/mini4M_squad.json"
