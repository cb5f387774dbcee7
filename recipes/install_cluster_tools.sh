#!/usr/bin/env bash
# System packages for multi-node runs and the multi-host tests (Debian/Ubuntu, as root):
# sshd/ssh and pdsh for DeepSpeed's default launcher, Open MPI for --launcher openmpi,
# iproute2 (ip, tc) for the namespace test cluster, Slurm (slurm-wlm: slurmctld, slurmd and the
# client commands; munge) for the Slurm tests and recipes/slurm/. Run before recipes/setup_env.sh
# so that mpi4py is installed too. Installing slurm-wlm starts no daemon that the tests need:
# tools/slurm_cluster.py starts its own slurmctld and slurmds with its own slurm.conf.
set -euo pipefail
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install_cluster_tools.sh: needs root and apt-get; install openssh-server, openssh-client, pdsh," \
         "openmpi-bin, libopenmpi-dev, iproute2, iputils-ping, slurm-wlm and munge with your package manager" >&2
    exit 0  # the multi-host tests then skip, saying why
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    openssh-server openssh-client pdsh openmpi-bin libopenmpi-dev iproute2 iputils-ping slurm-wlm munge >/dev/null
echo "cluster tools installed: $(ssh -V 2>&1 | cut -d, -f1), pdsh $(pdsh -V 2>&1 | head -1 | cut -d' ' -f1)," \
     "$(mpirun --version | head -1), slurm-wlm $(dpkg-query -W -f '${Version}' slurm-wlm)"
