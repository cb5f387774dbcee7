"""`bert-plan rehearse`: the rehearsal of a training job, launched as the job is (its launcher,
hostfile or Slurm allocation) with `--module commodity_bert.plan rehearse` in place of `train.py`
and the job's own flags (config, data, output directory): STEPS steps of the job's exact
micro-batch with the accumulation shrunk to one (RunConfig.rehearsed), checking what would
otherwise fail only hours into the run:

- before a step: the interfaces reach the other hosts (preflight's check, before the first
  collective, which would hang); an allreduce of known values is exact on every rank (NCCL's
  peer-to-peer path on some PCIe consumer boards returns wrong sums); the memory model of
  `bert-plan fit` gives the micro-batch room on each rank's device (on a CPU, its share of the
  host's memory); every node can write the output directory; its disk holds the checkpoints
  the job keeps, by the memory model's count of their bytes;
- a straight run (RUN/rehearsal/): its checkpoints (one halfway) saved to the output directory,
  the loss falling, the export loaded with `from_pretrained`;
- a relaunch (train.py's main() again in the same processes: a fresh engine, loader and model)
  from the halfway checkpoint, read back by every node, whose next step's loss must equal the
  straight run's;
- the measured speed (step time, tokens a second, TFLOP/s a rank against each rank's measured
  matmul peak, and the days and GPU-hours it implies for the job's schedule at its accumulation),
  and each rank's peak memory against the model's;
then one table of pass/fail lines, each failure with its fix, in RUN/rehearsal/report.json too.
Its checkpoints and export are removed after: nothing that `--resume auto` in RUN would read
(RUN/checkpoints) is touched.

Why a rehearsal of our own and not DeepSpeed's or Slurm's: neither checks a relaunch's loss, the
export or the disk against the run to come; preflight (commodity_bert/plan/preflight.py)
measures links and compute but trains nothing of the job's.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from commodity_bert.host import atomic_write_text

REHEARSAL_DIR = "rehearsal"
DEFAULT_STEPS = 8
JOIN_S = 120.0  # how long every rank has to join
PLAN_MFU = 0.35  # bert-plan estimate's assumption unless --mfu
PROBE_BYTES = 1 << 20


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not reached, an earlier check failed
    detail: str
    fix: str = ""


# ---------------------------------------------------------------- checks before a step
def allreduce_exact(device: torch.device, dtypes: list[torch.dtype]) -> Check:
    """Every rank adds rank + 1 in each dtype, one element and a million: every element of the
    sum must be W(W+1)/2 exactly (whole numbers this small are exact in fp16 and bf16)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    want = world * (world + 1) / 2
    wrong = []
    for dtype in dtypes:
        for size in (1, (1 << 20) + 3):
            tensor = torch.full((size,), float(rank + 1), dtype=dtype, device=device)
            dist.all_reduce(tensor)
            bad = (tensor.float() != want).sum().item()
            if bad:
                wrong.append(f"{str(dtype).removeprefix('torch.')} × {size:,}: {bad:,} wrong, e.g. "
                             f"{tensor.float()[(tensor.float() != want).nonzero()[0]].item():g} for {want:g}")
    views = [None] * world
    dist.all_gather_object(views, (rank, socket.gethostname(), wrong))
    bad_ranks = [f"rank {r} on {h}: {'; '.join(w)}" for r, h, w in views if w]
    names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    if bad_ranks:
        return Check("allreduce", False, "; ".join(bad_ranks),
                     "NCCL's peer-to-peer path on PCIe consumer cards: NCCL_P2P_DISABLE=1 in every rank's "
                     "environment (docs/clusters.md), then rehearse again")
    return Check("allreduce", True, f"exact on all {world} ranks ({names}; 1 and 1,048,579 elements)")


