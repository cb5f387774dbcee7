"""What a process of the suite pays before its first line of work: the CPU and wall seconds of a
fresh interpreter's imports, each case in its own `python -c`, median of several runs. A
`train.py` rank is `import train`; DeepSpeed's per-node launcher is `deepspeed.launcher.launch`.

    python benchmarks/rank_imports.py --json benchmarks/results/DATE_rank_imports.json
"""
import argparse
import sys
from pathlib import Path

from bench_common import cpu_and_wall, medians, report

CASES = ["import torch", "import torch, deepspeed", "import torch, deepspeed, torch._dynamo, torch.distributed.tensor",
         "import transformers.models.bert.modeling_bert", "import train", "import deepspeed.launcher.launch"]


def measure(case: str, runs: int) -> dict:
    return medians([cpu_and_wall([sys.executable, "-c", case]) for _ in range(runs)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report({case: measure(case, args.runs) for case in CASES}, args.runs, args.json, width=70)


if __name__ == "__main__":
    main()
