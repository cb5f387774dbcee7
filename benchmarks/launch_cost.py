"""What a launch costs before the ranks' own work: bert-launch of one rank that exits at once,
CPU-seconds of the whole tree (bert-launch, DeepSpeed's runner, launch.py, the rank) and wall
seconds, with DeepSpeed's runner in a fork of bert-launch (as it runs) and in a new interpreter (as
it runs where bert-launch has a second thread: forced here by one), median of several runs.

    python benchmarks/launch_cost.py --json benchmarks/results/DATE_launch_cost.json
"""
import argparse
import sys
import tempfile
from pathlib import Path

from bench_common import cpu_and_wall, free_port, medians, report

LAUNCH = "from commodity_bert.launch.launcher import main; import sys; sys.exit(main(sys.argv[1:]))"
CASES = {
    "runner forked": LAUNCH,
    "runner in a new interpreter": ("import threading, time; threading.Thread(target=time.sleep, args=(600,), "
                                    "daemon=True).start()\n" + LAUNCH),
}


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
                runs[name].append(cpu_and_wall([sys.executable, "-c", code, "--num_gpus", "1", "--master_port",
                                                str(free_port()), str(rank)]))
    report({name: medians(measured) for name, measured in runs.items()}, args.runs, args.json)


if __name__ == "__main__":
    main()
