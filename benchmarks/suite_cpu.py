"""Where a command's CPU goes, by kind of process: every process that ends while it runs, with its
CPU-seconds, from the kernel's process accounting (acct v3; needs root), each python process
named by the command line it was seen with. Why not the suite timeline's CPU column: it counts a
test's worker and the children it waited for, not Slurm's jobs, the ranks that namespace hosts start
through ssh, daemons, nor which process of a launch took the time.

    python benchmarks/suite_cpu.py --json benchmarks/results/DATE_suite_cpu.json \
        [-- COMMAND ...]      # default: the README's suite command

A python process's kind comes from /proc/PID/cmdline, read every 0.5 s while the command runs; a
process that lived less than that, or a fork that kept its parent's command line (train.py ranks
forked by a test, loader workers), is named by its parent where it can be.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_common import cpu_name

REPO = Path(__file__).resolve().parents[1]
SUITE = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
ACCT_V3 = struct.Struct("<BBHIIIIIIfHHHHHHHH16s")  # linux/acct.h, struct acct_v3
TICKS = 100  # AHZ
KINDS = [  # (kind, pattern in the command line); the first that matches
    ("train.py rank (launched)", r"train\.py.*--local_rank"),
    ("DeepSpeed per-node launcher", r"-m deepspeed\.launcher\.launch\b"),
    ("DeepSpeed runner", r"bin/deepspeed |deepspeed\.launcher\.runner"),
    ("torchrun", r"bin/torchrun |torch\.distributed\.run"),
    ("bert-launch", r"bin/bert-launch |-m commodity_bert\.launch\b"),
    ("bert-finetune", r"bin/bert-finetune |-m commodity_bert\.finetune\b"),
    ("bert-data-prep", r"bin/bert-data-prep |-m data_prep\b"),
    ("bert-plan", r"bin/bert-plan |-m commodity_bert\.plan\b"),
    ("bert-ablate", r"bin/bert-ablate |-m commodity_bert\.ablate\b"),
    ("inductor compile worker", r"_inductor/compile_worker"),
    ("benchmark script", r"python3?\S* (-u )?\S*benchmarks/\S+\.py"),
    ("pytest, its workers and their forks", r"-m pytest\b|exec\(eval\(sys\.stdin"),
]


def comp(value: int) -> float:
    """comp_t: 13-bit mantissa, 3-bit base-8 exponent, in clock ticks."""
    return (value & 0x1FFF) << (((value >> 13) & 7) * 3)


def read_accounting(path: Path) -> list[dict]:
    data, rows = path.read_bytes(), []
    for offset in range(0, len(data) - ACCT_V3.size + 1, ACCT_V3.size):
        f = ACCT_V3.unpack_from(data, offset)
        if f[1] & 0x0F != 3:
            continue
        rows.append({"pid": f[6], "ppid": f[7], "start": f[8], "wall_s": f[9] / TICKS,
                     "cpu_s": (comp(f[10]) + comp(f[11])) / TICKS, "comm": f[18].split(b"\0")[0].decode(errors="replace")})
    return rows


class CommandLines(threading.Thread):
    """pid -> the last command line seen for it (a child between fork and exec shows its
    parent's), read from /proc every `every` seconds."""

    def __init__(self, every: float = 0.5):
        super().__init__(daemon=True)
        self.every, self.seen, self.done = every, {}, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for entry in os.scandir("/proc"):
                if entry.name.isdigit():
                    try:
                        raw = Path(entry.path, "cmdline").read_bytes()
                    except OSError:
                        continue
                    if raw:
                        self.seen[int(entry.name)] = raw.replace(b"\0", b" ").decode(errors="replace").strip()
            self.done.wait(self.every)


def kind_of(row: dict, cmdlines: dict, by_pid: dict) -> str:
    """The first KINDS pattern of the process's command line, else of the nearest ancestor's;
    "(a fork)" where it had none of its own or its parent's (a fork keeps it). By the command
    line, not the accounting's name, which is the name of the process's last thread to exit
    (gloo's, jemalloc's)."""
    own = cmdlines.get(row["pid"])
    if own is None and not row["comm"].startswith(("python", "pt_", "gloo", "jemalloc")):
        return row["comm"]
    if own is not None and not own.split()[0].split("/")[-1].startswith("python") and \
            not any(re.search(pattern, own) for _, pattern in KINDS):
        return own.split()[0].split("/")[-1]
    forked = own is None or own == cmdlines.get(row["ppid"])
    pid, hops = row["pid"], 0
    while pid and hops < 6:
        for kind, pattern in KINDS:
            if re.search(pattern, cmdlines.get(pid, "")):
                return f"{kind} (a fork)" if forked else kind
        ancestor = by_pid.get(pid)
        pid, hops = (ancestor["ppid"] if ancestor else 0), hops + 1
    return "python, a fork" if forked else "python, other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the totals here")
    parser.add_argument("command", nargs="*", help="default: the suite (python -m pytest -q -p no:cacheprovider)")
    args = parser.parse_args()
    command = args.command or SUITE
    with tempfile.TemporaryDirectory() as tmp:
        accounting = Path(tmp) / "pacct"
        accounting.touch()
        subprocess.run(["accton", str(accounting)], check=True, capture_output=True)
        cmdlines = CommandLines()
        cmdlines.start()
        started = time.time()
        try:
            status = subprocess.run(command, cwd=REPO, check=False).returncode
        finally:
            wall = time.time() - started
            subprocess.run(["accton", "off"], check=False, capture_output=True)
            cmdlines.done.set()
        rows = read_accounting(accounting)
    by_pid = {r["pid"]: r for r in rows}
    for row in rows:
        row["cmdline"] = cmdlines.seen.get(row["pid"], "")[:300]
        row["kind"] = kind_of(row, cmdlines.seen, by_pid)
    totals = collections.defaultdict(lambda: {"processes": 0, "cpu_s": 0.0})
    for row in rows:
        total = totals[row["kind"]]
        total["processes"] += 1
        total["cpu_s"] += row["cpu_s"]
    ranked = dict(sorted(((k, {"processes": v["processes"], "cpu_s": round(v["cpu_s"], 1)}) for k, v in totals.items()),
                         key=lambda kv: -kv[1]["cpu_s"]))
    cpu = sum(v["cpu_s"] for v in ranked.values())
    print(f"{wall:.0f} s wall, {cpu:.0f} CPU-s in {len(rows)} processes that ended (status {status})")
    for kind, total in ranked.items():
        print(f"{total['cpu_s']:8.1f} CPU-s {total['processes']:6d}  {kind}")
    if args.json:
        args.json.write_text(json.dumps({"machine": cpu_name(), "command": " ".join(command), "status": status,
                                         "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "by_kind": ranked,
                                         "processes": [r for r in rows if r["cpu_s"] >= 0.1]},
                                        indent=1) + "\n")
    sys.exit(status)


if __name__ == "__main__":
    main()
