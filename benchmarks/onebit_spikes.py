"""The 1-bit LAMB test run of tests/test_training_paths.py in bf16 and fp32, its lr nudged by
±1%: where its compression stage spikes, and whether bf16 is the cause. The runs are the test's
own (its data, config and launcher, from tests/conftest.py), 20 steps on 2 ranks, every step
logged. Prints and writes, per run, the loss and gradient norm of steps 6-20 and the medians the
test compares (steps 6-10 against 11-15).

    python benchmarks/onebit_spikes.py [--json OUT] [--work DIR]
"""
from __future__ import annotations

import argparse
import json
import lzma
import platform
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import conftest as suite  # noqa: E402  the test's own data, config and launch

RUNS = [(precision, lr) for precision in ("bf16", "fp32") for lr in (0.0099, 0.01, 0.0101)]


def test_data(work: Path) -> Path:
    """The suite's train_data: the first 1.5 MB of the embedded addresses, its vocabulary, seq 64."""
    out = work / "seq64"
    if not (out / "manifest.json").exists():
        text = work / "sotu_small.txt"
        sotu = lzma.open(suite.EMBEDDED_SOTU, "rt", encoding="utf-8").read()
        text.write_text(suite.first_documents(sotu, 1_500_000))
        suite.run_cli("vocab", "--input", text, "--vocab-size", 8192, "--output", work / "vocab.txt")
        suite.run_cli("shards", "--input", text, "--vocab", work / "vocab.txt", "--seq-len", 64,
                      "--dupe-factor", 1, "--num-shards", 4, "--val-fraction", 0.05, "--workers", 2,
                      "--output", out)
    return out


def run(work: Path, data: Path, precision: str, lr: float) -> dict:
    changes = {"optimizer.params.lr": lr, "scheduler.params.warmup_max_lr": lr,
               "bf16.enabled": precision == "bf16"}
    config = suite.config_file(work, "cpu_tiny_onebit_lamb.json", **changes)
    out = work / f"{precision}_{lr}"
    suite.train(2, "--deepspeed_config", config, "--model", "tiny", "--data", data, "--log-every", 1,
                "--num-workers", 1, "--max-steps", 20, "--output-dir", out, "--resume", "none")
    history = {r["step"]: r for r in suite.rows(out) if "loss" in r}
    return {"precision": precision, "lr": lr,
            "loss": {s: history[s]["loss"] for s in range(6, 21)},
            "grad_norm": {s: history[s]["grad_norm"] for s in range(6, 21)},
            "median_6_10": statistics.median(history[s]["loss"] for s in range(6, 11)),
            "median_11_15": statistics.median(history[s]["loss"] for s in range(11, 16))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/onebit_spikes"))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    data = test_data(args.work)
    with ThreadPoolExecutor(2) as pool:  # two launches at a time, as the suite runs them
        results = list(pool.map(lambda r: run(args.work, data, *r), RUNS))
    for r in results:
        spikes = {s: round(g, 1) for s, g in r["grad_norm"].items() if g > 5}
        print(f"{r['precision']} lr {r['lr']}: median loss 6-10 {r['median_6_10']:.4f}, 11-15 "
              f"{r['median_11_15']:.4f}; steps with grad norm > 5: {spikes or 'none'}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "command": "python benchmarks/onebit_spikes.py",
                                         "runs": results}, indent=1))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


if __name__ == "__main__":
    main()
