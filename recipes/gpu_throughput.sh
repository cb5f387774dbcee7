#!/usr/bin/env bash
# Single-GPU throughput and MFU matrix: BERT-base and -large × seq 128 and 512 × bf16 and fp16,
# the padded HF baseline and this project's path side by side (benchmarks/throughput.py), one
# JSON per setting in OUT and a summary table at the end. Add the results to
# benchmarks/RESULTS.md with the date, the GPU and this command.
#   OUT (default runs/gpu_throughput), MODELS ("base large"), SEQS ("128 512"),
#   PRECISIONS ("bf16 fp16"), PATHS ("padded_baseline project"; add project_compiled to
#   measure torch.compile), STEPS (8), REPEATS (3), INPUT (embedded:sotu), DEVICE (cuda),
#   MICRO_BATCH_128 (64), MICRO_BATCH_512 (16), PY (python of .venv, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-runs/gpu_throughput}
MODELS=${MODELS:-base large}
SEQS=${SEQS:-128 512}
PRECISIONS=${PRECISIONS:-bf16 fp16}
PATHS=${PATHS:-padded_baseline project}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT/data"
for seq in $SEQS; do
    micro_batch_var=MICRO_BATCH_$seq
    micro_batch=${!micro_batch_var:-$([ "$seq" -le 128 ] && echo 64 || echo 16)}
    for model in $MODELS; do
        for precision in $PRECISIONS; do
            # shards are prepared once per sequence length, in OUT/data
            # shellcheck disable=SC2086
            "$PY" benchmarks/throughput.py --device "$DEVICE" --model "$model" --seq-len "$seq" \
                --precision "$precision" --micro-batch "$micro_batch" --steps "${STEPS:-8}" \
                --repeats "${REPEATS:-3}" --input "${INPUT:-embedded:sotu}" --paths $PATHS \
                --work "$OUT/data" --json "$OUT/${model}_seq${seq}_${precision}.json"
        done
    done
done
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
print(f"\n{'model':<6} {'seq':>4} {'prec':<5} {'path':<17} {'mb':>3} {'seq/s':>8} {'real tok/s':>11} "
      f"{'TFLOP/s':>8} {'MFU':>6}")
for result in sorted(Path(sys.argv[1]).glob("*.json")):
    for r in json.loads(result.read_text()):
        print(f"{r['model']:<6} {r['seq_len']:>4} {r['precision']:<5} {r['path']:<17} {r['micro_batch']:>3} "
              f"{r['seq_per_s']:>8.1f} {r['tokens_per_s']:>11,.0f} {r['tflops']:>8.2f} {r['mfu']:>6.1%}")
PY
