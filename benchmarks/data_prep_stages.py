"""Where `bert-data-prep shards` spends its time, stage by stage, in any checkout.

Runs the CLI in one process (`--workers 1`) under cProfile in the checkout given by `--repo`
and reports the cumulative seconds of each stage's function: sentence splitting
(`document_sentences`), tokenization (`_tokenize` less the splitting), instance building
(`nsp_instances`), records and static masking (`_to_records`), HDF5 writing (`write_shard`),
and the whole run. cProfile adds a cost per Python call, so Python-heavy stages read high;
compare checkouts with each other, and take wall times from data_prep_throughput.py.

    python benchmarks/data_prep_stages.py --input TEXT [--repo DIR] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROFILE = """
import cProfile, json, pstats, sys, time
from data_prep.cli import main
args = sys.argv[1:]
profile = cProfile.Profile()
started = time.perf_counter()
profile.enable()
try:
    main(args)
except SystemExit:
    pass
profile.disable()
wall = time.perf_counter() - started
stats = pstats.Stats(profile).stats
def cumulative(file_end, name):
    return sum(v[3] for (f, _, n), v in stats.items() if f.endswith(file_end) and n == name)
split = cumulative("data_prep/sentences.py", "document_sentences")
print(json.dumps({"profiled_wall_s": wall, "split_s": split,
                  "tokenize_s": cumulative("data_prep/pipeline.py", "_tokenize") - split,
                  "instances_s": cumulative("data_prep/instances.py", "nsp_instances"),
                  "records_and_masking_s": cumulative("data_prep/pipeline.py", "_to_records"),
                  "hdf5_write_s": cumulative("commodity_bert/data/shard_format.py", "write_shard")}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="a text file (one document per blank-line block)")
    p.add_argument("--repo", type=Path, default=REPO)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cli = ["shards", "--input", str(Path(args.input).resolve()), "--vocab", "embedded:bert-base-uncased",
               "--output", str(Path(tmp) / "ds"), "--seq-len", "128", "--dupe-factor", "5",
               "--max-predictions", "20", "--masking", "static", "--num-shards", "16", "--workers", "1"]
        out = subprocess.run([sys.executable, "-c", PROFILE, *cli], cwd=args.repo, check=True,
                             capture_output=True, text=True).stdout
    stages = json.loads(out.strip().splitlines()[-1])
    stages.update(repo=str(args.repo), input=str(args.input), input_mb=Path(args.input).stat().st_size / 1e6)
    for key, value in stages.items():
        print(f"{key:>24}  {value:.3f}" if isinstance(value, float) else f"{key:>24}  {value}")
    if args.json:
        args.json.write_text(json.dumps(stages, indent=1))


if __name__ == "__main__":
    main()
