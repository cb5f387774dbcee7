#!/usr/bin/env bash
# Run a command with a PATH that has every program of this one but Open MPI's, as on a newcomer's
# machine: whatever this CI machine has installed, the command cannot find ompi_info or mpirun.
#   bash .ci/without_open_mpi.sh COMMAND [ARGS...]
set -euo pipefail
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
IFS=: read -ra dirs <<< "$PATH"
for dir in "${dirs[@]}"; do
    for program in "$dir"/*; do
        name=$(basename "$program")
        case $name in ompi*|mpirun|mpiexec|orte*|oshrun|mpicc|mpicxx|mpifort) continue ;; esac
        [ -x "$program" ] && [ ! -e "$bin/$name" ] || continue
        case $name in
            # an interpreter is started by its own path, not through a link here: Python takes
            # its home from the path it was started by, and a venv made by a linked python3
            # would point into this folder, which is gone when the command ends
            python*) printf '#!/bin/sh\nexec %q "$@"\n' "$program" > "$bin/$name" && chmod +x "$bin/$name" ;;
            *) ln -s "$program" "$bin/$name" ;;
        esac
    done
done
PATH=$bin "$@"
