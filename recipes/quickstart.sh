#!/usr/bin/env bash
# CPU quickstart, end to end on the embedded corpus (233 State of the Union addresses, public
# domain): set up .venv → WordPiece vocabulary → stratified shards → 2-rank training with
# DeepSpeed's launcher (validation accuracy printed as it rises) → Hugging Face export → the
# accuracy beside the most-frequent-token baseline and fill-mask probes chosen before training.
# From a fresh clone with a warm pip cache: 388 s on 2 Zen 4 cores (bf16), 852 s on 2 EPYC cores without
# AVX-512 (fp32; docs/quickstart.md). Re-running resumes / skips finished parts.
#   DATA_ROOT (default data/quickstart), RUN (default runs/quickstart), STEPS (default 1000),
#   RANKS (default 2), CONFIG (default: the bf16 config where the CPU has AVX-512 BF16, else fp32),
#   DOWNSTREAM (default 1; 0: no fine-tuning at the end), DOWNSTREAM_SEEDS (default "1": each seed
#   adds ~100 s per arm; the spread between seeds is several points, recipes/evaluate.sh runs 5),
#   DOWNSTREAM_LR (default 1e-3 for both arms; auto: each arm chooses its rate from
#   DOWNSTREAM_LR_GRID, default "3e-4 1e-3", two more runs per arm, ~2 minutes on a Zen 4 core pair)
set -euo pipefail
cd "$(dirname "$0")/.."
bash recipes/setup_env.sh
VENV=${VENV:-.venv}
PY=$VENV/bin/python
DATA_ROOT=${DATA_ROOT:-data/quickstart}
RUN=${RUN:-runs/quickstart}
STEPS=${STEPS:-1000}
# bf16 trains ~1.4x faster where the CPU has AVX-512 BF16 (benchmarks/RESULTS.md); elsewhere
# bf16 is emulated and slower than fp32
if grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null; then PRECISION=bf16; else PRECISION=fp32; fi
CONFIG=${CONFIG:-ds_configs/cpu_quickstart_lamb_$PRECISION.json}
mkdir -p "$DATA_ROOT"
# a small vocabulary trained on the corpus: a tiny model learns it faster than BERT's 30k
[ -f "$DATA_ROOT/vocab.txt" ] || $PY -m data_prep vocab --input embedded:sotu --vocab-size 8192 \
    --output "$DATA_ROOT/vocab.txt"
# seq 64 without NSP: at this budget a model learns words in their sentence, and shorter
# samples make more steps of it
$PY -m data_prep shards --input embedded:sotu --vocab "$DATA_ROOT/vocab.txt" --output "$DATA_ROOT/seq64" \
    --seq-len 64 --no-nsp --masking static --dupe-factor 1 --num-shards 4 --val-fraction 0.05
$PY -m data_prep inspect "$DATA_ROOT/seq64" --verify | tail -n 1
echo "training: $CONFIG ($PRECISION), $STEPS steps on ${RANKS:-2} ranks"
# two local ranks: DeepSpeed's --num_gpus is the number of processes on a CPU machine (a
# hostfile, even one naming localhost, makes the launcher ssh into each host)
"$VENV/bin/deepspeed" --num_gpus "${RANKS:-2}" train.py --deepspeed_config "$CONFIG" \
    --data "$DATA_ROOT/seq64" --model tiny --output-dir "$RUN" --max-steps "$STEPS" \
    --log-every 100 --eval-every 200 --save-every 200 --num-workers 1 2>&1 \
    | grep --line-buffered -E '^(step|done|stopping|warning|left the)|error|Error'
$PY recipes/quickstart_report.py "$RUN" "$DATA_ROOT/seq64"
# what it does downstream: the embedded polarity task, beside the same model fine-tuned from
# random weights, a bag-of-words baseline and a linear probe on the frozen features
# (docs/evaluation.md, "Is my BERT any good?"). Both arms at lr 1e-3: bert-finetune --lr auto chose it for random init
# in every measured selection on this task and for the pretrained tiny in 3 of 5 (at 3e-5 and
# 1e-4 tiny predicts the majority class in both arms; benchmarks/RESULTS.md), and choosing again
# (DOWNSTREAM_LR=auto: each rate of DOWNSTREAM_LR_GRID at three lengths by 3-fold cross-validation,
# 18 runs an arm) costs several times the fixed rate's fine-tuning. DOWNSTREAM_LR=auto chooses; recipes/evaluate.sh
# always does; DOWNSTREAM=0 skips it
if [ "${DOWNSTREAM:-1}" != 0 ]; then
    if [ "${DOWNSTREAM_LR:-1e-3}" = auto ]; then
        # shellcheck disable=SC2206  # a list of rates
        LR_ARGS=(--lr-grid ${DOWNSTREAM_LR_GRID:-3e-4 1e-3})
    else
        LR_ARGS=(--lr "${DOWNSTREAM_LR:-1e-3}")
    fi
    # shellcheck disable=SC2086  # a list of seeds
    $PY -m commodity_bert.finetune --model "$RUN" --task embedded:polarity --random-init \
        --seeds ${DOWNSTREAM_SEEDS:-1} "${LR_ARGS[@]}" --quiet --json "$RUN/downstream_polarity.json"
fi
