#!/usr/bin/env bash
# BERT phase 1 (seq 128) then phase 2 (seq 512) as two Slurm jobs: phase 2 starts from phase 1's
# weights once phase 1 has finished (--dependency=afterok, which waits through phase 1's requeues:
# a requeued job has not ended). The arguments are sbatch's, for both jobs:
#   DATA1=data/pretrain/seq128 DATA2=data/pretrain/seq512 bash recipes/slurm/pretrain_phases.sh \
#       --nodes 4 --gpus-per-node 8 --cpus-per-task 32 --time 24:00:00
# Environment: DATA1, DATA2 (required); MODEL (base); RUN1, RUN2 (runs/${MODEL}_phase1, _phase2);
# CONFIG1, CONFIG2 (default: ds_configs/bert_${MODEL}_phase{1,2}_lamb_bf16.json, or _fp16 where a GPU of
# the job has no bf16, chosen on the compute nodes: pretrain.sbatch's PRECISION); EXTRA1, EXTRA2 (train.py
# flags); and what recipes/slurm/pretrain.sbatch reads (PRECISION, BERT_LAUNCH, MASTER_PORT, RANKS_PER_NODE).
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${DATA1:?set DATA1 to the phase-1 data (seq 128)}" "${DATA2:?set DATA2 to the phase-2 data (seq 512)}"
MODEL=${MODEL:-base}
RUN1=${RUN1:-runs/${MODEL}_phase1}
RUN2=${RUN2:-runs/${MODEL}_phase2}
PHASE1=$(DATA=$DATA1 RUN=$RUN1 PHASE=phase1 CONFIG=${CONFIG1:-} \
    EXTRA=${EXTRA1:-} sbatch --parsable --job-name bert-phase1 "$@" recipes/slurm/pretrain.sbatch)
PHASE1=${PHASE1%%;*}  # --parsable: "id" or "id;cluster"
# phase 2: its own warmup, evaluations and checkpoints as recipes/phase2.sh has them, from phase 1's weights
PHASE2=$(DATA=$DATA2 RUN=$RUN2 PHASE=phase2 CONFIG=${CONFIG2:-} \
    EXTRA="--init-from $RUN1 --eval-every 500 --save-every 200 ${EXTRA2:-}" \
    sbatch --parsable --job-name bert-phase2 --dependency "afterok:$PHASE1" --kill-on-invalid-dep=yes "$@" \
    recipes/slurm/pretrain.sbatch)
echo "phase 1: job $PHASE1 -> $RUN1"
echo "phase 2: job ${PHASE2%%;*} -> $RUN2 (starts when job $PHASE1 has finished; cancelled if it fails)"