def rank_memory_budget(device: torch.device) -> tuple[float, str]:
    """What one rank may use: its GPU's memory, or on a CPU its share of the host's."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory), torch.cuda.get_device_name(device)
    import psutil
    local = int(os.environ.get("LOCAL_SIZE", "1"))
    return psutil.virtual_memory().total / local, f"1/{local} of the host's memory"


def planned_memory(model_config, config, seq_len: int, device: torch.device, nsp: bool = True):
    """bert-plan fit's model of a rank's peak for this config's micro-batch (memory.py)."""
    from commodity_bert.comm.topology import Topology
    from commodity_bert.plan.memory import FRAGMENTATION, Batch, Memory, Setup, Shape, activation_bytes, \
        exchange_split, memory
    world = dist.get_world_size()
    slices, among = exchange_split(Topology.discover(), config)
    shape, setup = Shape.of(model_config, nsp=nsp), Setup.of(config)
    batch = Batch.full(int(config.micro_batch or 8), seq_len)
    need = memory(shape, batch, setup, world, slices, among)
    if device.type == "cuda":
        return need, need.total
    cpu = Memory(need.state, need.gradients, need.step_transient,
                 activation_bytes(shape, batch, setup.precision, setup.dropout, "cpu", setup.checkpointing), 0.0)
    return cpu, cpu.allocated * (1 + FRAGMENTATION)


def memory_before(model_config, config, seq_len: int, device: torch.device, nsp: bool = True) -> tuple[Check, float]:
    need, total = planned_memory(model_config, config, seq_len, device, nsp)
    budget, what = rank_memory_budget(device)
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (dist.get_rank(), socket.gethostname(), total, budget, what))
    short = [(r, h, t, b, w) for r, h, t, b, w in views if t > b]
    micro = int(config.micro_batch or 8)
    if short:
        r, h, t, b, w = short[0]
        return Check("memory plan", False,
                     f"micro-batch {micro}: rank {r} on {h} needs {t / 2**30:.1f} GiB by bert-plan fit's model, "
                     f"has {b / 2**30:.1f} ({w}){f', and {len(short) - 1} more rank(s)' if len(short) > 1 else ''}",
                     "a smaller train_micro_batch_size_per_gpu (bert-plan fit --config CONFIG says which fits), "
                     "activation checkpointing, or ZeRO 1/2"), total
    least = min(b - t for _, _, t, b, _ in views)
    return Check("memory plan", True, f"micro-batch {micro}: {total / 2**30:.2f} GiB a rank by the model, "
                 f"{least / 2**30:.1f} GiB to spare on the tightest rank"), total


def writable_everywhere(run_dir: Path) -> Check:
    """Every rank writes, syncs and reads back a file of its own in the output directory."""
    rank, host = dist.get_rank(), socket.gethostname()
    problem = None
    probe = run_dir / f".probe.{host}.{rank}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        data = os.urandom(PROBE_BYTES)
        with open(probe, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if probe.read_bytes() != data:
            problem = f"{probe} read back other bytes"
    except OSError as exc:
        problem = f"cannot write {run_dir} ({exc.strerror or exc})"
    finally:
        with contextlib.suppress(OSError):  # on a read-only file system even a missing file's unlink fails
            probe.unlink(missing_ok=True)
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (rank, host, problem))
    hosts = sorted({h for _, h, _ in views})
    bad = {}
    for r, h, p in views:
        if p:
            bad.setdefault(h, p)
    if bad:
        return Check("output directory", False, "; ".join(f"{h}: {p}" for h, p in bad.items()),
                     f"make {run_dir.parent} writable on {', '.join(bad)} (mounted read-write, owned by you), or give "
                     f"--output-dir a directory every node can write")
    return Check("output directory", True, f"{run_dir.parent} written and read back on {', '.join(hosts)}")


def disk_check(run_dir: Path, checkpoint_bytes: float, keep: int, export_bytes: float, measured: bool,
               already_used: float = 0.0) -> Check:
    """Free space on each node's output filesystem for `keep` checkpoints and the export.
    `already_used`: what the rehearsal itself holds there now (given back when it is removed)."""
    rank, host = dist.get_rank(), socket.gethostname()
    free = shutil.disk_usage(run_dir if run_dir.exists() else run_dir.parent).free + already_used
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (rank, host, free))
    need = checkpoint_bytes * keep + export_bytes
    short = {h: f for _, h, f in views if f < need}
    how = "measured" if measured else "by the memory model"
    detail = (f"{keep} checkpoint(s) of {checkpoint_bytes / 1e9:.2f} GB ({how}) and the export "
              f"{export_bytes / 1e9:.2f} GB need {need / 1e9:.2f} GB")
    if short:
        return Check("disk", False, f"{detail}; free: " + ", ".join(f"{h} {f / 1e9:.2f} GB" for h, f in short.items()),
                     f"free space there, keep fewer (--keep-checkpoints), or give --output-dir a larger disk")
    return Check("disk", True, f"{detail}; the least free is {min(f for _, _, f in views) / 1e9:.1f} GB")


