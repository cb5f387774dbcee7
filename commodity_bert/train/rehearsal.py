"""The rehearsal of a training job: `train.py ... --rehearse [STEPS]` (the job's own command,
launcher, hostfile or Slurm allocation, config, data and output directory) trains STEPS steps of
the job's exact micro-batch with the accumulation shrunk to one, and checks what would otherwise
fail only hours into the run:

- before a step: the interfaces reach the other hosts (preflight's check, before the first
  collective, which would hang); an allreduce of known values is exact on every rank (NCCL's
  peer-to-peer path on some PCIe consumer boards returns wrong sums); the memory model of
  `bert-plan fit` gives the micro-batch room on each rank's device (on a CPU, its share of the
  host's memory); every node can write the output directory; its disk holds the checkpoints
  the job keeps, by the memory model's count of their bytes;
- a straight run (RUN/rehearsal/): its checkpoints (one halfway) saved to the output directory,
  the loss falling, the export loaded with `from_pretrained`;
- a relaunch (in the same processes: a fresh engine, loader and model) from the halfway
  checkpoint, read back by every node, whose next step's loss must equal the straight run's;
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
import copy
import json
import os
import shutil
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from commodity_bert.host import atomic_write_text

REHEARSAL_DIR = "rehearsal"
DEFAULT_STEPS = 8
PLAN_MFU = 0.35  # bert-plan estimate's assumption unless --mfu
PROBE_BYTES = 1 << 20


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not reached, an earlier check failed
    detail: str
    fix: str = ""


# ---------------------------------------------------------------- the rehearsal's config
def rehearsal_config(given: dict, steps: int) -> dict:
    """The job's config for `steps` steps: accumulation 1 (the global batch is the micro-batch on
    every rank), the schedule's warm-up and decay over the rehearsal's steps in the job's
    proportion, and the stages that start late (1-bit freeze, 0/1 Adam's variance freeze, DiLoCo
    rounds, head warm-up) within them, so that the rehearsal runs every kind of step the job will."""
    config = copy.deepcopy(given)
    config.pop("train_batch_size", None)
    config["gradient_accumulation_steps"] = 1
    quarter = max(1, steps // 4)
    params = config.get("scheduler", {}).get("params", {})
    total, warmup = params.get("total_num_steps"), params.get("warmup_num_steps")
    if total:
        params["total_num_steps"] = steps
    if warmup:
        params["warmup_num_steps"] = max(1, round(steps * warmup / total)) if total else quarter
    optimizer = config.get("optimizer", {}).get("params", {})
    if "freeze_step" in optimizer:
        optimizer["freeze_step"] = quarter
        optimizer.pop("freeze_max_step", None)
    if "var_freeze_step" in optimizer:
        optimizer["var_freeze_step"] = quarter
    project = config.get("commodity_bert", {})
    diloco = project.get("diloco")
    if isinstance(diloco, dict) and diloco.get("enabled", True):
        inner = max(2, quarter)
        diloco.update(inner_steps=inner, warmup_steps=0, fragments=min(diloco.get("fragments", 1), inner),
                      overlap_steps=min(diloco.get("overlap_steps", 0), inner - 1))
    if isinstance(project.get("head_warmup"), dict) and project["head_warmup"].get("steps"):
        project["head_warmup"]["steps"] = quarter
    return config


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


def host_memory_bytes() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def rank_memory_budget(device: torch.device) -> tuple[float, str]:
    """What one rank may use: its GPU's memory, or on a CPU its share of the host's."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory), torch.cuda.get_device_name(device)
    local = int(os.environ.get("LOCAL_SIZE", "1"))
    return host_memory_bytes() / local, f"1/{local} of the host's memory"


def planned_memory(model_config, config, seq_len: int, device: torch.device, nsp: bool = True):
    """bert-plan fit's model of a rank's peak for this config's micro-batch (memory.py)."""
    from commodity_bert.comm.topology import Topology, hierarchy_setting
    from commodity_bert.plan.memory import FRAGMENTATION, Batch, Memory, Setup, Shape, activation_bytes, memory
    world = dist.get_world_size()
    topology = Topology.discover()
    levels, _ = topology.choose(hierarchy_setting(config))
    slices, among = (min(topology.ranks_per_node), len(topology.nodes)) if levels else (1, world)
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


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


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
