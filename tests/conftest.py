import base64
import contextlib
import functools
import hashlib
import io
import itertools
import json
import logging
import lzma
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_CORPORA = REPO.parent / "shared" / "corpora"
EMBEDDED_SOTU = REPO / "data_prep" / "resources" / "sotu.txt.xz"

# One thread per process, inherited by every process the tests start: two workers share the 2
# cores and most tests start 2 ranks besides, and OpenMP threads that outnumber the cores spin
# against each other (a fine-tuning test runs an order of magnitude slower so). train.py,
# fine-tuning and the spawned ranks all read it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Two pytest-xdist workers share the 2 cores (pyproject's addopts: -n 2): run one at a time the
# suite leaves a third of the machine idle (launches import, wait on signals and on DeepSpeed's 1-s
# poll). Each worker computes its own session fixtures, so the modules that read the shared
# training runs (reference_runs, mode_run) go to one worker, and so do the modules that start
# namespace hosts, mounts or fixed ports; every other module goes whole to whichever is free.
WORKER_GROUPS = {**dict.fromkeys(["test_finetune", "test_train", "test_comm_modes", "test_training_paths",
                                  "test_plateau", "test_sparse_diloco"], "shared_runs"),
                 **dict.fromkeys(["test_multihost", "test_launcher", "test_plan", "test_checkpoints_on_a_cluster",
                                  "test_rehearsal"],
                                 "on_hosts"),
                 **dict.fromkeys(["test_data", "test_model"], "datasets")}


# The longest groups first, each to the next worker free (xdist hands a worker its next group when
# its current one has 2 tests left): a long group started last holds one worker while the other
# idles (ablate and benchmarks, 270 s, began at minute 14 of a 16-minute run). By the workers'
# seconds in a whole run, longest first, but Slurm's before the namespace hosts': its tests mostly
# wait on Slurm's clock and its jobs take under a core, so it goes beside the shared runs, which
# use both cores (beside ablation and the benchmarks, which also leave one idle, the suite took
# 956 s; this way 901 to 946 s in five runs, median 929, on a 2-core AMD EPYC Zen 4:
# docs/suite.md). The modules that wait on timeouts and sleeps (streaming DiLoCo's late and hung
# workers, the delay relay) go before the short ones, where they left one core idle at the end.
# The rest in collection order.
LONGEST_FIRST = ["shared_runs", "test_slurm", "on_hosts", "test_ablate", "test_benchmarks",
                 "test_gpu_session", "test_launch_errors", "test_domain", "test_streaming_diloco",
                 "test_delay_relay", "test_run_config", "datasets"]


def scope_of(nodeid: str) -> str:
    module = Path(nodeid.split("::", 1)[0]).stem
    return WORKER_GROUPS.get(module, module)


def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduling by scope, the scope being a module's group, in LONGEST_FIRST's order.
    Why not --dist loadgroup: with pytest 9.2 its xdist_group marks have no effect (xdist 3.8
    renames item._nodeid, which pytest 9.2 no longer reads), and every test went where it liked."""
    from xdist.scheduler import LoadScopeScheduling
    config.option.loadscopereorder = False  # the collection's order (LONGEST_FIRST), not by size

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)
    return ByGroup(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With SUITE_TIMELINE=FILE, a line per test: its worker, its start and end (epoch s), its id,
    and the CPU-seconds it took (its worker's and the processes it waited for: forked ranks,
    launches; not what Slurm's daemons start): which worker holds the suite's last minutes, behind
    which tests, and which tests the cores go to (docs/suite.md)."""
    start, cpu_before = time.time(), cpu_seconds()
    try:
        return (yield)
    finally:
        if os.environ.get("SUITE_TIMELINE"):
            with open(os.environ["SUITE_TIMELINE"], "a") as out:
                out.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{start:.1f}\t{time.time():.1f}\t"
                          f"{item.nodeid}\t{cpu_seconds() - cpu_before:.1f}\n")