# ---------------------------------------------------------------- after the runs
def loss_rows(run_dir: Path) -> dict[int, dict]:
    rows = {}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "loss" in row:
                rows[int(row["step"])] = row
    return rows


def export_loads(hf_model: Path) -> Check:
    """The export, as a user loads it (rank 0)."""
    try:
        from transformers import AutoModelForMaskedLM, AutoTokenizer
        model = AutoModelForMaskedLM.from_pretrained(hf_model)
        tokenizer = AutoTokenizer.from_pretrained(hf_model)
        encoded = tokenizer("a rehearsal", return_tensors="pt")
        with torch.no_grad():
            model(**encoded)
    except Exception as exc:  # noqa: BLE001 - whatever fails, the line says it
        return Check("export", False, f"{hf_model}: {type(exc).__name__}: {exc}",
                     "see the training's export lines above; rehearse again after the fix")
    return Check("export", True, f"{hf_model} loads with from_pretrained ({type(model).__name__}, "
                 f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters) and runs")


def speed_check(rows: dict[int, dict], device: torch.device, real_steps: int, accumulation: int,
                world: int, global_batch: int, precision: str) -> tuple[Check, dict]:
    """The step time of the rehearsal's later steps, its tokens a second and TFLOP/s a rank against
    each rank's matmul peak in the job's precision, and what it implies for the job's schedule at
    its accumulation."""
    from commodity_bert.plan.preflight import matmul_tflops
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.float32  # as preflight: a CPU has no fast fp16 matmul
    peak = matmul_tflops(device, dtype, 8192 if device.type == "cuda" else 1024)
    peaks = [None] * world
    dist.all_gather_object(peaks, (socket.gethostname(), peak))
    later = [row for step, row in sorted(rows.items()) if step > 2] or list(rows.values())
    if not later:
        return Check("speed", None, "no step was logged"), {}
    step_s = statistics.median(global_batch / row["seq_per_s"] for row in later)
    tflops = statistics.median(row["tflops"] for row in later) / world
    tokens = statistics.median(row["tokens_per_s"] for row in later)
    least_peak = min(p for _, p in peaks)
    mfu = tflops / least_peak if tflops and least_peak else None
    facts = {"step_s": step_s, "tokens_per_s": tokens, "tflops_per_rank": tflops,
             "matmul_peak_tflops": [{"host": h, "tflops": p} for h, p in peaks], "mfu": mfu}
    days = real_steps * accumulation * step_s / 86400  # at most: the rehearsal syncs after every micro-batch
    facts.update(job_days=days, job_gpu_hours=days * 24 * world)
    detail = (f"{step_s:.3g} s a step of one micro-batch a rank, {tokens:,.0f} tokens/s, {tflops:.3g} TFLOP/s a rank "
              f"= {mfu:.0%} of the slowest rank's matmul peak ({least_peak:.3g}; bert-plan assumes {PLAN_MFU:.0%}); "
              f"the job's {real_steps:,} steps × {accumulation} micro-batches: at most "
              f"{f'{days:.2f} days' if days >= 1 else f'{days * 24:.2g} hours'}, "
              f"{days * 24 * world:,.3g} {'GPU' if device.type == 'cuda' else 'rank'}-hours")
    if device.type == "cuda" and mfu is not None and mfu < PLAN_MFU / 2:
        return Check("speed", False, detail, "under half the plan's MFU: see data_wait_s in RUN/rehearsal/"
                     "metrics.jsonl (more --num-workers), the precision, and bert-plan preflight's slow ranks"), facts
    return Check("speed", True, detail), facts


