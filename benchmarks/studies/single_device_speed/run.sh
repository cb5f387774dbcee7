#!/usr/bin/env bash
# Where does single-device speed come from? Three paths on the same samples of real
# text (its natural padding): padded + dense MLM head (HF), padded + sparse head (Google/NVIDIA),
# unpadded + sparse head (this project); mini and base, seq 128 and 512. Nothing else should run.
#
#   bash benchmarks/studies/single_device_speed/run.sh [WORK] [OUT_PREFIX]
set -euo pipefail
cd "$(dirname "$0")/../../.."
WORK=${1:-/tmp/single_device_speed}
OUT=${2:-benchmarks/results/$(date +%F)_single_device_speed}
PY=${PYTHON:-.venv/bin/python}
PATHS="--paths padded_baseline padded_sparse_head project --repeats 3 --device cpu"
mkdir -p "$WORK"
run() {  # name, then throughput.py's flags
    local name=$1; shift
    $PY benchmarks/throughput.py $PATHS --work "$WORK" "$@" --json "${OUT}_$name.json" | tee "${OUT}_$name.txt"
}
run mini128_bf16 --model mini --seq-len 128 --micro-batch 32 --steps 4 --precision bf16
run mini128_fp32 --model mini --seq-len 128 --micro-batch 32 --steps 4 --precision fp32
run mini512_bf16 --model mini --seq-len 512 --micro-batch 8 --steps 4 --precision bf16
run base128_bf16 --model base --seq-len 128 --micro-batch 16 --steps 2 --precision bf16
run base512_bf16 --model base --seq-len 512 --micro-batch 4 --steps 2 --precision bf16
