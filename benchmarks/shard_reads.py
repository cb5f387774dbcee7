"""Bytes a training rank reads from its shards in an epoch, at a shard count its world size does
not divide (default 256 shards on 10 ranks, the recipe page's cluster).

Each (dealing, rank) runs in its own process, which builds the rank's `TrainingBatches` (it checks
the sha256 of every shard it will read) and trains through epoch 0; what it read is the kernel's
count of bytes the process read over that span (/proc/self/io): `rchar`, every read, and
`read_bytes`, those the page cache did not hold (with `--drop-caches`, run as root, the cache is
emptied before each process, as on a node that has not read the data yet). "split" is the rule
before shards were dealt whole (every rank reads every shard and keeps every W-th sample); "whole"
is `rank_shares`'s rule (⌊n/W⌋ whole shards and the n mod W left over, split).

    python benchmarks/shard_reads.py [--shards 256] [--world 10] [--data DIR] [--drop-caches] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import REPO, cpu_name, make_shards  # noqa: E402

CORPUS = REPO / "data_prep" / "resources" / "sotu.txt.xz"


def io_counts() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"]), int(fields["read_bytes"])


def measure(data_dir: str, rank: int, world: int, micro_batch: int, dealing: str) -> dict:
    """In this process: bytes read building the rank's batches and training its epoch 0."""
    from commodity_bert.data.dataset import ShardSet
    from commodity_bert.data.loader import TrainingBatches

    data = ShardSet.open(data_dir)
    before = io_counts()
    batches = TrainingBatches(data, rank, world, micro_batch, seed=1, num_workers=0, dealing=dealing)
    trained = 0
    for _ in iter(batches):
        if batches.epoch:
            break
        trained += micro_batch
    after = io_counts()
    return {"rank": rank, "read_bytes": after[0] - before[0], "storage_read_bytes": after[1] - before[1],
            "samples_trained": trained,
            "shards_read": len({share.shard for share in batches.stream.shares[rank]})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=256)
    p.add_argument("--world", type=int, default=10)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--data", type=Path, help="shards to read (default: the embedded corpus at seq 128 in --shards "
                   "shards, made once under the temporary directory)")
    p.add_argument("--drop-caches", action="store_true", help="empty the page cache before each rank (root)")
    p.add_argument("--json", type=Path)
    p.add_argument("--child", nargs=2, metavar=("RANK", "DEALING"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(str(args.data), int(args.child[0]), args.world, args.micro_batch, args.child[1])))
        return
    data = args.data or make_shards(Path(tempfile.gettempdir()) / f"shard_reads_{args.shards}", str(CORPUS), 128,
                                    "--masking", "dynamic", "--no-nsp", "--num-shards", str(args.shards))
    manifest = json.loads((data / "manifest.json").read_text())
    shards = len(manifest["splits"]["train"]["shards"])
    on_disk = sum(path.stat().st_size for path in data.glob("shard_*.hdf5") if "val" not in path.name)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = {"cpu": cpu_name(), "caches_dropped": args.drop_caches, "shards": shards, "world": args.world, "micro_batch": args.micro_batch,
              "train_shard_bytes": on_disk, "data": str(data), "dealings": {}}
    for dealing in ("split", "whole"):
        rows = []
        for rank in range(args.world):
            if args.drop_caches:
                os.sync()
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
            proc = subprocess.run([sys.executable, __file__, "--data", str(data), "--world", str(args.world),
                                   "--micro-batch", str(args.micro_batch), "--child", str(rank), dealing],
                                  env=env, cwd=REPO, capture_output=True, text=True, check=True)
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        reads = [row["read_bytes"] for row in rows]
        storage = [row["storage_read_bytes"] for row in rows]
        result["dealings"][dealing] = rows
        print(f"{dealing:>5}: {min(row['shards_read'] for row in rows)}–{max(row['shards_read'] for row in rows)} "
              f"of {shards} shards a rank; read {min(reads) / 1e6:,.1f}–{max(reads) / 1e6:,.1f} MB a rank an epoch "
              f"({max(reads) / on_disk:.2f}× the training shards' {on_disk / 1e6:,.1f} MB), "
              f"{max(storage) / 1e6:,.1f} MB from storage; samples trained "
              f"{min(r['samples_trained'] for r in rows):,}–{max(r['samples_trained'] for r in rows):,} a rank",
              flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True, check=False).stdout.strip()
    result["commit"] = commit
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