def memory_after(summary: dict, planned: float, device: torch.device) -> Check:
    budget, what = rank_memory_budget(device)
    key = "peak_allocated_mb" if device.type == "cuda" else "peak_rss_mb"
    peaks = [p for p in summary.get(key, []) if p is not None]
    if not peaks:
        return Check("memory", None, "no peak recorded")
    worst = max(peaks) * 2**20
    rank = summary[key].index(max(peaks))
    detail = (f"peak {'allocated' if device.type == 'cuda' else 'resident'} {worst / 2**30:.2f} GiB (rank {rank} on "
              f"{summary['hosts'][rank]}) against {budget / 2**30:.1f} ({what}); the model said {planned / 2**30:.2f}")
    if worst > 0.95 * budget:
        return Check("memory", False, detail, "a smaller micro-batch or activation checkpointing (bert-plan fit)")
    return Check("memory", True, detail)


# ---------------------------------------------------------------- the table
def table(checks: list[Check]) -> list[str]:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        mark = {True: "pass", False: "FAIL", None: "----"}[c.ok]
        lines.append(f"{mark}  {c.name:<{width}}  {c.detail}" + (f"\n      {'':<{width}}  fix: {c.fix}" if c.fix else ""))
    return lines


def write_report(rehearsal_dir: Path, checks: list[Check], facts: dict) -> None:
    report = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "passed": all(c.ok for c in checks),
              "checks": [asdict(c) for c in checks], **facts}
    rehearsal_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(rehearsal_dir / "report.json", json.dumps(report, indent=1))


# ---------------------------------------------------------------- the rehearsal
def without_flags(argv: list[str], flags: dict[str, int]) -> list[str]:
    """argv less each of `flags` (name: how many values it takes)."""
    kept, i = [], 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name in flags:
            i += 1 + (0 if "=" in argv[i] else flags[name])
            continue
        kept.append(argv[i])
        i += 1
    return kept


def join(backend: str, timeout) -> None:
    """preflight's meeting, then the process group on its store: a host missing, or an interface
    that does not reach the others, is said in one line before the first collective, which would
    hang on it."""
    from commodity_bert.plan.preflight import check_interfaces, rendezvous
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    store = rendezvous(rank, world, JOIN_S)
    check_interfaces(store, rank, world, backend, JOIN_S)
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                            timeout=timeout)


