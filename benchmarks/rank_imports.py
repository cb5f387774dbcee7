"""What a process of the suite pays before its first line of work: the CPU and wall seconds of a
fresh interpreter's imports, each case in its own `python -c`, median of several runs. A
`train.py` rank is `import train`; DeepSpeed's per-node launcher is `deepspeed.launcher.launch`.

    python benchmarks/rank_imports.py --json benchmarks/results/DATE_rank_imports.json
"""
import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_common import cpu_name

REPO = Path(__file__).resolve().parents[1]
CASES = ["import torch", "import torch, deepspeed", "import torch, deepspeed, torch._dynamo, torch.distributed.tensor",
         "import transformers.models.bert.modeling_bert", "import train", "import deepspeed.launcher.launch"]


def measure(case: str, runs: int) -> dict:
    cpu, wall = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", case], check=True, capture_output=True, cwd=REPO)
        wall.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return {"cpu_s": round(statistics.median(cpu), 2), "wall_s": round(statistics.median(wall), 2),
            "cpu_s_runs": [round(c, 2) for c in cpu]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cases = {}
    for case in CASES:
        cases[case] = measure(case, args.runs)
        print(f"{case:70s} CPU {cases[case]['cpu_s']:.2f} s  wall {cases[case]['wall_s']:.2f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": cpu_name(), "command": " ".join(sys.argv), "runs": args.runs,
                                         "cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
