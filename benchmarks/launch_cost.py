"""What a launch costs before the ranks' own work: bert-launch of one rank that exits at once,
CPU-seconds of the whole tree (bert-launch, DeepSpeed's runner, launch.py, the rank) and wall
seconds, with DeepSpeed's runner in a fork of bert-launch (as it runs) and in a new interpreter (as
it runs where bert-launch has a second thread: forced here by one), median of several runs.

    python benchmarks/launch_cost.py --json benchmarks/results/DATE_launch_cost.json
"""
import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import cpu_name, free_port

REPO = Path(__file__).resolve().parents[1]
LAUNCH = "from commodity_bert.launch.launcher import main; import sys; sys.exit(main(sys.argv[1:]))"
CASES = {
    "runner forked": LAUNCH,
    "runner in a new interpreter": ("import threading, time; threading.Thread(target=time.sleep, args=(600,), "
                                    "daemon=True).start()\n" + LAUNCH),
}


def measure(code: str, rank: Path) -> tuple[float, float]:
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run([sys.executable, "-c", code, "--num_gpus", "1", "--master_port", str(free_port()), str(rank)],
                   cwd=REPO, check=True, capture_output=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    runs = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        rank = Path(tmp) / "rank.py"
        rank.write_text("import sys\n")
        for _ in range(args.runs):  # interleaved: a drift of the machine's speed hits both alike
            for name, code in CASES.items():
                runs[name].append(measure(code, rank))
    cases = {}
    for name, measured in runs.items():
        cases[name] = {"cpu_s": round(statistics.median(c for c, _ in measured), 2),
                       "wall_s": round(statistics.median(w for _, w in measured), 2),
                       "cpu_s_runs": [round(c, 2) for c, _ in measured], "wall_s_runs": [round(w, 2) for _, w in measured]}
        print(f"{name:30s} CPU {cases[name]['cpu_s']:.2f} s  wall {cases[name]['wall_s']:.2f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": cpu_name(), "command": " ".join(sys.argv), "runs": args.runs,
                                         "cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
