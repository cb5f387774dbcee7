#!/usr/bin/env bash
# Is my BERT any good? Pretrain (the quickstart's run, unless RUN already holds an export) →
# fine-tune on downstream tasks over several seeds → one table: the pretrained model beside the
# same architecture from random initialisation, a bag-of-words logistic regression and the
# majority class, each fine-tuned arm at the lr chosen on a slice of its training data.
#   RUN (default runs/quickstart): the run to evaluate; RUN/hf_model is pretrained first if missing
#   GLUE_DIR: a directory of GLUE task folders (SST-2, CoLA, MRPC, QQP, QNLI, RTE, MNLI); each one
#     present is evaluated after the embedded tasks (polarity, party)
#   SEEDS (default "1 2 3 4 5"), EXTRA: more bert-finetune flags (e.g. "--epochs 2 --lr-grid 1e-4 3e-4")
# Results: RUN/downstream/TASK.json and the table, also in RUN/downstream/table.md.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=$VENV/bin/python
RUN=${RUN:-runs/quickstart}
SEEDS=${SEEDS:-1 2 3 4 5}
if [ ! -f "$RUN/hf_model/config.json" ]; then
    echo "no export in $RUN: pretraining it with the quickstart first"
    RUN="$RUN" DOWNSTREAM=0 bash recipes/quickstart.sh
fi
OUT="$RUN/downstream"
mkdir -p "$OUT"
# shellcheck disable=SC2086  # SEEDS and EXTRA are lists of words
for task in polarity party; do  # the two embedded tasks: sentence polarity, a speaker's party
    # shellcheck disable=SC2086
    $PY -m commodity_bert.finetune --model "$RUN" --task "embedded:$task" --random-init --seeds $SEEDS \
        ${EXTRA:-} --json "$OUT/embedded_$task.json"
done
if [ -n "${GLUE_DIR:-}" ]; then
    for task in SST-2 CoLA MRPC QQP QNLI RTE MNLI; do
        [ -d "$GLUE_DIR/$task" ] || continue
        # shellcheck disable=SC2086
        $PY -m commodity_bert.finetune --model "$RUN" --glue "$task" "$GLUE_DIR/$task" --random-init \
            --seeds $SEEDS ${EXTRA:-} --json "$OUT/glue_$task.json"
    done
fi
$PY -m commodity_bert.finetune.table "$OUT"/*.json | tee "$OUT/table.md"
