#!/usr/bin/env bash
# Is my BERT any good? Pretrain (the quickstart's run, unless RUN already holds an export) →
# fine-tune on downstream tasks of the three families over several seeds (sentence
# classification, extractive QA, named-entity tagging) → one table: the pretrained model beside
# the same architecture from random initialisation and a baseline that needs no model (bag of
# words, sliding window, majority tag), each fine-tuned arm at the rate and length chosen by cross-validation on its
# training data; the model card's model-index then carries each result.
#   RUN (default runs/quickstart): the run to evaluate; RUN/hf_model is pretrained first if missing
#   GLUE_DIR: a directory of GLUE task folders (SST-2, CoLA, MRPC, QQP, QNLI, RTE, MNLI); each one
#     present is evaluated after the embedded tasks (polarity, party)
#   SEEDS (default "1 2 3 4 5"), EXTRA: more bert-finetune flags (e.g. "--epochs 2 --lr-grid 1e-4 3e-4")
#   SPAN_SEQ_LEN: --max-seq-len of the QA and tagging tasks (default: the run's pretraining sequence
#     length from its data's manifest, since positions beyond it are untrained, at most 128; give 512
#     for a phase-2 model)
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
SPAN_SEQ_LEN=${SPAN_SEQ_LEN:-$($PY - "$RUN" <<'PY'
import json, sys
from pathlib import Path
try:
    config = json.loads((Path(sys.argv[1]) / "run_config.json").read_text())
    print(min(128, json.loads((Path(config["args"]["data"]) / "manifest.json").read_text())["seq_len"]))
except (OSError, KeyError, ValueError) as exc:
    print(f"evaluate.sh: the run's pretraining sequence length is not known here ({exc}); QA and tagging at "
          f"128 tokens (set SPAN_SEQ_LEN to the run's)", file=sys.stderr)
    print(128)
PY
)}
for task in squad entities; do  # extractive QA (SQuAD articles), named entities (Universal NER)
    # shellcheck disable=SC2086
    $PY -m commodity_bert.finetune --model "$RUN" --task "embedded:$task" --random-init --seeds $SEEDS \
        --max-seq-len "$SPAN_SEQ_LEN" ${EXTRA:-} --json "$OUT/embedded_$task.json"
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
[ -d "$RUN/hf_model" ] && $PY -m commodity_bert.model.card "$RUN"  # its model-index: every result here
