"""A real Slurm on one Linux machine: slurmctld and one slurmd per host of the namespace test
cluster (tools/netns_cluster.py), for the tests and for trying recipes/slurm/ by hand.

Each host is a network namespace with an address of its own and a UTS namespace whose host
name is the node's name; slurmctld runs on the first host, and every host runs its own slurmd
(`slurmd -N nodeN`). munge is the machine's one munged, reached through the file system the
hosts share, as are the job's files (like an NFS home).

Why one slurmd per namespace and not several on one host: several slurmd on one host need
Slurm built with --enable-multiple-slurmd, and Debian's slurm-wlm is not. What this machine
needed (Debian's slurm-wlm 22.05.8):
- slurmd 22.05 loads a cgroup plugin even with proctrack/linuxproc, and autodetection fails on
  a cgroup v1 hierarchy under a tmpfs ("No filesystem mounted on /sys/fs/cgroup"): cgroup.conf
  says `CgroupPlugin=cgroup/v1` and constrains nothing; processes are tracked by
  proctrack/linuxproc (the process tree), which needs no cgroup at all;
- gloo takes the address of the node's host name (127.0.1.1 from /etc/hosts) unless told the
  interface: the job scripts export GLOO_SOCKET_IFNAME=eth0 where it is unset;
- a job requeued while it runs waits AuthInfo's cred_expire (120 s by default) before it may
  start again, and then for a scheduling pass (sched_interval 60 s, bf_interval 30 s): 5, 2 and
  1 s here, so that the tests do not wait; a node is declared dead after SlurmdTimeout, 20 s.

    sudo python tools/slurm_cluster.py up --hosts 2 --dir /tmp/slurmlab
    sudo ip netns exec cb1-node1 env SLURM_CONF=/tmp/slurmlab/slurm.conf sbatch -N 2 recipes/slurm/pretrain.sbatch
    sudo python tools/slurm_cluster.py down --dir /tmp/slurmlab

(`up` prints the namespace of the first host and the SLURM_CONF to use.)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns_cluster import Cluster, unavailable_reason as hosts_unavailable  # noqa: E402

SLURM_CONF = """ClusterName=cb{index}
SlurmctldHost={first}({first_addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd_%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd_%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
SlurmdTimeout=20
KillWait=10
{nodes}
PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""
CGROUP_CONF = "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n"
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol")


def unavailable_reason() -> str | None:
    """Why a Slurm cannot be brought up here, or None when it can."""
    reason = hosts_unavailable()
    if reason:
        return reason
    for tool in DAEMONS:
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"needs {tool} (Debian: slurm-wlm munge; recipes/install_cluster_tools.sh installs them)"
    if not Path("/etc/munge/munge.key").exists():
        return "needs a munge key in /etc/munge/munge.key (Debian's munge package makes one)"
    return None


@dataclass
class SlurmCluster:
    directory: Path
    hosts: Cluster

    @property
    def conf(self) -> Path:
        return self.directory / "slurm.conf"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a user on the cluster's login node: SLURM_CONF and the hosts' own."""
        env = self.hosts.env
        env.pop("DS_ENV_FILE", None)  # a job gets its environment from sbatch, not DeepSpeed's file
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    def run(self, *cmd: str, env: dict | None = None, check: bool = True, cwd=None) -> subprocess.CompletedProcess:
        """A command on the first host (the login node), with the cluster's SLURM_CONF."""
        proc = subprocess.run([*self.hosts.exec_prefix(0), *cmd], env=env or self.env(), cwd=cwd,
                              capture_output=True, text=True, check=False, timeout=120)
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def sbatch(self, *args: str, env: dict | None = None, cwd=None) -> str:
        """Submit a batch job; its id."""
        out = self.run("sbatch", "--parsable", *args, env=env, cwd=cwd).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, NodeList, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        fields = {}
        for word in out.split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait(self, job_id: str, states: set[str], timeout: float = 300.0, poll: float = 1.0) -> dict[str, str]:
        """Wait until the job is in one of `states`; its fields."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout:.0f} s: {fields}")
            time.sleep(poll)

    def node_state(self, name: str) -> str:
        out = self.run("scontrol", "show", "node", "-o", name).stdout
        return next((w.split("=", 1)[1] for w in out.split() if w.startswith("State=")), "")

    # ------------------------------------------------------------------ build / tear down
    @classmethod
    def up(cls, directory: Path, hosts: int = 2) -> SlurmCluster:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        directory = Path(directory).resolve()
        for sub in ("state", "spool", "log"):
            (directory / sub).mkdir(parents=True, exist_ok=True)
        cluster = cls(directory, Cluster.up(directory / "hosts", hosts=hosts, slots=1))
        try:
            cluster._start()
        except BaseException:
            cluster.down()
            raise
        return cluster

    def _start(self) -> None:
        h = self.hosts
        nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs=1 State=UNKNOWN" for n, a in zip(h.hosts, h.addresses))
        self.conf.write_text(SLURM_CONF.format(index=h.index, first=h.hosts[0], first_addr=h.addresses[0],
                                               d=self.directory, nodes=nodes, names=",".join(h.hosts)))
        (self.directory / "cgroup.conf").write_text(CGROUP_CONF)
        _start_munged()
        env = {**os.environ, "SLURM_CONF": str(self.conf)}
        subprocess.run([*h.exec_prefix(0), "slurmctld", "-i"], env=env, check=True)
        for i in range(len(h.hosts)):
            self.start_slurmd(i)
        deadline = time.monotonic() + 60
        while True:  # every node registered and idle
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
            states = dict(zip(out[::2], out[1::2]))
            if len(states) == len(h.hosts) and all(s == "idle" for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm nodes not idle after 60 s: {states}; see {self.directory / 'log'}")
            time.sleep(0.5)

    def start_slurmd(self, host: int) -> None:
        """slurmd on host `host` (0-based), as the node's boot would start it."""
        env = {**os.environ, "SLURM_CONF": str(self.conf)}
        subprocess.run([*self.hosts.exec_prefix(host), "slurmd", "-N", self.hosts.hosts[host]], env=env, check=True)

    def down(self) -> None:
        self.hosts.down()  # slurmctld, the slurmds and every job's processes live in the namespaces

    @classmethod
    def load(cls, directory: Path) -> SlurmCluster:
        directory = Path(directory).resolve()
        return cls(directory, Cluster.load(directory / "hosts"))


def _start_munged() -> None:
    """The machine's munged (one serves every namespace: its socket is a file), started if it is not running."""
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
        return
    Path("/run/munge").mkdir(exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "munged"], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--hosts", type=int, default=2)
    args = parser.parse_args()
    if args.action == "up":
        cluster = SlurmCluster.up(args.dir, args.hosts)
        print(json.dumps({"login_namespace": cluster.hosts.namespaces[0], "SLURM_CONF": str(cluster.conf),
                          "nodes": cluster.hosts.hosts}))
    else:
        SlurmCluster.load(args.dir).down()


if __name__ == "__main__":
    main()
