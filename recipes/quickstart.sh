#!/usr/bin/env bash
# CPU quickstart, end to end on the embedded corpus (233 State of the Union addresses, public
# domain): set up .venv → WordPiece vocabulary → stratified shards → 2-rank training with
# DeepSpeed's launcher (validation accuracy printed as it rises) → Hugging Face export → a
# fill-mask answer. About 7 minutes on 2 cores. Re-running resumes / skips finished parts.
#   DATA_ROOT (default data/quickstart), RUN (default runs/quickstart), STEPS (default 300)
set -euo pipefail
cd "$(dirname "$0")/.."
bash recipes/setup_env.sh
VENV=${VENV:-.venv}
PY=$VENV/bin/python
DATA_ROOT=${DATA_ROOT:-data/quickstart}
RUN=${RUN:-runs/quickstart}
STEPS=${STEPS:-300}
mkdir -p "$DATA_ROOT"
# a small vocabulary trained on the corpus: a tiny model learns it faster than BERT's 30k
[ -f "$DATA_ROOT/vocab.txt" ] || $PY -m data_prep vocab --input embedded:sotu --vocab-size 8192 \
    --output "$DATA_ROOT/vocab.txt"
$PY -m data_prep shards --input embedded:sotu --vocab "$DATA_ROOT/vocab.txt" --output "$DATA_ROOT/seq128" \
    --seq-len 128 --masking static --dupe-factor 1 --num-shards 4 --val-fraction 0.05
$PY -m data_prep inspect "$DATA_ROOT/seq128" --verify | tail -n 1
# two local ranks: DeepSpeed's --num_gpus is the number of processes on a CPU machine (a
# hostfile, even one naming localhost, makes the launcher ssh into each host)
"$VENV/bin/deepspeed" --num_gpus "${RANKS:-2}" train.py --deepspeed_config ds_configs/cpu_tiny_lamb.json \
    --data "$DATA_ROOT/seq128" --model tiny --output-dir "$RUN" --max-steps "$STEPS" \
    --log-every 25 --eval-every 50 --save-every 100 --num-workers 1 2>&1 \
    | grep --line-buffered -E '^(step|done|stopping)|error|Error'
$PY - "$RUN" <<'PY'
import json, sys
from pathlib import Path
import transformers
from transformers import pipeline
transformers.logging.set_verbosity_error()  # the NSP head not used by fill-mask is reported otherwise
transformers.utils.logging.disable_progress_bar()
run = Path(sys.argv[1])
evals = [(r["step"], r["val_mlm_acc"]) for r in map(json.loads, open(run / "metrics.jsonl")) if "val_mlm_acc" in r]
print("validation MLM accuracy by step:", ", ".join(f"{s}: {a:.1%}" for s, a in evals))
fill = pipeline("fill-mask", model=str(run / "hf_model"))
question = "the congress of the united [MASK] shall assemble ."
print(f"fill-mask: {question!r} ->", ", ".join(f"{a['token_str']} ({a['score']:.2f})" for a in fill(question)))
PY
