#!/usr/bin/env bash
# Create (or reuse) a virtual environment with this project and its test tools.
#   VENV         where (default: .venv in the repository)
#   EXTRAS       the project's extras (default: test, plus mpi where Open MPI is installed)
#   TORCH_SPEC   which torch to install when the environment has none (default torch==2.13.0;
#                on a CPU-only machine pick a CPU build, on GPUs the CUDA build you need)
#   TORCH_INDEX  the package index to take torch from, e.g. https://download.pytorch.org/whl/cu130
#                for a CUDA 13.0 build (pytorch.org's install selector names the builds per driver)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# mpi4py only where Open MPI is installed (it compiles against it); a plain `&&` inside $(...)
# would fail the assignment under `set -e` on machines without it
if [ -z "${EXTRAS:-}" ]; then
    EXTRAS=test
    if command -v ompi_info >/dev/null 2>&1; then EXTRAS=test,mpi; fi
fi
if [ ! -x "$VENV/bin/python" ]; then
    # a stock Debian/Ubuntu python3 lacks ensurepip until python3-venv is installed: venv then leaves
    # a half-made environment behind, which the next run would take for a whole one
    made_here=$([ -e "$VENV" ] && echo no || echo yes)
    if ! complaint=$(python3 -m venv "$VENV" 2>&1); then
        [ "$made_here" = yes ] && rm -rf "$VENV"
        fix="set VENV to a directory you can write, or to an existing environment"
        case $complaint in *ensurepip*) fix="install python3-venv (Debian/Ubuntu: apt-get install python3-venv), or $fix" ;; esac
        echo "setup_env.sh: python3 -m venv $VENV failed ($(echo "$complaint" | tr '\n' ' ' | sed 's/  */ /g; s/^ //; s/ $//; s/\. .*/./' | cut -c1-200)); $fix" >&2
        exit 1
    fi
fi
PIP="$VENV/bin/python -m pip --quiet --disable-pip-version-check"
# setuptools_scm: seqeval (an sdist) names its version through it; setuptools 84 no longer fetches a
# `setup_requires`, and without it seqeval builds as version 0.0.0 and the install fails
$PIP install --upgrade pip setuptools wheel setuptools_scm
# torch first: a bare `torch` requirement would pull the newest CUDA build (GBs)
"$VENV/bin/python" -c "import torch" 2>/dev/null || $PIP install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"
# --no-build-isolation: DeepSpeed's build must see the torch installed above
$PIP install --no-build-isolation -e ".[$EXTRAS]"
"$VENV/bin/python" -c "import torch, deepspeed, transformers, h5py; print(f'environment ready: torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}')"
# DeepSpeed compiles its CPU allreduce op (and CPU Adam, for Adam configs) at the first launch, in
# every rank at once, ~50 s each on 2 cores, silently; once here, in one process, the first
# training starts at once (and a stale lock from a killed compile goes)
"$VENV/bin/python" -m commodity_bert.comm.deepspeed_shm
