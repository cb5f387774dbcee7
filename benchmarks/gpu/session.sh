#!/usr/bin/env bash
# Every check the project runs on a GPU, in one command (benchmarks/gpu/session.py says what and why).
#
#   here, once:  python benchmarks/gpu/session.py prepare   (gpu_bundle/: wheels the device lacks, shards)
#   on the GPU:  bash benchmarks/gpu/session.sh   (in a copy of the tree with gpu_bundle/ beside it;
#                a time limit of 480 s; OUT's files copied back)
#   rehearsal:   bash benchmarks/gpu/session.sh --rehearse  (on a CPU, tiny sizes: what CI runs)
#
# Or in two commands, speed and the long `mini` first:
#   here, once:  python benchmarks/gpu/session.py prepare --corpus corpus   (the prose corpus's shards too)
#   command 1:   bash benchmarks/gpu/session.sh --only correctness speed   (time limit 300 s; ~215 s)
#   command 2:   bash benchmarks/gpu/session.sh --only model --model-minutes 6 --model-data corpus
#                (time limit 560 s; ~500 s: 1.8 billion processed tokens at 5M tokens/s)
#
# Installs the carried wheels with no network into a folder of their own, then runs the plan;
# OUT/session.json and OUT/session.log are rewritten after every part. Other flags go to
# `session.py run` (--skip-fused-lamb, --only PART...).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu_session}
BUNDLE=${BUNDLE:-gpu_bundle}
mkdir -p "$OUT"
rehearse=0
for arg in "$@"; do [ "$arg" = --rehearse ] && rehearse=1; done
if [ $rehearse = 1 ]; then
    PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
    SITE=$(mktemp -d)  # installed to prove the wheels install; this environment already has them
    # as the device's Python 3.12 would take them, whatever this machine's Python is
    AS_DEVICE="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64"
    for n in 17 24 27 28 31 34; do AS_DEVICE="$AS_DEVICE --platform manylinux_2_${n}_x86_64"; done
else
    PY=${PY:-python3}
    SITE=/tmp/site
    AS_DEVICE=""
fi
started=$(date +%s%N)
if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $AS_DEVICE \
        "$BUNDLE"/wheels/*.whl >>"$OUT/session.log" 2>&1; then
    echo "session.sh: error: the wheels in $BUNDLE/wheels did not install (see $OUT/session.log); run: python benchmarks/gpu/session.py prepare" >&2
    exit 1
fi
ms=$(( ($(date +%s%N) - started) / 1000000 )); install_s=$((ms / 1000)).$(printf %03d $((ms % 1000)))
if [ $rehearse = 1 ]; then rm -rf "$SITE"; else export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"; fi
echo "session: installed $(ls "$BUNDLE"/wheels/*.whl | wc -l) wheels in ${install_s} s"
export PYTHONUNBUFFERED=1
# DeepSpeed 0.19.8's op builder cannot read an architecture with a letter (9.0a): docs/install.md.
# The device's only: the CPU's ops have no CUDA architecture.
if [ $rehearse = 0 ]; then
    TORCH_CUDA_ARCH_LIST=$(echo "${TORCH_CUDA_ARCH_LIST:-9.0}" | sed 's/\([0-9]\)[a-z]/\1/g'); export TORCH_CUDA_ARCH_LIST
fi
exec "$PY" benchmarks/gpu/session.py run --out "$OUT" --bundle "$BUNDLE" --install-s "$install_s" "$@"