def run(steps: int, train_argv: list[str]) -> int:
    """The rehearsal on this rank; its exit status (0: every line passed)."""
    from datetime import timedelta

    from commodity_bert.launcher_env import adopt_launcher_environment
    from commodity_bert.plan.memory import Setup, Shape, state_bytes
    from commodity_bert.run_dir import CHECKPOINTS, HF_MODEL, SUMMARY
    from commodity_bert.train import checkpoint
    from commodity_bert.train.checkpoint import directory_bytes
    try:
        import train  # the repository's train.py: the rehearsal runs its main()
    except ImportError:
        print("bert-plan rehearse: error: no train.py to import; launch it from the repository root, as the job",
              file=sys.stderr)
        return 2
    adopt_launcher_environment()
    steps = max(4, steps + steps % 2)
    argv = [a for a in train_argv if not a.startswith("--local_rank")] + [f"--local_rank={os.environ.get('LOCAL_RANK', 0)}"]
    args = train.parse_args(argv)
    here = Path(args.output_dir) / REHEARSAL_DIR
    join("nccl" if torch.cuda.is_available() else "gloo", timedelta(minutes=args.dist_timeout_minutes))
    device = train.join_the_ranks(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = train.check_inputs(args, device)
    say = train.say
    say(f"rehearsal: {steps} steps of micro-batch {inputs.batch.micro} on {world} rank(s), accumulation 1 "
        f"(the job's: {inputs.accumulation}), in {here}")
    if rank == 0 and here.exists():
        shutil.rmtree(here)  # an earlier rehearsal's: the rehearsal's own directory, never the run's
    dist.barrier()
    precision = inputs.config.precision
    dtypes = [torch.float32] + ([{"bf16": torch.bfloat16, "fp16": torch.float16}[precision]]
                                if precision in ("bf16", "fp16") and device.type == "cuda" else [])
    checks = [allreduce_exact(device, dtypes)]
    memory_check, planned = memory_before(inputs.model_config, inputs.config, inputs.data.manifest["seq_len"],
                                          device, inputs.data.nsp)
    checks += [memory_check, writable_everywhere(here)]
    params = Shape.of(inputs.model_config, nsp=inputs.data.nsp).params
    state = state_bytes(params, Setup.of(inputs.config), 1)
    estimate = sum(state.values()) + state["exchange"] * (world - 1)
    checks.append(disk_check(here, estimate, args.keep_checkpoints, params * 4, measured=False))
    facts = {"steps": steps, "world_size": world, "micro_batch": inputs.batch.micro,
             "job_accumulation": inputs.accumulation, "job_steps": inputs.max_steps}

    def finish() -> int:
        if rank == 0:
            say("rehearsal:", *table(checks))
            write_report(here, checks, facts)
        passed = all(c.ok for c in checks)
        say(f"rehearsal: {'passed' if passed else 'FAILED'}; {here / 'report.json'}")
        dist.barrier()
        train.release_process_group()
        return 0 if passed else 1

    if not all(c.ok for c in checks):
        checks += [Check(name, None, "not run: an earlier check failed")
                   for name in ("loss falling", "checkpoint", "relaunch", "export", "speed", "memory")]
        return finish()
    if rank == 0:
        here.mkdir(parents=True, exist_ok=True)
        atomic_write_text(here / "ds_config.json", json.dumps(inputs.config.rehearsed(steps), indent=1))
    dist.barrier()
    base = without_flags(argv, {"--watch-downstream": 1, "--time-budget": 1})
    quiet = ["--deepspeed_config", str(here / "ds_config.json"), "--save-every-minutes", "0", "--log-every", "1",
             "--eval-every", "0", "--eval-batches", "2", "--plateau-check-samples", "0"]
    half = steps // 2
    train.main([*base, *quiet, "--output-dir", str(here), "--resume", "none", "--max-steps", str(steps),
                "--save-every", str(half), "--keep-checkpoints", "2"])
    straight = loss_rows(here)
    first, last = straight[1]["loss"], statistics.median(straight[s]["loss"] for s in (steps - 1, steps))
    checks.append(Check("loss falling", last < first, f"{first:.4f} at step 1, {last:.4f} at steps {steps - 1}–{steps}",
                        "" if last < first else "check the rate and warm-up of the config and the data"))
    node_local = not checkpoint.storage_is_shared(here)
    tag = f"step_{half:08d}"
    sizes = [None] * world
    dist.all_gather_object(sizes, directory_bytes(here / CHECKPOINTS / tag))
    disk = disk_check(here, max(sizes), args.keep_checkpoints, directory_bytes(here / HF_MODEL), measured=True,
                      already_used=directory_bytes(here))
    checks.append(Check("checkpoint", disk.ok, f"{tag} in {here / CHECKPOINTS}"
                        f"{' on every node (node-local)' if node_local else ''}; " + disk.detail, disk.fix))
    exported = [export_loads(here / HF_MODEL) if rank == 0 else None]
    dist.broadcast_object_list(exported, src=0)
    if checkpoint.is_writer(node_local):  # the relaunch goes on from halfway, as a job requeued there would
        atomic_write_text(here / CHECKPOINTS / "latest", tag)
    dist.barrier()
    train.main([*base, *quiet, "--output-dir", str(here / "relaunch"), "--resume", str(here / CHECKPOINTS),
                "--max-steps", str(half + 1), "--save-every", "0", "--keep-checkpoints", "1"])
    again = loss_rows(here / "relaunch").get(half + 1, {}).get("loss")
    want = straight[half + 1]["loss"]
    same = again is not None and abs(again - want) <= 1e-6 * max(1.0, abs(want))
    checks.append(Check("relaunch", same, f"from {tag}, read back by all {world} ranks: step {half + 1}'s loss "
                        f"{again} against the straight run's {want}", "" if same else
                        f"a relaunch does not resume exactly: report it with {here} (metrics.jsonl of both runs)"))
    checks.append(exported[0])
    speed, measured = speed_check(straight, device, inputs.max_steps, inputs.accumulation, world,
                                  inputs.batch.micro * world, precision)
    summary = json.loads((here / SUMMARY).read_text())
    checks += [speed, memory_after(summary, planned, device)]
    facts.update(measured)
    if checkpoint.is_writer(node_local) or rank == 0:  # the big files go; the records stay
        for big in (here / CHECKPOINTS, here / HF_MODEL, here / "relaunch" / CHECKPOINTS, here / "relaunch" / HF_MODEL):
            shutil.rmtree(big, ignore_errors=True)
    dist.barrier()
    return finish()
