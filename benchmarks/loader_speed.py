"""How fast the training loader makes batches, in one process: sequences/s of real shards.

A GPU that trains `mini` at its speed needs tens of thousands of sequences a second (an H200 at
30% of its peak: ~60k of seq 128), and the loader runs in the training process (`--num-workers
0`) or in a few workers beside it. This times the loader alone, without a model: `TrainingBatches`
over dynamic shards (gathers from the shards, masking, tensors), rank 0 of one, and, to say where
its time goes, `BatchMaker` alone on batches already in memory (the masking and the tensors).

`--repo DIR` imports the package from another checkout (e.g. a git worktree of an older commit),
so that before and after run on the same machine, alternately, with the same shards.

    python benchmarks/loader_speed.py [--micro-batch 256 4096] [--repeats 5] [--whole-word] [--repo DIR] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import REPO, cpu_name, make_shards  # noqa: E402

CORPUS = REPO / "data_prep" / "resources" / "sotu.txt.xz"


def measure(data_dir: str, micro_batch: int, batches: int, repeats: int) -> dict:
    """In this process (the package as imported): the loader's and the batch maker's seq/s."""
    import numpy as np

    from commodity_bert.data.dataset import ShardSet
    from commodity_bert.data.loader import BatchMaker, TrainingBatches, load_arrays
    from commodity_bert.data import shard_format as fmt
    from commodity_bert.data.vocab import Vocab

    data = ShardSet.open(data_dir)
    loader_rates, maker_rates = [], []
    for repeat in range(repeats):
        stream = iter(TrainingBatches(data, 0, 1, micro_batch, seed=repeat, num_workers=0))
        next(stream)  # the first round's shards are read here
        started = time.perf_counter()
        for _ in range(batches):
            next(stream)
        loader_rates.append(batches * micro_batch / (time.perf_counter() - started))

        arrays = load_arrays(fmt.shard_paths(data.path, data.manifest, "train")[:1])
        maker = BatchMaker(arrays, data.manifest, Vocab.load(data.vocab_path), seed=repeat, static=False)
        rng = np.random.default_rng(repeat)
        plans = [rng.choice(len(arrays["lengths"]), micro_batch, replace=micro_batch > len(arrays["lengths"]))
                 for _ in range(batches)]
        started = time.perf_counter()
        for i, indices in enumerate(plans):
            maker(indices, (0, 0, i))
        maker_rates.append(batches * micro_batch / (time.perf_counter() - started))
    return {"loader_seq_per_s": statistics.median(loader_rates), "loader_runs": loader_rates,
            "batch_maker_seq_per_s": statistics.median(maker_rates), "batch_maker_runs": maker_rates}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batch", type=int, nargs="+", default=[256, 4096])
    p.add_argument("--sequences", type=int, default=40_000, help="sequences timed per repeat (default %(default)s)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--whole-word", action="store_true", help="shards prepared for whole-word masking")
    p.add_argument("--data", type=Path, help="dynamic shards to read (default: the embedded corpus at seq 128, "
                   "made once under the temporary directory)")
    p.add_argument("--repo", type=Path, help="import the package from this checkout instead")
    p.add_argument("--json", type=Path)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:  # one measurement, in the process whose sys.path holds the chosen checkout
        print(json.dumps(measure(str(args.data), args.micro_batch[0], args.sequences // args.micro_batch[0],
                                 args.repeats)))
        return
    data = args.data or make_shards(Path(tempfile.gettempdir()) / f"loader_speed_seq128{'_ww' if args.whole_word else ''}",
                                    str(CORPUS), 128, "--masking", "dynamic", "--num-shards", "4",
                                    *(["--whole-word"] if args.whole_word else []))
    repo = (args.repo or REPO).resolve()
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    rows = []
    for micro_batch in args.micro_batch:
        proc = subprocess.run([sys.executable, __file__, "--child", "--data", str(data), "--micro-batch",
                               str(micro_batch), "--sequences", str(args.sequences), "--repeats", str(args.repeats)],
                              env=env, cwd=repo, capture_output=True, text=True, check=True)
        row = {"micro_batch": micro_batch, **json.loads(proc.stdout.strip().splitlines()[-1])}
        rows.append(row)
        print(f"micro-batch {micro_batch:>5}: loader {row['loader_seq_per_s']:>9,.0f} seq/s, "
              f"batch maker alone {row['batch_maker_seq_per_s']:>9,.0f} seq/s (median of {args.repeats})", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                            text=True, check=False).stdout.strip()
    result = {"cpu": cpu_name(), "threads": 1, "seq_len": 128, "whole_word": args.whole_word,
              "data": str(data), "repo": str(repo), "commit": commit, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