def cpu_seconds() -> float:
    """User and system seconds of this process and of the children it has waited for."""
    import resource
    return sum(usage.ru_utime + usage.ru_stime
               for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


# The shared runs (reference_runs, mode_run) train the first time a test asks for them, inside that
# test's time: 4 to 11 minutes where bf16 is emulated (an AMD EPYC without AVX-512), against the
# 600 s that pyproject.toml gives a test. Their launches have timeouts of their own.
SHARED_TRAINING_TIMEOUT = 1800


def pytest_collection_modifyitems(config, items):
    rank = {scope: i for i, scope in enumerate(LONGEST_FIRST)}
    # stable: the files of a group, and the tests of a file, keep their order
    items.sort(key=lambda item: rank.get(scope_of(item.nodeid), len(LONGEST_FIRST)))
    for item in items:
        if {"reference_runs", "mode_run"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.timeout(SHARED_TRAINING_TIMEOUT))
            # on another worker the shared runs would all be trained again for it (65 s for one
            # test of test_sparse_diloco.py): the controller knows node ids only, so the group is
            # declared and checked here
            if scope_of(item.nodeid) != "shared_runs":
                raise pytest.UsageError(f"{item.nodeid} reads the shared training runs: add its module to "
                                        "the shared_runs group of WORKER_GROUPS in tests/conftest.py")


def run_cli(*args, check=True, timeout=300, **kwargs) -> subprocess.CompletedProcess:
    """Run the real CLI in its own process, as a user would."""
    proc = subprocess.run([sys.executable, "-m", "data_prep", *map(str, args)], capture_output=True, check=False,
                          text=True, timeout=timeout, cwd=REPO, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"bert-data-prep {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def refusal(main, args, capsys, console_module: str | None = None) -> tuple[int, str]:
    """(exit status, stderr) of a command-line tool refusing `args`: through `python -m
    console_module` in a process of its own where one is named (the path users run; a table of
    bad inputs takes it once), else `main(args)` in this process, as a start imports torch and
    transformers again (several CPU-seconds each)."""
    args = [str(a) for a in args]
    if console_module:
        proc = subprocess.run([sys.executable, "-m", console_module, *args], cwd=REPO, capture_output=True,
                              text=True, timeout=300, check=False)
        return proc.returncode, proc.stderr
    capsys.readouterr()
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse's refusals, and tools that exit with their line
        code = exit_.code
    return code, capsys.readouterr().err


# Each xdist worker hands out ports from its own span, below the kernel's ephemeral range (32768
# and up) and below the fixed 29xxx ports of the namespace tests: ports from bind(0) are freed
# before the launch binds them, and two workers asking at once were handed the same one
# (EADDRINUSE in a rank's TCPStore).
_PORT_SPAN = 2000
_next_ports = itertools.count(20000 + _PORT_SPAN * (int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0) % 4))


def free_port() -> int:
    """A port of this worker's span that nothing holds now; never the same one twice in a session."""
    for port in _next_ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def spawn_ranks(worker, world: int, *args) -> dict:
    """{rank: what `worker(rank, world, port, results, *args)` put in results[rank]}, from `world`
    real processes, each joining the gloo group itself. Forked, not spawned: a fork starts with the
    test's imports, where a spawned process imports torch and the test module again (~2.5 CPU-s
    a rank; the 8 modules that start ranks so took 188 CPU-s spawned, 31 forked, on a 2-core AMD
    EPYC with native bf16). Safe to fork: OMP_NUM_THREADS=1 (above) leaves no OpenMP pool in
    the parent, and no test's process holds a gloo group when it forks."""
    import torch.multiprocessing as mp
    results = mp.Manager().dict()
    mp.start_processes(worker, args=(world, free_port(), results, *args), nprocs=world, start_method="fork")
    return dict(results)


def shard_checksums(data_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(data_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(data_dir.rglob("*.hdf5"))}


def tree_checksums(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def first_documents(text: str, max_chars: int) -> str:
    """Whole documents (blank-line separated) from the start of `text`, up to max_chars."""
    out, size = [], 0
    for doc in text.split("\n\n"):
        if size + len(doc) > max_chars and out:
            break
        out.append(doc)
        size += len(doc) + 2
    return "\n\n".join(out) + "\n"


@pytest.fixture(scope="session")
def sotu_text() -> str:
    return lzma.open(EMBEDDED_SOTU, "rt", encoding="utf-8").read()


@pytest.fixture(scope="session")
def datasets(tmp_path_factory, sotu_small) -> Path:
    """Seq-64 shards of the text: static/ (NSP, 4 shards) and dynamic/ (dynamic masking, no NSP, 3)."""
    root = tmp_path_factory.mktemp("data")
    common = ["--input", sotu_small, "--seq-len", 64, "--dupe-factor", 1, "--val-fraction", 0.05, "--workers", 2]
    run_cli("shards", *common, "--num-shards", 4, "--output", root / "static")
    run_cli("shards", *common, "--num-shards", 3, "--masking", "dynamic", "--no-nsp", "--output", root / "dynamic")
    return root


def batch_of(data_dir: Path, indices) -> tuple[dict, dict]:
    """(manifest, the batch the loader makes of `indices` of the first shard)."""
    import numpy as np

    from commodity_bert.data import shard_format as fmt
    from commodity_bert.data.loader import BatchMaker
    from commodity_bert.data.vocab import Vocab
    manifest = fmt.load_manifest(data_dir)
    arrays = fmt.read_shard(data_dir / "shard_00000.hdf5")
    maker = BatchMaker(arrays, manifest, Vocab.load(data_dir / "vocab.txt"), seed=3, static=manifest["masking"] == "static")
    return manifest, maker(np.asarray(indices), (0, 0, 0))


@pytest.fixture(scope="session")
def sotu_small(tmp_path_factory, sotu_text) -> Path:
    """~1.5 MB of whole State of the Union addresses (one speech per line)."""
    path = tmp_path_factory.mktemp("corpus") / "sotu_small.txt"
    path.write_text(first_documents(sotu_text, 1_500_000))
    return path


def shared_corpus(name: str) -> Path:
    path = SHARED_CORPORA / name
    if not path.is_file():
        pytest.skip(f"{path} not present (the shared corpora sit beside the checkout)")
    return path


def load_manifest(data_dir: Path) -> dict:
    return json.loads((data_dir / "manifest.json").read_text())


@pytest.fixture(scope="session")
def sotu_vocab(tmp_path_factory, sotu_small) -> Path:
    """8,192 WordPieces trained on the text, as the quickstart makes them: with BERT's 30,522 the
    embeddings are 90% of `tiny` and its steps take 2.5x as long."""
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    run_cli("vocab", "--input", sotu_small, "--vocab-size", 8192, "--output", path)
    return path


@pytest.fixture(scope="session")
def train_data(tmp_path_factory, sotu_small, sotu_vocab) -> Path:
    """Small seq-64 NSP shards with a validation split, for the training runs."""
    out = tmp_path_factory.mktemp("train_data") / "seq64"
    run_cli("shards", "--input", sotu_small, "--vocab", sotu_vocab, "--seq-len", 64, "--dupe-factor", 1,
            "--num-shards", 4, "--val-fraction", 0.05, "--workers", 2, "--output", out)
    return out


# ---- training: on forked ranks, or through DeepSpeed's launcher where the launch is the subject; and the
# runs several test modules compare against

DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
CPU_CONFIG = REPO / "ds_configs" / "cpu_tiny_lamb.json"
COMMON = ["--deepspeed_config", CPU_CONFIG, "--model", "tiny", "--log-every", 5, "--num-workers", 1]
ONEBIT = ["--deepspeed_config", REPO / "ds_configs" / "cpu_tiny_onebit_lamb.json", "--model", "tiny",
          "--log-every", 5, "--num-workers", 1]


def launch_cmd(ranks: int, *args) -> list[str]:
    """train.py on `ranks` ranks of this host under DeepSpeed's per-node launcher
    (deepspeed.launcher.launch), started as DeepSpeed's runner starts it on one host: the runner's
    local path only encodes the world and runs this command (runner.py, `if not
    multi_node_exec`). Leaving out the runner's own interpreter saves ~2 CPU-s of each launch;
    the runner is tested where it is the subject: bert-launch (test_launcher.py), hostfile
    launches (test_multihost.py, test_plan.py), Slurm, and the quickstart that CI runs first."""
    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(ranks))}).encode()).decode()
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", "train.py", *map(str, args)]


