"""What a launch costs before the ranks' own work: bert-launch of one rank that exits at once,
CPU-seconds of the whole tree (bert-launch, DeepSpeed's runner, launch.py, the rank) and wall
seconds, with DeepSpeed's runner and this host's launch.py in forks of bert-launch (as they run)
and each in a new interpreter (as they run where bert-launch has a second thread: forced here by
one), median of several runs; `--against DIR` adds bert-launch as a checkout of another commit
has it (`git worktree add DIR COMMIT`), forked as it runs there, interleaved with the rest.

    python benchmarks/launch_cost.py --json benchmarks/results/DATE_launch_cost.json [--against DIR]
"""
import argparse
import sys
import tempfile
from pathlib import Path

from bench_common import cpu_and_wall, free_port, medians, report

LAUNCH = "from commodity_bert.launch.launcher import main; import sys; sys.exit(main(sys.argv[1:]))"
CASES = {
    "forked": LAUNCH,
    "new interpreters": ("import threading, time; threading.Thread(target=time.sleep, args=(600,), "
                         "daemon=True).start()\n" + LAUNCH),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--against", type=Path, help="a checkout of another commit: its bert-launch as a case too")
    args = parser.parse_args()
    cases = dict(CASES)
    if args.against:
        cases[f"forked, {args.against.name}"] = f"import sys; sys.path.insert(0, {str(args.against.resolve())!r})\n" + LAUNCH
    runs = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as tmp:
        rank = Path(tmp) / "rank.py"
        rank.write_text("import sys\n")
        for _ in range(args.runs):  # interleaved: a drift of the machine's speed hits both alike
            for name, code in cases.items():
                runs[name].append(cpu_and_wall([sys.executable, "-c", code, "--num_gpus", "1", "--master_port",
                                                str(free_port()), str(rank)]))
    report({name: medians(measured) for name, measured in runs.items()}, args.runs, args.json)


if __name__ == "__main__":
    main()
