#!/usr/bin/env bash
# System packages for multi-node runs and the multi-host tests (Debian/Ubuntu, as root):
# sshd/ssh and pdsh for DeepSpeed's default launcher, Open MPI for --launcher openmpi,
# iproute2 (ip, tc) for the namespace test cluster, Slurm (slurm-wlm: slurmctld, slurmd and the
# client commands; munge) for the Slurm tests and recipes/slurm/. Run before recipes/setup_env.sh
# so that mpi4py is installed too. Installing slurm-wlm starts no daemon that the tests need:
# tools/slurm_cluster.py starts its own slurmctld and slurmds with its own slurm.conf.
#   INSTALL_SLURM  auto (default): slurm-wlm and munge unless the node already has a Slurm of its
#                  own (sbatch, /etc/slurm or a munge key not from Debian's packages): a site's Slurm
#                  and munge key must not be replaced; yes; no
set -euo pipefail
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install_cluster_tools.sh: needs root and apt-get; install openssh-server, openssh-client, pdsh," \
         "openmpi-bin, libopenmpi-dev, iproute2, iputils-ping, slurm-wlm and munge with your package manager" >&2
    exit 0  # the multi-host tests then skip, saying why
fi
PACKAGES="openssh-server openssh-client pdsh openmpi-bin libopenmpi-dev iproute2 iputils-ping"
INSTALL_SLURM=${INSTALL_SLURM:-auto}
if [ "$INSTALL_SLURM" = auto ]; then
    INSTALL_SLURM=yes
    if ! dpkg-query -W -f '${Status}' slurm-wlm 2>/dev/null | grep -q "ok installed" \
            && { command -v sbatch >/dev/null || [ -e /etc/slurm/slurm.conf ] || [ -e /etc/munge/munge.key ]; }; then
        INSTALL_SLURM=no
        echo "install_cluster_tools.sh: this node has a Slurm of its own ($(command -v sbatch || echo /etc/slurm, /etc/munge));" \
             "slurm-wlm and munge left out so that it stays as it is (INSTALL_SLURM=yes installs them)" >&2
    fi
fi
[ "$INSTALL_SLURM" = yes ] && PACKAGES="$PACKAGES slurm-wlm munge"
apt-get update -qq
# shellcheck disable=SC2086  # a list of packages
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null
echo "cluster tools installed: $(ssh -V 2>&1 | cut -d, -f1), pdsh $(pdsh -V 2>&1 | head -1 | cut -d' ' -f1)," \
     "$(mpirun --version | head -1)$([ "$INSTALL_SLURM" = yes ] && echo ", slurm-wlm $(dpkg-query -W -f '${Version}' slurm-wlm)")"