@contextlib.contextmanager
def one_rank_group():
    """A gloo process group of one rank in this process: train.py's checks called where their
    launch is not the subject (a launch is two ranks' imports, ~12 CPU-s)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        if dist.is_initialized():  # train.py's refusals release it themselves
            dist.destroy_process_group()


def refused_in_process(check, capsys) -> tuple[int, str]:
    """check() under one_rank_group, which must end in train.py's fail(): (status, stderr). The
    refusal released the process group: left to the interpreter's exit, gloo's threads can abort
    the rank, its status 2 becoming SIGABRT's."""
    import torch.distributed as dist
    with one_rank_group():
        with pytest.raises(SystemExit) as exit_:
            check()
        assert not dist.is_initialized(), "train.py refused with its process group still up"
    return exit_.value.code, capsys.readouterr().err


@functools.cache
def train_module_for_forks():
    """train.py, imported once per worker, with what its ranks otherwise do once each, each fork
    anew: DeepSpeed's op loading imports torch.utils.cpp_extension (and setuptools), rank 0 imports
    its TensorBoard writer and, at its export, builds transformers' checkpoint conversion mapping
    (1,033 regular expressions, kept for the process): about 0.8 CPU-s a 2-rank run where the
    worker had done none of them yet (docs/HISTORY.md, 89d59c7)."""
    import torch.utils.cpp_extension  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    import train as train_py
    get_checkpoint_conversion_mapping("bert")
    return train_py


