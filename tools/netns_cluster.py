"""A multi-host test cluster on one Linux machine: network namespaces as hosts.

Each host is a network namespace with one interface, `eth0`, on a private /24, joined to the
others by a bridge that lives in a namespace of its own (a "switch"), so nothing in the
machine's own network namespace changes (with a delay, the hosts' eth0 are TAP devices of a
user-space relay instead, tools/delay_relay.py: this kernel has no netem). Each host runs an sshd
on its own address with a generated key; `bin/ssh` (put it first on PATH) is ssh with the cluster's config, so
DeepSpeed's pdsh launcher, `mpirun` and plain `ssh node1` reach the hosts by name. Links can
be limited (`tc`: rate, delay) to model a cluster's Ethernet.

The file system is shared (only the network is separate), like an NFS home on a real cluster.
Only addresses of hosts this module created are contacted.

    sudo python tools/netns_cluster.py up --hosts 2 --slots 1 --rate 1gbit --dir /tmp/cluster
    sudo ip netns exec cb0-node1 env PATH=/tmp/cluster/bin:$PATH DS_ENV_FILE=/tmp/cluster/deepspeed_env \\
        deepspeed --hostfile /tmp/cluster/hostfile train.py ...
    sudo python tools/netns_cluster.py down --dir /tmp/cluster

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), iproute2, openssh-server and openssh-client.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET_BASE = "10.213"  # 10.213.<cluster index>.<host index + 1>


class ClusterUnavailable(RuntimeError):
    """This machine cannot host a namespace cluster (not root, tools missing)."""


# ip, tc, sshd (and Slurm's daemons) live in sbin, which a user's PATH may lack (`env -i
# PATH=/usr/local/bin:/usr/bin:/bin`, as CI runs on a newcomer's machine): every process this
# module starts, and the ranks in the namespaces, look there too
for _sbin in ("/usr/local/sbin", "/usr/sbin", "/sbin"):
    if _sbin not in os.environ.get("PATH", "").split(":"):
        os.environ["PATH"] = f"{os.environ.get('PATH', '')}:{_sbin}".lstrip(":")


def _run(*cmd: str, check: bool = True, capture: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, text=True, capture_output=capture)


def unavailable_reason() -> str | None:
    """Why a cluster cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root for network namespaces (ip netns), tc and sshd"
    for tool in ("ip", "tc", "sshd", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"needs {tool} (Debian: iproute2, openssh-server, openssh-client)"
    probe = f"cbprobe{os.getpid()}"
    if _run("ip", "netns", "add", probe, check=False, capture=True).returncode:
        return "cannot create network namespaces here (ip netns add failed)"
    _run("ip", "netns", "del", probe, check=False, capture=True)
    return None


@dataclass
class Cluster:
    directory: Path
    hosts: list[str]
    addresses: list[str]
    slots: int | list[int]  # every host's, or each host's own (a hostfile of unequal slots)
    index: int
    namespaces: list[str] = field(default_factory=list)
    relay: dict | None = None  # {"rate": ..., "delay": ...}: links through tools/delay_relay.py

    # ------------------------------------------------------------------ use
    @property
    def hostfile(self) -> Path:
        return self.directory / "hostfile"

    @property
    def env(self) -> dict[str, str]:
        """Environment for commands that launch onto the cluster."""
        env = dict(os.environ)
        env["PATH"] = f"{self.directory / 'bin'}:{env.get('PATH', '')}"
        env["DS_ENV_FILE"] = str(self.directory / "deepspeed_env")
        env["GLOO_SOCKET_IFNAME"] = "eth0"
        env["OMP_NUM_THREADS"] = str(self.threads_per_rank)
        env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
        return env

    @property
    def slots_per_host(self) -> list[int]:
        return list(self.slots) if isinstance(self.slots, (list, tuple)) else [self.slots] * len(self.hosts)

    @property
    def ranks(self) -> int:
        return sum(self.slots_per_host)

    @property
    def threads_per_rank(self) -> int:
        return max(1, (os.cpu_count() or 1) // self.ranks)

    def exec_prefix(self, host: int) -> list[str]:
        """Command prefix that runs a program on host `host` (0-based): in its network namespace
        and in a UTS namespace with its own host name (MPI tells hosts apart by name)."""
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hosts[host]]

    def enter(self, host: int) -> None:
        """Move this process onto host `host`, as exec_prefix puts a new program there: into its
        network namespace, and a UTS namespace of its own with the host's name. For a process
        forked from a test, which keeps its imports. The process must have one thread: a network
        namespace is entered by the calling thread alone."""
        import ctypes
        import socket
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{self.namespaces[host]}", os.O_RDONLY)
        try:
            if libc.setns(fd, 0x40000000) or libc.unshare(0x04000000):  # CLONE_NEWNET, CLONE_NEWUTS
                error = ctypes.get_errno()
                raise OSError(error, f"entering {self.hosts[host]}: {os.strerror(error)}")
        finally:
            os.close(fd)
        socket.sethostname(self.hosts[host])
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"

    def popen(self, host: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        kwargs.setdefault("env", self.env)
        return subprocess.Popen(self.exec_prefix(host) + cmd, **kwargs)

    def tx_bytes(self, host: int) -> int:
        """Bytes host `host` has sent on eth0 (the interface's own counter)."""
        out = _run(*self.exec_prefix(host), "cat", "/sys/class/net/eth0/statistics/tx_bytes", capture=True)
        return int(out.stdout)

    def pids(self, host: int) -> list[int]:
        out = _run("ip", "netns", "pids", self.namespaces[host], check=False, capture=True)
        return [int(p) for p in out.stdout.split()]

    def sshd_pid(self, host: int) -> int:
        """The host's sshd, which lives as long as the host: a process to read the namespace's
        /proc/PID/net through. Not pids()[0]: once process ids wrap (pid_max, often 32,768, in a
        long test session) a passing process has a lower id than the sshd."""
        return int((self.directory / f"sshd_{self.hosts[host]}.pid").read_text())

    def kill_host_processes(self, host: int, match: str) -> list[int]:
        """SIGKILL the processes on `host` whose command line contains `match`: a node dying."""
        killed = []
        for pid in self.pids(host):
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                if match in cmdline:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        return killed

    def set_link(self, rate: str | None = None, delay: str | None = None, hosts: list[int] | None = None) -> None:
        """Limit every host's (or only `hosts`') egress on eth0, as its NIC would: rate like
        '1gbit' (a token bucket, tbf), delay like '0.2ms' (netem, where the kernel has it; where
        not, bring the cluster up with `delay=`: the user-space relay); neither: unlimited again."""
        if self.relay:
            raise RuntimeError(f"this cluster's links are tools/delay_relay.py's ({self.relay}), set when it "
                               f"came up: bring it up again to change them")
        for host in range(len(self.hosts)) if hosts is None else hosts:
            prefix = self.exec_prefix(host)
            _run(*prefix, "tc", "qdisc", "del", "dev", "eth0", "root", check=False, capture=True)
            parent = ["root"]
            if delay:
                out = _run(*prefix, "tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "netem",
                           "delay", delay, check=False, capture=True)
                if out.returncode:
                    raise RuntimeError(f"a link delay after `up` needs the kernel's netem qdisc ({out.stderr.strip()});"
                                       f" bring the cluster up with delay= instead (tools/delay_relay.py)")
                parent = ["parent", "1:1"]
            if rate:
                # burst: enough tokens for 1 ms at the rate, at least 64 KiB; queue up to 50 ms
                _run(*prefix, "tc", "qdisc", "add", "dev", "eth0", *parent, "handle", "10:", "tbf", "rate", rate,
                     "burst", "256kb", "latency", "50ms", capture=True)

    def set_link_up(self, host: int, up: bool) -> None:
        """Take host `host`'s cable out of the switch (up=False) or put it back: its connections
        stall, neither end told, as when a link or a switch port goes down."""
        if self.relay:
            raise RuntimeError("this cluster's links are tools/delay_relay.py's: bring it up without delay= to cut one")
        _run("ip", "-n", self.namespaces[-1], "link", "set", f"p{host + 1}", "up" if up else "down", capture=True)

    def add_decoy_interface(self, name: str = "docker0", address: str = "172.17.0.1/16",
                            remove: bool = False) -> None:
        """Give every host a second interface that reaches no other host, with the same address
        on each, as docker's bridge is on real nodes (its address is often `hostname -I`'s first,
        and an interface name NCCL or gloo may pick); `remove` takes it away again."""
        for host in range(len(self.hosts)):
            prefix = self.exec_prefix(host)
            if remove:
                _run(*prefix, "ip", "link", "del", name, check=False, capture=True)
                continue
            _run(*prefix, "ip", "link", "add", name, "type", "bridge", capture=True)  # as docker makes it
            _run(*prefix, "ip", "addr", "add", address, "dev", name, capture=True)
            _run(*prefix, "ip", "link", "set", name, "up", capture=True)

    # ------------------------------------------------------------------ build / tear down
    @classmethod
    def up(cls, directory: Path, hosts: int, slots: int | list[int] = 1, rate: str | None = None,
           delay: str | None = None) -> Cluster:
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        directory = Path(directory).resolve()
        directory.mkdir(parents=True, exist_ok=True)
        names = [f"node{i + 1}" for i in range(hosts)]
        relay = {"rate": rate, "delay": delay} if delay else None
        with _choosing_an_index():
            index = _free_index()
            addresses = [f"{SUBNET_BASE}.{index}.{i + 1}" for i in range(hosts)]
            cluster = cls(directory, names, addresses, slots, index, relay=relay)
            (directory / "cluster.json").write_text(json.dumps(
                {"index": index, "hosts": names, "addresses": addresses, "slots": slots, "relay": cluster.relay}))
            try:
                if delay:  # the kernel here has no netem: the links go through a user-space relay
                    cluster._build_relayed_network(rate, delay)
                else:
                    cluster._build_network()
            except BaseException:
                cluster.down()
                raise
        try:
            if not delay:
                cluster.set_link(rate)
            cluster._start_sshds()
        except BaseException:
            cluster.down()
            raise
        return cluster

    def _build_network(self) -> None:
        switch = f"cb{self.index}-switch"
        _run("ip", "netns", "add", switch)
        self.namespaces.append(switch)
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        for i, address in enumerate(self.addresses):
            ns = f"cb{self.index}-{self.hosts[i]}"
            _run("ip", "netns", "add", ns)
            self.namespaces.insert(i, ns)
            port = f"p{i + 1}"
            # create the pair inside the switch, then move one end into the host as eth0
            _run("ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "-n", switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", switch, "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        self._wait_for_links()

    def _wait_for_links(self) -> None:
        """The links are up once every host answers the next one's ping."""
        for i in range(len(self.hosts)):
            target = self.addresses[(i + 1) % len(self.hosts)]
            for _ in range(50):
                if not _run(*self.exec_prefix(i), "ping", "-c1", "-W1", target, check=False,
                            capture=True).returncode:
                    break
                time.sleep(0.1)

    def _build_relayed_network(self, rate: str | None, delay: str) -> None:
        """Each host's eth0 a TAP device of tools/delay_relay.py, which runs in the switch
        namespace and delivers every frame after the sender's link (rate) and the delay."""
        switch = f"cb{self.index}-switch"
        for i, name in enumerate(self.hosts):
            _run("ip", "netns", "add", f"cb{self.index}-{name}")
            self.namespaces.append(f"cb{self.index}-{name}")
        _run("ip", "netns", "add", switch)
        self.namespaces.append(switch)
        ready = self.directory / "relay.ready"
        ready.unlink(missing_ok=True)
        command = ["ip", "netns", "exec", switch, sys.executable, str(Path(__file__).with_name("delay_relay.py")),
                   "--netns", ",".join(self.namespaces[:-1]), "--addresses", ",".join(self.addresses),
                   "--delay", delay, "--ready", str(ready)] + (["--rate", rate] if rate else [])
        with open(self.directory / "relay.log", "w") as log:
            relay = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        for _ in range(100):
            if ready.exists() or relay.poll() is not None:
                break
            time.sleep(0.1)
        if not ready.exists():
            raise RuntimeError(f"the delay relay did not start: {(self.directory / 'relay.log').read_text()[-500:]}")
        self._wait_for_links()

    def _start_sshds(self) -> None:
        d = self.directory
        for key in ("host_key", "client_key"):
            if not (d / key).exists():
                _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key), capture=True)
        (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        for i, address in enumerate(self.addresses):
            config = d / f"sshd_{self.hosts[i]}.conf"
            config.write_text("\n".join([
                f"ListenAddress {address}", f"HostKey {d / 'host_key'}",
                f"AuthorizedKeysFile {d / 'authorized_keys'}", f"PidFile {d / f'sshd_{self.hosts[i]}.pid'}",
                "PermitRootLogin prohibit-password", "PasswordAuthentication no",
                "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
                "AcceptEnv *", "MaxStartups 100", "MaxSessions 100", ""]))
            _run(*self.exec_prefix(i), sshd, "-f", str(config))  # ssh sessions inherit the host name
        ssh_config = [f"Host {host}\n  HostName {address}\n  User root\n  IdentityFile {d / 'client_key'}\n"
                      "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                      "  LogLevel ERROR\n  ConnectTimeout 10\n"
                      for host, address in zip(self.hosts, self.addresses)]
        (d / "ssh_config").write_text("".join(ssh_config))
        (d / "bin").mkdir(exist_ok=True)
        wrapper = d / "bin" / "ssh"
        real_ssh = shutil.which("ssh", path="/usr/bin:/bin:/usr/local/bin") or "/usr/bin/ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {real_ssh} -F {d / "ssh_config"} "$@"\n')
        wrapper.chmod(0o755)
        # DeepSpeed exports this file's variables to remote ranks; no trailing newline, because
        # the launcher keeps it in the value (harmless for pdsh, fatal in mpirun's -x)
        # the hosts share this machine's cores: each rank gets its share of them, or every rank
        # takes them all (torch's default, and train.py's split counts one host's ranks only)
        # and oversubscribed threads wait on each other (a 20x slower step measured on 2 cores)
        (d / "deepspeed_env").write_text(f"GLOO_SOCKET_IFNAME=eth0\nOMP_NUM_THREADS={self.threads_per_rank}")
        self.hostfile.write_text("".join(f"{h} slots={n}\n" for h, n in zip(self.hosts, self.slots_per_host)))
        for host in self.hosts:  # every sshd answers before anyone launches
            for _ in range(50):
                if not _run(*self.exec_prefix(0), str(wrapper), host, "true", check=False, capture=True).returncode:
                    break
                time.sleep(0.2)
            else:
                raise RuntimeError(f"sshd on {host} does not answer")

    def down(self) -> None:
        for ns in self.namespaces:
            for pid in _run("ip", "netns", "pids", ns, check=False, capture=True).stdout.split():
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
        for ns in self.namespaces:
            _run("ip", "netns", "del", ns, check=False, capture=True)
        self.namespaces.clear()

    @classmethod
    def load(cls, directory: Path) -> Cluster:
        info = json.loads((Path(directory) / "cluster.json").read_text())
        cluster = cls(Path(directory).resolve(), info["hosts"], info["addresses"], info["slots"], info["index"],
                      relay=info.get("relay"))
        cluster.namespaces = [f"cb{info['index']}-{h}" for h in info["hosts"]] + [f"cb{info['index']}-switch"]
        return cluster


@contextlib.contextmanager
def _choosing_an_index():
    """Held from choosing a free index to creating its namespaces: two clusters brought up at
    once (the two test workers) could otherwise choose the same index, and the second would fail
    to add its namespaces."""
    with open("/run/cb_netns_cluster.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _free_index() -> int:
    existing = set(_run("ip", "netns", "list", capture=True).stdout.split())
    for index in range(1, 250):
        if f"cb{index}-switch" not in existing:
            return index
    raise RuntimeError("no free cluster index (250 clusters up?)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="bring a cluster up")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--slots", type=lambda v: [int(n) for n in v.split(",")] if "," in v else int(v), default=1,
                    help="ranks per host, or each host's own: 4,4,2")
    up.add_argument("--rate", help="link rate per host, e.g. 1gbit")
    up.add_argument("--delay", help="one-way delay per host, e.g. 20ms (through tools/delay_relay.py)")
    up.add_argument("--dir", required=True)
    down = sub.add_parser("down", help="tear a cluster down")
    down.add_argument("--dir", required=True)
    args = parser.parse_args()
    try:
        if args.command == "up":
            cluster = Cluster.up(Path(args.dir), args.hosts, args.slots, args.rate, args.delay)
            print(f"hosts: {', '.join(f'{h} ({a})' for h, a in zip(cluster.hosts, cluster.addresses))}")
            print(f"hostfile: {cluster.hostfile}; run on node1: ip netns exec {cluster.namespaces[0]} ...")
        else:
            Cluster.load(Path(args.dir)).down()
    except (ClusterUnavailable, subprocess.CalledProcessError, RuntimeError) as exc:
        print(f"netns_cluster: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
