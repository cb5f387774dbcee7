"""Multi-host runs for real: network namespaces as hosts (tools/netns_cluster.py), each with its
own address and sshd, launched through every DeepSpeed launcher. Needs root; skips otherwise."""
import json
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
from conftest import REPO, ForkedRanks, checked, train

sys.path.insert(0, str(REPO))

DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
CONFIG = REPO / "ds_configs" / "cpu_tiny_lamb.json"
STEPS = 10


@pytest.fixture(scope="module")
def data(train_data):
    return train_data


def train_args(data, run, steps=STEPS, *extra):
    return ["train.py", "--deepspeed_config", str(CONFIG), "--data", str(data), "--model", "tiny",
            "--output-dir", str(run), "--max-steps", str(steps), "--log-every", "5", "--num-workers", "1",
            "--dist-timeout-minutes", "1", *map(str, extra)]


def check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        raise AssertionError(f"{what} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def losses(run: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["mlm_acc"], r["grad_norm"]) for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def one_host_run(tmp_path_factory, data):
    """The reference: the same 2 ranks and global batch on one host (forked: conftest.train)."""
    run = tmp_path_factory.mktemp("one_host") / "run"
    train(2, *train_args(data, run)[1:])
    return run


def assert_same_run_on_two_hosts(run: Path, one_host_run: Path) -> None:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["hosts"] == ["node1", "node2"]        # one rank per host, really
    assert summary["params_identical_across_ranks"]
    two, one = losses(run)[:2], losses(one_host_run)
    assert [r[0] for r in two] == [5, 10]
    for a, b in zip(two, one):                            # same global batch → same losses
        assert a[1:] == pytest.approx(b[1:], rel=1e-5, abs=1e-6)


def launch(cluster, *args, timeout=600) -> subprocess.CompletedProcess:
    """`deepspeed --hostfile` on node1, as a user logged into the first node would type it."""
    return subprocess.run([*cluster.exec_prefix(0), DEEPSPEED, "--hostfile", str(cluster.hostfile), *args],
                          cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI (Debian: openmpi-bin, libopenmpi-dev)")
def test_openmpi_launcher_on_two_hosts(cluster, data, one_host_run, tmp_path):
    pytest.importorskip("mpi4py", reason="needs mpi4py (pip install .[mpi])")
    run = tmp_path / "run"
    proc = launch(cluster, "--launcher", "openmpi", "--master_port", "29613", *train_args(data, run))
    check(proc, "openmpi launch")
    assert "cmd = mpirun" in proc.stdout + proc.stderr  # ranks started by mpirun, found through mpi4py
    assert_same_run_on_two_hosts(run, one_host_run)


def launch_per_node(cluster, command) -> None:
    """`command(i)` started on every host i at once; each must exit 0."""
    nodes = [cluster.popen(i, command(i), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(len(cluster.hosts))]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-4000:]


def test_no_ssh_per_node_launches(cluster, data, one_host_run, tmp_path):
    run = tmp_path / "run"
    launch_per_node(cluster, lambda i: [DEEPSPEED, "--hostfile", str(cluster.hostfile), "--no_ssh", "--node_rank",
                                        str(i), "--master_addr", cluster.addresses[0], "--master_port", "29614",
                                        *train_args(data, run)])
    assert_same_run_on_two_hosts(run, one_host_run)


def test_torchrun_on_two_hosts(cluster, data, one_host_run, tmp_path):
    """torchrun on each host, meeting through its c10d rendezvous on node1: its ranks are told
    their node's size as LOCAL_WORLD_SIZE and their node as GROUP_RANK (commodity_bert/launcher_env.py),
    and train as DeepSpeed's launcher's do."""
    run = tmp_path / "run"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    # the namespace hosts' names resolve nowhere (a cluster's do): node1 is told it hosts the
    # rendezvous, each host the address it is reached at
    launch_per_node(cluster, lambda i: [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                        "--rdzv-endpoint", f"{cluster.addresses[0]}:29616", "--rdzv-id", "bert",
                                        "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", cluster.addresses[i],
                                        *train_args(data, run)])
    assert_same_run_on_two_hosts(run, one_host_run)


def test_lamb_on_unequal_nodes_trains_as_the_same_ranks_on_one_host(cluster, data, tmp_path):
    """A hostfile of node1 slots=2 and node2 slots=1 (ranks forked onto the hosts with the
    launcher's environment): 3 ranks, a global batch of 96, the losses of 3 ranks on one host."""
    one, two = tmp_path / "one_host", tmp_path / "two_hosts"
    checked(ForkedRanks(3, *train_args(data, one)[1:]).wait())
    proc = checked(ForkedRanks(3, *train_args(data, two)[1:], ranks_per_node=[2, 1],
                               nodes=[partial(cluster.enter, h) for h in range(2)],
                               master_addr=cluster.addresses[0]).wait())
    summary = json.loads((two / "summary.json").read_text())
    assert summary["hosts"] == ["node1", "node1", "node2"] and summary["params_identical_across_ranks"]
    assert [r[0] for r in losses(two)] == [5, 10] and "Traceback" not in proc.stderr
    assert json.loads((two / "metrics.jsonl").read_text().splitlines()[0])["samples"] == 5 * 96
    for a, b in zip(losses(two), losses(one)):
        assert a[1:] == pytest.approx(b[1:], rel=1e-5, abs=1e-6)


@pytest.mark.skipif(shutil.which("pdsh") is None, reason="needs pdsh (Debian: pdsh)")
def test_node_loss_fails_fast_and_relaunch_resumes(cluster, data, one_host_run, tmp_path):
    """DeepSpeed's pdsh launcher across the hosts (`deepspeed --hostfile` on node1), node2 killed
    after a checkpoint, the same command again: it resumes, and its steps are the one-host run's."""
    run = tmp_path / "run"
    command = [*cluster.exec_prefix(0), DEEPSPEED, "--hostfile", str(cluster.hostfile), "--master_port", "29615",
               *train_args(data, run, 24, "--save-every", 5)]  # at the log steps: a row's mean is not split
    launcher = subprocess.Popen(command, cwd=REPO, env=cluster.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    latest = run / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not (latest.exists() and latest.read_text() >= "step_00000010") and time.time() < deadline:
        assert launcher.poll() is None, launcher.stdout.read()[-4000:]
        time.sleep(0.5)
    killed = cluster.kill_host_processes(1, "train.py")   # node2 dies
    assert killed
    died_at = time.time()
    output = launcher.communicate(timeout=180)[0]
    failed_after = time.time() - died_at
    assert launcher.returncode != 0
    assert failed_after < 90, f"node1 took {failed_after:.0f} s to notice"  # not a 30-minute hang
    assert "train.py: error: rank 0 on node1 lost a peer (" in output, output[-3000:]  # one line, no traceback
    assert "Traceback" not in output
    saved = int(latest.read_text().removeprefix("step_"))
    assert saved >= 10, output[-3000:]

    proc = subprocess.run(command, cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=600,
                          check=False)                  # the same command, once the node is back
    check(proc, "relaunch")
    assert f"resuming from {run / 'checkpoints' / f'step_{saved:08d}'} at step {saved}" in proc.stdout
    assert "node2:" in proc.stdout                        # pdsh prefixes the remote host's output
    assert json.loads((run / "summary.json").read_text())["step"] == 24
    assert_same_run_on_two_hosts(run, one_host_run)


def test_a_link_that_flaps_trains_on_and_one_that_stays_down_ends_both_ranks_naming_the_other(cluster, data, tmp_path):
    """node2's cable out of the switch: its connections stall, neither end told. Out for 5 s,
    under the 18-s collective timeout, the run trains on; out for good, each rank stops within the
    timeout (and the few seconds that tell who went silent) in one line naming the other's host,
    and the last checkpoint stays whole. DeepSpeed's own groups (its gradient allreduce) included:
    made without a timeout, they waited torch's 30 minutes."""
    run = tmp_path / "run"
    ranks = forked_on_hosts(cluster, 2, *train_args(data, run, 100_000, "--save-every", 10,
                                                    "--dist-timeout-minutes", 0.3)[1:], as_launched=True)
    ranks.timeout = 300

    def step() -> int:
        rows = (run / "metrics.jsonl").read_text().split("\n")[:-1] if (run / "metrics.jsonl").exists() else []
        return json.loads(rows[-1])["step"] if rows else 0

    def until(condition, what: str) -> None:
        while not condition():
            done = ranks.poll()
            assert done is None, f"ended before {what}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            time.sleep(0.2)
    try:
        until(lambda: step() >= 10, "the flap")
        cluster.set_link_up(1, False)
        time.sleep(5)
        cluster.set_link_up(1, True)
        flapped_at = step()
        until(lambda: step() >= flapped_at + 10, "training on after the flap")
        cluster.set_link_up(1, False)
        cut = time.monotonic()
        while (done := ranks.poll()) is None:
            time.sleep(0.2)
        ended_after = time.monotonic() - cut
    finally:
        cluster.set_link_up(1, True)
    print(f"the flap at step {flapped_at}; both ranks ended {ended_after:.0f} s after the link went down")
    assert done.returncode != 0
    assert ended_after < 18 + 20, f"{ended_after:.0f} s after the link went down"
    lines = [line for line in done.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(lines) == 2, done.stderr[-3000:]
    assert any(line.startswith("train.py: error: rank 0 on node1: no word from rank 1 on node2") for line in lines)
    assert any(line.startswith("train.py: error: rank 1 on node2: no word from node1 (rank 0's host") for line in lines)
    assert "Traceback" not in done.stderr
    latest = (run / "checkpoints" / "latest").read_text()
    assert int(latest.removeprefix("step_")) >= flapped_at and (run / "checkpoints" / latest).is_dir()


def forked_on_hosts(cluster, ranks: int, *args, ranks_per_node: list[int] | None = None,
                    as_launched: bool = False) -> ForkedRanks:
    """train.py on `ranks` ranks forked from this process, split evenly over the cluster's hosts
    (Cluster.enter) or as `ranks_per_node` says, rank 0's host the master."""
    return ForkedRanks(ranks, *args, nodes=[partial(cluster.enter, h) for h in range(len(cluster.hosts))],
                       master_addr=cluster.addresses[0], ranks_per_node=ranks_per_node, as_launched=as_launched)


# Ethernet (14) + IPv4 (20) + TCP with timestamps (32): the headers of every packet node1 sends,
# pure ACKs included; a retransmitted segment carries at most an MSS (MTU 1500 less 52). On 2 busy
# cores veth drops packets and TCP resends them: 315 segments (0.43% of the bytes) over the six
# steps of one run, enough to move the raw ratio between 1.002 and 1.024 from run to run.
HEADER_BYTES, MSS = 14 + 20 + 32, 1448


def tx_reader(cluster, host: int):
    """Host's eth0 tx bytes and packets and its TCP retransmitted segments, read in /proc/PID/net
    of a process in its namespace (its sshd): no process to start, so a read lands within a
    millisecond of the moment it is wanted."""
    net = Path(f"/proc/{cluster.sshd_pid(host)}/net")

    def read() -> tuple[int, ...]:
        tcp = [line.split() for line in (net / "snmp").read_text().splitlines() if line.startswith("Tcp:")]
        retransmitted = int(tcp[1][tcp[0].index("RetransSegs")])
        for line in (net / "dev").read_text().splitlines():
            name, _, fields = line.partition(":")
            if name.strip() == "eth0":
                counters = fields.split()   # received bytes and packets first, 8 fields, then transmitted
                return int(counters[8]), int(counters[9]), retransmitted, int(counters[0]), int(counters[1])
        raise LookupError(f"no eth0 in {net / 'dev'}")
    return read


SPARSE = {"compression": "sparse", "density": 0.05, "error_feedback": True}


@pytest.mark.parametrize("config,diloco", [(c, {}) for c in (
    "cpu_tiny_lamb.json", "cpu_tiny_adamw_zero2_bf16.json", "cpu_tiny_diloco_lamb.json", "cpu_tiny_zero_one_adam.json",
    "cpu_tiny_lamb_bucketwise_clip.json", "cpu_tiny_onebit_lamb.json")] + [("cpu_tiny_diloco_lamb.json", SPARSE)],
    ids=lambda v: v if isinstance(v, str) else v.get("compression", ""))
def test_bytes_sent_and_received_match_the_interface_counters(cluster, data, tmp_path, config, diloco):
    """The metrics' bytes_sent and bytes_received (BytesCounter's model) against what node1's eth0
    really sent and received over the
    steps of a run: LAMB's gradient allreduce, ZeRO-2's reduce and all-gather (through functions
    DeepSpeed took before the counter was installed, which the counter once missed), DiLoCo's outer
    steps (every 2nd step here) with nothing between, in fp32 and sparse (the all-gather of top-k
    payloads: offsets, codes and scales), and 0/1 Adam's variance steps and 1-bit
    exchanges (its freeze comes after this run's 8 steps), and bucket-wise clipping and 1-bit LAMB's
    compressed stage, whose logged gradient norm once sent a whole fp32 allreduce at every step
    logged (hidden from bytes_sent; every step is logged here). Each node is
    a rank forked from this process onto its host (conftest.ForkedRanks, Cluster.enter), so no
    launcher traffic crosses the link; node1's counter is read
    as each metrics row appears, when the step's collectives are done and the next step's are still a
    forward and backward away."""
    run, steps = tmp_path / "run", 8
    ds_config = json.loads((REPO / "ds_configs" / config).read_text())
    if "diloco" in ds_config.get("commodity_bert", {}):
        ds_config["commodity_bert"]["diloco"].update(inner_steps=2, **diloco)
    if ds_config["optimizer"]["type"] == "OneBitLamb":
        ds_config["optimizer"]["params"]["freeze_step"] = 2  # steps 3-8 compressed
    (tmp_path / config).write_text(json.dumps(ds_config))
    args = ["--deepspeed_config", str(tmp_path / config), "--data", str(data), "--model", "tiny",
            "--output-dir", str(run), "--max-steps", str(steps), "--log-every", "1", "--save-every-minutes", "0",
            "--num-workers", "1", "--dist-timeout-minutes", "1"]
    tx, peer = tx_reader(cluster, 0), tx_reader(cluster, 1)
    ranks = forked_on_hosts(cluster, 2, *args)
    metrics, tx_at_step = run / "metrics.jsonl", {}   # step → node1's counters when its row was the newest
    while (done := ranks.poll()) is None:
        # whole lines only: the last may be caught half written (a CI run read one cut at char 432)
        rows = metrics.read_text().split("\n")[:-1] if metrics.exists() else []
        if rows and (step := json.loads(rows[-1])["step"]) not in tx_at_step:
            tx_at_step[step] = (*tx(), peer()[2])   # and node2's resent segments, which node1 receives
        time.sleep(0.005)
    checked(done)
    sent = {r["step"]: r["bytes_sent"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r}
    # from the first sampled step to the last before the final one, which evaluates before its row
    first, last = min(tx_at_step), max(s for s in tx_at_step if s < steps)
    assert last - first >= steps // 2, tx_at_step
    counted = sum(sent[s] for s in range(first + 1, last + 1))
    wire, packets, resent = (tx_at_step[last][k] - tx_at_step[first][k] for k in range(3))
    payload = wire - HEADER_BYTES * packets
    print(f"{config}: bytes_sent over steps {first + 1}-{last}: {counted:,.0f}; eth0: {wire:,} in {packets:,} "
          f"packets ({resent} resent), {payload:,} without headers; ratio {wire / counted:.4f}")
    # the payload: the counted collectives, what TCP resent, and the metrics' own small
    # collectives and gloo's framing: 11-18 kB over these 6 steps in every mode (0.05-0.3% of the
    # dense modes' bytes, 2.7% of sparse DiLoCo's 414 kB)
    allowance = (last - first) * 3000
    assert counted <= payload <= counted * 1.005 + allowance + resent * MSS
    # received: node1 takes in what node2 sends it, and what node2's TCP resent
    got = {r["step"]: r["bytes_received"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r}
    counted_in = sum(got[s] for s in range(first + 1, last + 1))
    wire_in, packets_in, resent_in = (tx_at_step[last][k] - tx_at_step[first][k] for k in (3, 4, 5))
    payload_in = wire_in - HEADER_BYTES * packets_in
    print(f"{config}: bytes_received {counted_in:,.0f}; eth0 received {wire_in:,} in {packets_in:,} packets "
          f"({resent_in} resent by node2), {payload_in:,} without headers")
    assert counted_in <= payload_in <= counted_in * 1.005 + allowance + resent_in * MSS


@pytest.mark.parametrize("per_node", [[2, 2], [2, 1]], ids=["2+2", "2+1"])
@pytest.mark.parametrize("config", ["cpu_tiny_onebit_lamb.json", "cpu_tiny_zero_one_adam.json",
                                    "cpu_tiny_diloco_lamb.json"])
def test_two_ranks_per_node_exchange_in_two_levels(cluster, data, tmp_path, config, per_node):
    """2 hosts of 2 ranks (the hostfile's slots=2), or of 2 and 1: the compressed modes reduce
    inside the host and exchange between hosts only (comm/topology.py; on unequal nodes the second
    rank of node1 sums and gathers only), and the metrics' node_bytes_sent and
    node_bytes_received, summed over the two nodes, are what the two hosts' eth0 sent and
    received between them. 1-bit LAMB compresses from step 3, 0/1 Adam's variance stage sends 1-bit
    exchanges between its full-precision steps, DiLoCo averages in int8 every 2nd step."""
    run, steps = tmp_path / "run", 8
    ds_config = json.loads((REPO / "ds_configs" / config).read_text())
    if "diloco" in ds_config.get("commodity_bert", {}):
        ds_config["commodity_bert"]["diloco"].update(inner_steps=2, compression="int8")
    if ds_config["optimizer"]["type"] == "OneBitLamb":
        ds_config["optimizer"]["params"]["freeze_step"] = 2
    ds_config["train_micro_batch_size_per_gpu"] //= 2  # 4 ranks: the same batch as 2
    (tmp_path / config).write_text(json.dumps(ds_config))
    args = ["--deepspeed_config", str(tmp_path / config), "--data", str(data), "--model", "tiny",
            "--output-dir", str(run), "--max-steps", str(steps), "--log-every", "1", "--save-every-minutes", "0",
            "--num-workers", "1", "--dist-timeout-minutes", "2"]
    readers = [tx_reader(cluster, 0), tx_reader(cluster, 1)]
    ranks = forked_on_hosts(cluster, sum(per_node), *args, ranks_per_node=per_node)
    metrics, at_step = run / "metrics.jsonl", {}
    while (done := ranks.poll()) is None:
        rows = metrics.read_text().split("\n")[:-1] if metrics.exists() else []
        if rows and (step := json.loads(rows[-1])["step"]) not in at_step:
            at_step[step] = [read() for read in readers]
        time.sleep(0.005)
    nodes = "2 nodes of 2 ranks each" if per_node == [2, 2] else "2 nodes of [2, 1] ranks"
    assert f"exchange in two levels ({nodes}): fp32 inside a node" in checked(done).stdout, done.stdout
    rows = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r}
    first, last = min(at_step), max(s for s in at_step if s < steps)
    assert last - first >= steps // 2, at_step

    def wire(host, k):
        return at_step[last][host][k] - at_step[first][host][k]

    for direction, field, (b, p) in (("sent", "node_bytes_sent", (0, 1)), ("received", "node_bytes_received", (3, 4))):
        counted = 2 * sum(rows[s][field] for s in range(first + 1, last + 1))  # per node, 2 nodes
        payload = sum(wire(h, b) - HEADER_BYTES * wire(h, p) for h in (0, 1))
        resent = sum(wire(h, 2) for h in (0, 1))
        print(f"{config}: node_bytes_{direction} × 2 over steps {first + 1}-{last}: {counted:,.0f}; both eth0: "
              f"{payload:,} without headers ({resent} resent); ratio {payload / counted:.4f}; "
              f"rank 0's bytes_sent {sum(rows[s]['bytes_sent'] for s in range(first + 1, last + 1)):,.0f}")
        assert counted <= payload <= counted * 1.01 + resent * MSS