class ForkedRanks:
    """train.py's main() on `ranks` processes forked from this one, each with what DeepSpeed's
    per-node launcher gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, ..., --local_rank=N) and the
    launch's two output streams, shared by the ranks as a launch's pipes are. Why not a launch:
    its launcher and ranks each import torch, DeepSpeed and transformers again (~13 CPU-s for 2
    ranks), where a fork starts with this process's imports. Where the launch is the subject (one
    line from one rank, signals, the launcher's status) a test starts it: launch_cmd."""

    def __init__(self, ranks: int, *args, timeout: float = 600, nodes: list | None = None,
                 master_addr: str = "127.0.0.1", node_args: list[list] | None = None,
                 ranks_per_node: list[int] | None = None, as_launched: bool = False, entry=None):
        """`as_launched`: train.py's entry as a launched rank runs it (run_as_a_rank: a failure in
        one line, no traceback), not main() alone. `nodes`: one entry a node, None or a callable that moves a forked rank onto that node
        (a host of tools/netns_cluster.py: Cluster.enter); the ranks are split evenly among them,
        or `ranks_per_node` a node (a hostfile's unequal slots). `node_args`: each node's arguments
        after `args` (a directory of its own). `entry`: what each rank runs instead, given the
        rank's argv (`--local_rank=N` first)."""
        train_py = train_module_for_forks()  # once per worker: every fork starts with it
        self.argv, self.deadline = [str(a) for a in args], time.monotonic() + timeout
        self.timeout, self.status, self.failed_at, self.first_failure = timeout, {}, None, 0
        self.folder = tempfile.TemporaryDirectory(prefix="ranks_")
        self.out, self.err = Path(self.folder.name) / "stdout", Path(self.folder.name) / "stderr"
        port, nodes = free_port(), nodes or [None] * len(node_args or ranks_per_node or [[]])
        self.ranks_per_node = ranks_per_node or [ranks // len(nodes)] * len(nodes)
        assert sum(self.ranks_per_node) == ranks and len(self.ranks_per_node) == len(nodes)
        self.node_args = [[str(a) for a in extra] for extra in node_args or [[]] * len(nodes)]
        entry = entry or (train_py.run_as_a_rank if as_launched else train_py.main)
        self.pids = [self._fork(entry, rank, ranks, port, nodes, master_addr)
                     for rank in range(ranks)]

    def _fork(self, main, rank: int, world: int, port: int, nodes: list, master_addr: str) -> int:
        pid = os.fork()
        if pid:
            return pid
        status = 1
        try:
            for fd, path in ((1, self.out), (2, self.err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
            sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                                                       line_buffering=True) for fd in (1, 2))
            # a logger's handler keeps the stream it was made with: pytest's capture of whichever
            # test imported its package, closed since. Here they write where a launched rank's do:
            # DeepSpeed's logger to stdout (its LoggerFactory), the others to stderr (logging's default)
            for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
                for handler in getattr(logger, "handlers", ()):
                    # assigned, not setStream(), which flushes the closed one; a handler whose stream
                    # is a property (logging's last resort) looks up sys.stderr itself
                    if "stream" in vars(handler) and not isinstance(handler, logging.FileHandler):
                        handler.stream = sys.stdout if logger.name == "DeepSpeed" else sys.stderr
            firsts = [sum(self.ranks_per_node[:n]) for n in range(len(nodes))]
            node = max(n for n, first in enumerate(firsts) if first <= rank)
            local_rank, per_node = rank - firsts[node], self.ranks_per_node[node]
            if nodes[node] is not None:
                nodes[node]()
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                              LOCAL_SIZE=str(per_node), CROSS_RANK=str(node), CROSS_SIZE=str(len(nodes)),
                              MASTER_ADDR=master_addr, MASTER_PORT=str(port))
            os.chdir(REPO)
            main([f"--local_rank={local_rank}", *self.argv, *self.node_args[node]])
            status = 0
        except SystemExit as exit_:
            if isinstance(exit_.code, str):
                sys.stderr.write(exit_.code + "\n")
            status = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        except BaseException:  # noqa: BLE001 - as an uncaught exception ends a process
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(status)

    def poll(self) -> subprocess.CompletedProcess | None:
        """The launch's result once every rank has ended, else None. As DeepSpeed's launcher, the
        first rank to fail sets the status and ends the others (after 10 s to end on their own)."""
        for pid in self.pids:
            if pid not in self.status:
                done, raw = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.status[pid] = os.waitstatus_to_exitcode(raw)
                    if self.status[pid] != 0 and self.failed_at is None:
                        self.failed_at, self.first_failure = time.monotonic(), self.status[pid]
        now = time.monotonic()
        if len(self.status) < len(self.pids):
            if now > self.deadline or (self.failed_at is not None and now > self.failed_at + 10):
                for pid in set(self.pids) - set(self.status):
                    os.kill(pid, signal.SIGKILL)
                    self.status[pid] = -signal.SIGKILL
                if now > self.deadline:
                    raise subprocess.TimeoutExpired(["train.py", *self.argv], self.timeout, *self._output())
            else:
                return None
        result = subprocess.CompletedProcess(["train.py", *self.argv], self.first_failure, *self._output())
        self.folder.cleanup()
        return result

    def _output(self) -> tuple[str, str]:
        return tuple(path.read_text(errors="replace") if path.exists() else ""
                     for path in (self.out, self.err))

    def wait(self) -> subprocess.CompletedProcess:
        while (result := self.poll()) is None:
            time.sleep(0.05)
        return result


