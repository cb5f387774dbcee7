"""Where a training rank's host memory goes: `mini`'s peak RSS taken apart by measuring each part.

A `mini` rank (11M parameters) peaked at 3.6-3.9 GB of host memory (summary.json
`peak_rss_mb`) where the parameters, gradients and AdamW state in fp32 are ~180 MB. This runs
train.py on 2 local ranks for a few steps under one change at a time and reports each rank's
peak RSS (VmHWM, polled from /proc by training_memory.RankPeaks), so the differences attribute
the peak:

- imports: a process that only imports what train.py imports (torch, deepspeed, transformers,
  the project) and builds nothing;
- set-up: train.py for 1 step (model, DeepSpeed engine, loader, first batch);
- activations: micro-batch 32 against 8 (the autograd graph scales with the batch);
- precision: bf16 against fp32 (DeepSpeed's bf16 wrapper keeps fp32 master copies beside the
  bf16 weights);
- the allocator: glibc's per-thread arenas (MALLOC_ARENA_MAX=2), and its dynamic mmap threshold
  (which rises to 32 MB after the first large free, so activation-sized blocks then come from the
  brk heap, which fragments and is rarely returned: MALLOC_MMAP_THRESHOLD_=131072 pins it),
  against the default;
- the model: `tiny` (2 x 128, same vocabulary) in the same set-up.

    python benchmarks/rank_memory.py --data SHARDS [--steps 120] [--variants 7] [--repo DIR] [--json OUT]
    python benchmarks/rank_memory.py --data SHARDS --baseline DIR [--repeats 2] [--env KEY=VALUE]
        [--side-args 'TRAIN_ARGS'] [--json OUT]

`--baseline DIR` runs the first variant from DIR's train.py and from this checkout's (`--repo`),
alternately, `--repeats` times each, and prints the median peak RSS and sequences/s of each: how
a change to train.py, or `--env` or `--side-args` on this checkout's side, moves a rank's memory and speed (with
the mmap threshold pinned at 128 KiB it measured 1.6 against 2.7 GB, at 36 against 55 sequences/s: RESULTS.md).

SHARDS: seq-128 shards with BERT's 30,522-token vocabulary (e.g. benchmarks/studies/mini_100k's).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import REPO
from training_memory import train

CONFIG = REPO / "ds_configs" / "cpu_mini_adamw_bf16.json"
IMPORTS = """
import torch, deepspeed, transformers, h5py, numpy
import commodity_bert.model.bert, commodity_bert.data.loader, commodity_bert.optim.build
print(int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024)
"""


def config_with(work: Path, name: str, **changes) -> Path:
    config = json.loads(CONFIG.read_text())
    for key, value in changes.items():
        config[key] = value
    path = work / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--variants", type=int, default=7, help="run the first N variants of the list")
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout whose train.py runs the variants")
    p.add_argument("--baseline", type=Path, help="A/B the first variant against this checkout's train.py")
    p.add_argument("--repeats", type=int, default=2, help="runs per side with --baseline")
    p.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                   help="environment for this checkout's side of --baseline, e.g. MALLOC_MMAP_THRESHOLD_=131072")
    p.add_argument("--side-args", default="", metavar="'ARGS'",
                   help="train.py arguments for this checkout's side of --baseline, e.g. '--trim-host-memory-every 10'")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rank_memory_"))
    imports = float(subprocess.run([sys.executable, "-c", IMPORTS], cwd=args.repo, check=True, capture_output=True,
                                   text=True).stdout.split()[-1])
    print(f"imports only: {imports:.0f} MB", flush=True)
    variants = [  # name, model, steps, config, env
        ("mini, micro-batch 32, bf16", "mini", args.steps, CONFIG, {}),
        ("mini, set-up and 1 step", "mini", 1, CONFIG, {}),
        ("mini, MALLOC_MMAP_THRESHOLD_=131072", "mini", args.steps, CONFIG, {"MALLOC_MMAP_THRESHOLD_": "131072"}),
        ("mini, micro-batch 8", "mini", args.steps, config_with(work, "micro8", train_micro_batch_size_per_gpu=8), {}),
        ("mini, fp32", "mini", args.steps, config_with(work, "fp32", bf16={"enabled": False}), {}),
        ("tiny, micro-batch 32, bf16", "tiny", args.steps, CONFIG, {}),
        ("mini, MALLOC_ARENA_MAX=2", "mini", args.steps, CONFIG, {"MALLOC_ARENA_MAX": "2"}),
    ][:args.variants]
    # evaluations and checkpoints as a run has them (a third of the way and at the end); given after
    # train()'s own --eval-every 0 --save-every 0, they win (argparse keeps the last)
    every = ["--eval-every", str(max(args.steps // 3, 1)), "--save-every", str(max(args.steps // 3, 1))]
    runs = []
    if args.baseline:
        name, model, steps, config, env = variants[0]
        sides = {"baseline": args.baseline.resolve(), "this checkout": args.repo.resolve()}
        for repeat in range(args.repeats):
            for side, repo in sides.items():
                side_env = {**env, **dict(kv.split("=", 1) for kv in args.env)} if side == "this checkout" else env
                side_args = args.side_args.split() if side == "this checkout" else []
                measured = train(repo, args.data, work / f"{side.replace(' ', '_')}_{repeat}", steps, every + side_args,
                                 model=model, config=config, env=side_env)
                runs.append({"variant": name, "side": side, "repo": str(repo), "repeat": repeat, **measured})
                print(f"{side} ({repo}), {name}: peak {max(measured['rank_peak_rss_mb']):.0f} MB, "
                      f"{measured['seq_per_s']:.1f} seq/s", flush=True)
        for side in sides:
            mine = [r for r in runs if r["side"] == side]
            print(f"{side}: median peak RSS {statistics.median(max(r['rank_peak_rss_mb']) for r in mine):.0f} MB, "
                  f"median {statistics.median(r['seq_per_s'] for r in mine):.1f} seq/s over {len(mine)} runs")
    for name, model, steps, config, env in [] if args.baseline else variants:
        measured = train(args.repo.resolve(), args.data, work / name.replace(" ", "_").replace(",", ""), steps, every,
                         model=model, config=config, env=env)
        runs.append({"variant": name, "model": model, "steps": steps, "env": env, "repo": str(args.repo), **measured})
        line = max(measured["rank_rss_timeline_mb"].values(), key=lambda points: max(mb for _, mb in points))
        quarters = [line[min(len(line) - 1, round(q * (len(line) - 1)))][1] for q in (0.25, 0.5, 0.75, 1.0)]
        print(f"{name}: rank peak RSS {max(measured['rank_peak_rss_mb']):.0f} MB "
              f"(ranks {', '.join(f'{mb:.0f}' for mb in measured['rank_peak_rss_mb'])}); RSS at 1/4, 1/2, 3/4, end "
              f"of the run {' / '.join(f'{mb:.0f}' for mb in quarters)} MB", flush=True)
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "command": " ".join(sys.argv), "imports_peak_rss_mb": imports, "runs": runs}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
