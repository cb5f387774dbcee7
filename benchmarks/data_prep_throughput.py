"""Throughput and peak memory of `bert-data-prep shards` on real text.

For each worker count it runs the real CLI several times on the embedded corpus (decompressed
first, so MB/s counts text bytes) and prints the median wall time, MB/s and input tokens/s in
total and per worker, and the peak RSS of the largest process (main or worker). A second table
runs the corpus 1× and 2× with shards of the same size, to show that peak memory does not grow
with the corpus.

`--streamed` measures the peak memory of an `hf:json` input (load_dataset's json builder,
streamed) against the same documents given as a .jsonl file, the corpus 1×, 2× and 4× with shards
of the same size: a streamed input's memory must stay as flat as a file's.

`--baseline DIR` also runs the CLI of another checkout (e.g. a git worktree of an older commit)
on the same text, alternating with this one run by run, so that a machine whose speed drifts
(shared CPUs) drifts for both; it prints both and the speed-up. `--input FILE` measures a text
file of your own instead of the embedded corpus.

    python benchmarks/data_prep_throughput.py [--workers 1 2] [--repeats 3] [--baseline DIR] [--input FILE]
                                              [--streamed] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "data_prep" / "resources" / "sotu.txt.xz"


def run_once(inputs: list[Path], workers: int, extra: list[str], repo: Path = REPO,
             streamed: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ds"
        given = ["hf:json", "--hf-data-files", *map(str, inputs)] if streamed else list(map(str, inputs))
        cmd = [sys.executable, "-m", "data_prep", "shards", "--input", *given,
               "--output", str(out), "--workers", str(workers), *extra]
        with open(Path(tmp) / "stderr.log", "w+") as log:
            started = time.perf_counter()
            proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.DEVNULL, stderr=log)
            # wait4's usage covers the child and the workers it waited for: ru_maxrss is the
            # peak of the largest of them
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - started
            proc.returncode = os.waitstatus_to_exitcode(status)
            if proc.returncode != 0:
                log.seek(0)
                raise SystemExit(f"bert-data-prep failed:\n{log.read()}")
        manifest = json.loads((out / "manifest.json").read_text())
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024,
            "input_tokens": manifest["input"]["tokens"],
            "samples": sum(s["samples"] for s in manifest["splits"].values())}


def summary(inputs, workers, runs) -> dict:
    text_mb = sum(p.stat().st_size for p in inputs) / 1e6
    wall = statistics.median(r["wall_s"] for r in runs)
    tokens = runs[0]["input_tokens"]
    return {"workers": workers, "text_mb": text_mb, "runs": len(runs), "wall_s": wall,
            "mb_per_s": text_mb / wall, "mb_per_s_per_worker": text_mb / wall / workers,
            "tokens_per_s": tokens / wall, "tokens_per_s_per_worker": tokens / wall / workers,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "samples": runs[0]["samples"],
            "input_tokens": tokens}


def measure(inputs, workers, repeats, extra, streamed: bool = False) -> dict:
    return summary(inputs, workers, [run_once(inputs, workers, extra, streamed=streamed) for _ in range(repeats)])


def as_jsonl(text_file: Path, directory: Path, copies: int) -> list[Path]:
    """The corpus as .jsonl, one document (blank-line separated) per record, in `copies` files."""
    documents = [d for d in text_file.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    paths = []
    for copy in range(copies):
        path = directory / f"corpus_{copy}.jsonl"
        with open(path, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps({"text": d}) + "\n" for d in documents)
        paths.append(path)
    return paths


def streamed_memory(args, corpus: Path, extra: list[str], machine: str) -> None:
    workers = max(args.workers)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for copies in (1, 2, 4):
            files = as_jsonl(corpus, Path(tmp), copies)
            shards = extra + ["--num-shards", str(16 * copies)]
            for streamed in (False, True):
                rows.append(dict(measure(files, workers, args.repeats, shards, streamed),
                                 input="hf:json" if streamed else ".jsonl files", copies=copies))
    print(f"peak memory of bert-data-prep shards: the corpus as .jsonl files against the same files "
          f"through --input hf:json (streamed); {workers} worker(s), 16 shards per copy; max of "
          f"{args.repeats} runs; {machine}")
    print(f"{'input':>12} {'copies':>6} {'text MB':>7} {'samples':>9} {'wall s':>7} {'peak RSS MB':>11}")
    for r in rows:
        print(f"{r['input']:>12} {r['copies']:>6} {r['text_mb']:>7.1f} {r['samples']:>9,} {r['wall_s']:>7.2f} "
              f"{r['peak_rss_mb']:>11.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "command": " ".join(sys.argv),
                                               "streamed": rows}, indent=1))


def measure_against(inputs, workers, repeats, extra, baseline: Path) -> tuple[dict, dict]:
    """This checkout and `baseline`, alternating run by run."""
    runs: dict[Path, list] = {REPO: [], baseline: []}
    for _ in range(repeats):
        for repo in runs:
            runs[repo].append(run_once(inputs, workers, extra, repo))
    return summary(inputs, workers, runs[REPO]), summary(inputs, workers, runs[baseline])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--masking", default="static")
    parser.add_argument("--baseline", type=Path, help="a checkout to compare with, run by run")
    parser.add_argument("--input", type=Path, help="a text file instead of the embedded corpus")
    parser.add_argument("--streamed", action="store_true",
                        help="peak memory of hf:json against the same .jsonl files, the corpus 1×, 2×, 4×")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    extra = ["--seq-len", str(args.seq_len), "--masking", args.masking]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "sotu.txt"
        if args.input:
            corpus = args.input.resolve()
        else:
            corpus.write_bytes(lzma.decompress(CORPUS.read_bytes()))
        if args.baseline:
            compare(args, corpus, extra + ["--num-shards", "16"], machine)
            return
        if args.streamed:
            streamed_memory(args, corpus, extra, machine)
            return
        rows = [measure([corpus], w, args.repeats, extra + ["--num-shards", "16"]) for w in args.workers]
        workers = max(args.workers)
        scaling = [measure([corpus] * k, workers, args.repeats, extra + ["--num-shards", str(16 * k)])
                   for k in (1, 2)]
    print(f"bert-data-prep shards on the embedded corpus (sotu, {rows[0]['text_mb']:.1f} MB of text), "
          f"seq {args.seq_len}, {args.masking} masking, CLI defaults otherwise; median of "
          f"{args.repeats} runs; {machine}")
    print(f"{'workers':>7} {'wall s':>7} {'MB/s':>6} {'MB/s/worker':>11} {'tok/s':>9} "
          f"{'tok/s/worker':>12} {'peak RSS MB':>11}")
    for r in rows:
        print(f"{r['workers']:>7} {r['wall_s']:>7.2f} {r['mb_per_s']:>6.2f} {r['mb_per_s_per_worker']:>11.2f} "
              f"{r['tokens_per_s']:>9,.0f} {r['tokens_per_s_per_worker']:>12,.0f} {r['peak_rss_mb']:>11.0f}")
    print(f"\npeak memory vs corpus size ({workers} workers, 16 shards per copy of the corpus)")
    print(f"{'text MB':>7} {'samples':>9} {'wall s':>7} {'peak RSS MB':>11}")
    for r in scaling:
        print(f"{r['text_mb']:>7.1f} {r['samples']:>9,} {r['wall_s']:>7.2f} {r['peak_rss_mb']:>11.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows, "scaling": scaling}, indent=1))


def compare(args, corpus: Path, extra: list[str], machine: str) -> None:
    rows = []
    print(f"bert-data-prep shards on {corpus.name} ({corpus.stat().st_size / 1e6:.1f} MB): this checkout "
          f"against {args.baseline}, alternating; median of {args.repeats} runs each; {machine}")
    print(f"{'workers':>7} {'base s':>7} {'this s':>7} {'base MB/s/worker':>16} {'this MB/s/worker':>16} "
          f"{'speed-up':>8} {'base/this peak RSS MB':>21}")
    for workers in args.workers:
        this, base = measure_against([corpus], workers, args.repeats, extra, args.baseline.resolve())
        rows.append({"workers": workers, "this": this, "baseline": base, "speed_up": base["wall_s"] / this["wall_s"]})
        print(f"{workers:>7} {base['wall_s']:>7.2f} {this['wall_s']:>7.2f} {base['mb_per_s_per_worker']:>16.2f} "
              f"{this['mb_per_s_per_worker']:>16.2f} {rows[-1]['speed_up']:>7.2f}x "
              f"{base['peak_rss_mb']:>10.0f} / {this['peak_rss_mb']:.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "command": " ".join(sys.argv),
                                               "input": str(corpus), "baseline": str(args.baseline),
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