def train(ranks, *args, check=True, timeout=600):
    """train.py on `ranks` forked ranks (ForkedRanks), as a launch's CompletedProcess."""
    proc = ForkedRanks(ranks, *args, timeout=timeout).wait()
    return checked(proc) if check else proc


def launched(ranks, *args, check=True, timeout=600):
    """train.py on `ranks` ranks under DeepSpeed's per-node launcher: where the launch is the
    subject, or what happens when its processes exit (a forked rank ends in os._exit)."""
    proc = subprocess.run(launch_cmd(ranks, *args), cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          check=False)
    return checked(proc) if check else proc


def rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def window_loss(history: dict, last: int, width: int = 5) -> float:
    """The loss a run logging every `width` steps reports at `last`: the mean over its window, from
    a history {step: row} logged every step."""
    return sum(history[s]["loss"] for s in range(last - width + 1, last + 1)) / width


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory, sotu_small, sotu_vocab, train_data, dynamic_data) -> dict[str, Path]:
    """The runs several test modules compare against, trained side by side (two runs at a
    time, the longest first) the first time any of them is asked for:
    - run30: 2 ranks of LAMB in fp32, 30 steps, the reference run of the training tests;
    - healthy: a tiny run that leaves the unigram plateau: the quickstart's recipe (a vocabulary
      of 8,192 trained on the text, seq 64 without NSP, LAMB 1e-2; bf16 where the CPU has it
      natively, else fp32, as recipes/quickstart.sh picks) for 400 steps, one evaluation, at the
      end, where the plateau check runs. 400 and not 300 steps: the fp32 run left the plateau
      between steps 200 and 300 (validation MLM 10.4% at 200, 14.6% at 300 and 14.7% at 400 on an
      AMD EPYC Zen 4), and on CI's machine it had reached only 13.0% at step 300, below the
      1.5x-unigram line (13.1%); the extra 100 steps leave room for a later exit. At 400 steps on
      a 2-core AMD EPYC with native bf16: 15.2% in bf16 (52 s), 15.0% in fp32 (93 s), against a
      unigram accuracy of 8.75%;
    - onebit20: 1-bit LAMB, eager, 20 steps: warmup to step 10, then the compression stage;
      every step logged (the bf16 run is compared step by step after the freeze); on shares 1 : 3
      (UNEQUAL), as its bf16 mode case and the compiled run;
    - zero1_fp32: AdamW under ZeRO-1 in fp32, micro-batch 16 x accumulation 2, dynamic masking,
      10 steps (ZeRO-2 in bf16 against it: test_training_paths.py);
    - bucketwise_fp32: bucket-wise clipping in fp32, 10 steps, micro-batch 16 × accumulation 2 dealt
      1 : 3 (UNEQUAL), as its bf16 mode case."""
    from commodity_bert.optim.precision import native_cpu_bf16
    precision = "bf16" if native_cpu_bf16() else "fp32"  # as recipes/quickstart.sh picks
    root = tmp_path_factory.mktemp("reference")
    run_cli("shards", "--input", sotu_small, "--vocab", sotu_vocab, "--seq-len", 64, "--no-nsp",
            "--masking", "static", "--dupe-factor", 1, "--num-shards", 4, "--val-fraction", 0.05, "--workers", 2,
            "--output", root / "healthy_seq64")
    zero1 = config_file(root, "cpu_tiny_adamw_zero2_bf16.json", **{
        "zero_optimization.stage": 1, "bf16.enabled": False, "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 2})
    tiny = ["--model", "tiny", "--num-workers", 1]
    launches = {
        "healthy": ["--deepspeed_config", REPO / "ds_configs" / f"cpu_quickstart_lamb_{precision}.json", *tiny,
                    "--data", root / "healthy_seq64", "--max-steps", 400, "--log-every", 100, "--eval-every", 400,
                    "--plateau-check-samples", 15000],
        "run30": [*COMMON, "--data", train_data, "--max-steps", 30, "--eval-every", 15, "--save-every", 10,
                  "--keep-checkpoints", 2],
        "onebit20": [*onebit_unequal(root), "--data", train_data, "--max-steps", 20, "--log-every", 1],
        "zero1_fp32": ["--deepspeed_config", zero1, *tiny, "--data", dynamic_data, "--max-steps", 10, "--log-every", 1],
        "bucketwise_fp32": ["--deepspeed_config", config_file(root, "cpu_tiny_lamb_bucketwise_clip.json", **UNEQUAL),
                            *tiny, "--data", train_data, "--max-steps", 10, "--log-every", 1],
    }
    runs = {name: root / name for name in launches}
    procs = side_by_side([[*args, "--output-dir", runs[name]] for name, args in launches.items()])
    for proc in procs:
        checked(proc)
    (runs["healthy"] / "stdout.log").write_text(procs[0].stdout)
    return runs


@pytest.fixture(scope="session")
def run30(reference_runs):
    return reference_runs["run30"]


@pytest.fixture(scope="session")
def healthy_run(reference_runs):
    return reference_runs["healthy"]


@pytest.fixture(scope="session")
def onebit20(reference_runs):
    return reference_runs["onebit20"]


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Two hosts of 1 slot each in network namespaces (tools/netns_cluster.py), shared by the
    multi-host tests; skipped, with the reason, where they cannot be made (not root, no sshd)."""
    sys.path.insert(0, str(REPO))
    from tools.netns_cluster import Cluster, unavailable_reason
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-host tests: {reason}")
    cluster = Cluster.up(tmp_path_factory.mktemp("cluster"), hosts=2, slots=1)
    try:
        yield cluster
    finally:
        cluster.down()


# ---- configs changed for a test, and runs as if killed after a checkpoint

def changed(config: dict, changes: dict) -> dict:
    """`config` with each dotted key of `changes` set (in place)."""
    for dotted, value in changes.items():
        node = config
        *path, last = dotted.split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return config


def config_file(tmp_dir, name: str, **changes) -> str:
    config = changed(json.loads((REPO / "ds_configs" / name).read_text()), changes)
    out = tmp_dir / f"{name.removesuffix('.json')}_{abs(hash(json.dumps(changes, sort_keys=True)))}.json"
    out.write_text(json.dumps(config))
    return str(out)


def crashed_after(whole, step: int, pieces):
    """`pieces` as if its run had died after `whole`'s checkpoint of `step` and one more logged
    row: that checkpoint and nothing later, the metrics history up to that row, and a line torn
    in the middle of its writing (the relaunch drops what came after the checkpoint)."""
    tag = f"step_{step:08d}"
    (pieces / "checkpoints").mkdir(parents=True)
    # linked, not copied (a mode's checkpoint is up to 95 MB): a save writes new files, never into old ones
    shutil.copytree(whole / "checkpoints" / tag, pieces / "checkpoints" / tag, copy_function=os.link)
    (pieces / "checkpoints" / "latest").write_text(tag)
    history = []
    for line in (whole / "metrics.jsonl").read_text().splitlines():
        history.append(line)
        if json.loads(line)["step"] > step:
            break
    (pieces / "metrics.jsonl").write_text("\n".join(history) + '\n{"step": ' + str(step + 2) + ', "lo')
    return pieces


def relaunched(proc, whole, pieces, step: int) -> None:
    """`pieces`, relaunched by `proc`, resumed from `step` and now holds `whole`'s history. Its rows
    up to `step` come from a launch of their own, so this also holds two launches of the same run
    on the same shards to identical losses (the suite's shards and vocabulary are the same bytes
    every session: data_prep/wordpiece_trainer.py)."""
    assert f"resuming from {pieces / 'checkpoints' / f'step_{step:08d}'} at step {step}" in proc.stdout, proc.stdout
    keys = ("step", "samples", "loss", "mlm_acc", "grad_norm", "loss_scale", "lr", "bytes_sent", "comm_rounds",
            "val_mlm_acc", "val_loss", "sparse_sent_share")
    assert [[r.get(k) for k in keys] for r in rows(pieces)] == [[r.get(k) for k in keys] for r in rows(whole)]


@pytest.fixture(scope="session")
def dynamic_data(tmp_path_factory, sotu_small, sotu_vocab):
    """train_data's text with dynamic masking: masks drawn per batch at training time."""
    out = tmp_path_factory.mktemp("dynamic") / "seq64"
    run_cli("shards", "--input", sotu_small, "--vocab", sotu_vocab, "--seq-len", 64, "--dupe-factor", 1,
            "--num-shards", 4, "--masking", "dynamic", "--val-fraction", 0.05, "--workers", 2, "--output", out)
    return out


# ---- one run of each communication mode in bf16, and its relaunch after a mid-run checkpoint:
# the conformance test (test_comm_modes.py) and the modes' own tests (test_training_paths.py)


class ModeCase(NamedTuple):
    mode: str                     # what comm_mode.select names
    config: str                   # a shipped config, in bf16, with `changes`
    changes: dict
    steps: int
    resume_at: int                # the checkpoint the relaunch resumes from
    eval_every: int
    fields: tuple = ()            # in every logged row
    refused: tuple | None = None  # (a change the mode refuses, the phrase of its refusal)
    data: str = "train_data"      # the fixture of its shards


ACCUMULATION = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2}
# ranks of unequal speed (train/balance.py): rank 1 trains 3 of the step's 4 micro-batches, one of
# them rank 0's; the modes below train on these shares, and resume on them bit for bit
UNEQUAL = {**ACCUMULATION, "commodity_bert.balance": {"split": "speed", "speeds": [1, 3]}}
MODE_CASES = {
    "allreduce": ModeCase("allreduce", "cpu_tiny_lamb.json", {}, 10, 5, 5),
    # DeepSpeed's CPU FusedAdam under ZeRO-2 with accumulation and dynamic masking: resumed at 5,
    # the runs drifted in the 6th digit from the second step on until DeepSpeed's β^t chain was
    # replayed (optim/cpu_adam_resume.py; β2^6 by pow differs from the chained product)
    "allreduce_zero2_adamw": ModeCase("allreduce", "cpu_tiny_adamw_zero2_bf16.json", ACCUMULATION, 10, 5, 5,
                                      data="dynamic_data"),
    "bucketwise_clipping": ModeCase("bucketwise_clipping", "cpu_tiny_lamb_bucketwise_clip.json", UNEQUAL, 10, 5, 5,
                                    ("rank_share",),
                                    ({"zero_optimization.stage": 1}, "bucket-wise clipping cannot run under ZeRO stage 1")),
    # the freeze after step 10: resumed before it, the run crosses it after the relaunch
    "onebit_lamb": ModeCase("onebit_lamb", "cpu_tiny_onebit_lamb.json", UNEQUAL, 15, 8, 8, ("onebit_frozen", "rank_share"),
                            ({"zero_optimization.stage": 1}, "OneBitLamb cannot run under ZeRO stage 1")),
    # variance frozen after step 12; step 21 is a local step (ranks apart), step 24 a sync
    "zero_one_adam": ModeCase("zero_one_adam", "cpu_tiny_zero_one_adam.json", UNEQUAL, 24, 21, 7,
                              ("variance_frozen", "local_step_interval", "rank_share"),
                              ({"zero_optimization.stage": 1}, "ZeroOneAdam cannot run under ZeRO stage 1")),
    # rounds of 10 inner steps of 2 micro-batches: step 15 is in the middle of round 2; evaluations
    # every 5 steps, two of them mid-round; the last step ends a round
    "diloco": ModeCase("diloco", "cpu_tiny_diloco_lamb.json", UNEQUAL, 20, 15, 5, ("outer_rounds", "rank_share"),
                       ({"commodity_bert.bucketwise_clipping": {"enabled": True}},
                        "DiLoCo and bucket-wise clipping cannot be combined")),
    # Streaming DiLoCo: 2 fragments (round ends at 3, 6, 9, 12), each exchange behind 2 inner steps,
    # int4 with stochastic rounding and error feedback: the checkpoint at 7 waits for the update of
    # step 6, due at 8, and the relaunch must apply it there; an evaluation at 7 while it is in flight
    "diloco_streaming": ModeCase("diloco", "cpu_tiny_diloco_lamb.json", {
        **UNEQUAL, "commodity_bert.diloco.inner_steps": 6, "commodity_bert.diloco.fragments": 2,
        "commodity_bert.diloco.overlap_steps": 2, "commodity_bert.diloco.compression": "int4",
        "commodity_bert.diloco.rounding": "stochastic", "commodity_bert.diloco.error_feedback": True},
        14, 7, 7, ("outer_rounds",),
        ({"commodity_bert.diloco.overlap_steps": 10}, "diloco overlap_steps 10: give 0 to 9")),
    # sparse pseudo-gradients (the top 5% of each chunk in 2 bits, its residual kept), streamed in 2
    # fragments (round ends at 2, 4, 6, 8, 10), each exchange behind 2 inner steps: the checkpoint at 5
    # waits for the update of step 4, due at 6; the relaunch must carry each rank's residual
    "diloco_sparse": ModeCase("diloco", "cpu_tiny_diloco_lamb.json", {
        **UNEQUAL, "commodity_bert.diloco.inner_steps": 4, "commodity_bert.diloco.fragments": 2,
        "commodity_bert.diloco.overlap_steps": 2, "commodity_bert.diloco.compression": "sparse",
        "commodity_bert.diloco.density": 0.05, "commodity_bert.diloco.error_feedback": True},
        10, 5, 5, ("outer_rounds", "sparse_exchange", "sparse_sent_share"),
        ({"commodity_bert.diloco.compression": "sparse"}, "diloco compression sparse keeps what it does not send")),
    # DiLoCo after 6 data-parallel warm-up steps, rounds of 3 (ends at 9, and 10, the last step):
    # the checkpoint at 5 is mid-warm-up; test_training_paths.py compares its warm-up with the
    # allreduce case's steps (the same config but for the diloco block, evaluated at 5 too)
    "diloco_warmup": ModeCase("diloco", "cpu_tiny_diloco_lamb.json", {
        "commodity_bert.diloco.inner_steps": 3, "commodity_bert.diloco.warmup_steps": 6}, 10, 5, 5, ("outer_rounds",),
        ({"commodity_bert.diloco.warmup_steps": -1}, "diloco warmup_steps -1: give 0 or more steps")),
}


def onebit_unequal(tmp_dir) -> list:
    """ONEBIT's arguments on shares 1 : 3 (UNEQUAL): the 1-bit LAMB runs compared with its mode case."""
    return ["--deepspeed_config", config_file(tmp_dir, "cpu_tiny_onebit_lamb.json", **UNEQUAL), *ONEBIT[2:]]


class ModeRun(NamedTuple):
    config: str     # the config file both runs used
    data: Path
    whole: Path     # the uninterrupted run
    pieces: Path    # killed after the checkpoint of `resume_at` and relaunched
    relaunch: subprocess.CompletedProcess


def side_by_side(launches: list[list], at_once: int = 2) -> list[subprocess.CompletedProcess]:
    """train(2, *args) for each args in `launches`, `at_once` at a time, none checked: a run
    leaves a core idle while its ranks set up and wait on each other."""
    waiting, running, results = list(enumerate(launches)), {}, {}
    while waiting or running:
        while waiting and len(running) < at_once:
            index, args = waiting.pop(0)
            running[index] = ForkedRanks(2, *args)
        for index, ranks in list(running.items()):
            if (result := ranks.poll()) is not None:
                results[index] = result
                del running[index]
        time.sleep(0.05)
    return [results[i] for i in range(len(launches))]


def checked(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="session")
def mode_run(tmp_path_factory, request):
    """mode_run(name): MODE_CASES[name] trained on 2 ranks. The first call trains every case,
    two runs at a time."""
    done = {}

    def train_every_case():
        cases = {}
        for name, case in MODE_CASES.items():
            root = tmp_path_factory.mktemp(f"mode_{name}")
            data = request.getfixturevalue(case.data)
            config = config_file(root, case.config, **{"bf16.enabled": True, **case.changes})
            common = ["--deepspeed_config", config, "--model", "tiny", "--data", data, "--log-every", 1,
                      "--num-workers", 1, "--eval-every", case.eval_every, "--max-steps", case.steps,
                      "--save-every", case.resume_at]
            cases[name] = (config, data, root / "whole", root / "pieces", common)
        wholes = dict(zip(cases, side_by_side([[*c[4], "--output-dir", c[2]] for c in cases.values()])))
        relaunch = [name for name in cases if wholes[name].returncode == 0]
        for name in relaunch:
            crashed_after(cases[name][2], MODE_CASES[name].resume_at, cases[name][3])
        pieces = dict(zip(relaunch, side_by_side([[*cases[n][4], "--output-dir", cases[n][3]] for n in relaunch])))
        for name, (config, data, whole, piece, _) in cases.items():
            done[name] = (wholes[name], ModeRun(config, data, whole, piece, pieces.get(name)))
            if name in pieces and pieces[name].returncode == 0:  # no test reads them now: 1.5 GB in all
                for run in (whole, piece):
                    shutil.rmtree(run / "checkpoints", ignore_errors=True)

    def run(name: str) -> ModeRun:
        if not done:
            try:
                train_every_case()
            # raised again for every test, not trained again for each; BaseException: a test's
            # timeout (pytest-timeout's Failed) is one, and caught as Exception it trained anew
            except BaseException as error:
                done.update(dict.fromkeys(MODE_CASES, error))
                raise
        if isinstance(done[name], BaseException):
            raise done[name]
        whole, result = done[name]
        checked(whole)
        checked(result.relaunch)
        return result
    return run
