"""bert-plan fit's memory model (commodity_bert/plan/memory.py) against measured bytes, and what it
says of each card.

1. activations: the model against the bytes autograd saves for backward in one forward
   (plan/memory_trace.py): real CPU tensors for tiny and mini (padded batches), meta tensors
   through the CUDA kernels' ops for base and large, bf16 and fp32, with and without dropout
2. state: the model against the live tensors of each rank at the end of a real run
   (summary.json's tensor_mb), every mode's tiny config in bf16 on 2 ranks (torchrun)
3. the fit of BERT-base and BERT-large at 128 and 512 on each card of plan/memory.py's table,
   8 ranks, the shipped LAMB configs

    python benchmarks/memory_model.py [--json OUT] [--markdown OUT.md] [--skip-runs]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from commodity_bert.model.bert import build_config  # noqa: E402
from commodity_bert.plan import memory_trace  # noqa: E402
from commodity_bert.plan.memory import GPUS, Setup, Shape, state_bytes  # noqa: E402

VOCAB = 30522
ACTIVATION_CASES = [  # model, sequences, width, dropout, device, profile, precision, real lengths
    ("tiny", 8, 128, 0.1, "cpu", "cpu", "bf16", [128, 120, 100, 90, 77, 64, 40, 12]),
    ("mini", 16, 128, 0.1, "cpu", "cpu", "bf16", None),
    ("mini", 4, 512, 0.0, "cpu", "cpu", "fp32", [512, 400, 300, 129]),
    ("base", 64, 128, 0.1, "meta", "cuda", "bf16", None),
    ("base", 8, 512, 0.1, "meta", "cuda", "bf16", None),
    ("base", 32, 128, 0.0, "meta", "cuda", "fp32", None),
    ("large", 32, 128, 0.1, "meta", "cuda", "bf16", None),
    ("large", 8, 512, 0.1, "meta", "cuda", "bf16", None),
]
STATE_CONFIGS = ["cpu_tiny_lamb.json", "cpu_tiny_lamb_bucketwise_clip.json", "cpu_tiny_onebit_lamb.json",
                 "cpu_tiny_zero_one_adam.json", "cpu_tiny_diloco_lamb.json", "cpu_tiny_adamw_zero2_bf16.json"]


def activations() -> list[dict]:
    rows = []
    for case in ACTIVATION_CASES:
        rows.append(memory_trace.traced_and_modelled(*case, nsp=True, vocab=VOCAB))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def data_dir(work: Path) -> Path:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from slow_network import prepare_data
    return prepare_data(work)


def state(work: Path) -> list[dict]:
    from commodity_bert.data.shard_format import load_manifest
    data = data_dir(work)
    manifest = load_manifest(data)
    shape = Shape.of(build_config("tiny", manifest["vocab"]["size"]), nsp=manifest["nsp"])
    torchrun = str(Path(sys.executable).parent / "torchrun")
    rows = []
    for name in STATE_CONFIGS:
        config = json.loads((REPO / "ds_configs" / name).read_text())
        config.setdefault("bf16", {})["enabled"] = True
        path = work / name
        path.write_text(json.dumps(config))
        run = work / f"run_{name.removesuffix('.json')}"
        subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", "29761", "train.py",
                        "--deepspeed_config", str(path), "--data", str(data), "--model", "tiny",
                        "--output-dir", str(run), "--max-steps", "25", "--eval-every", "0", "--save-every", "0",
                        "--save-every-minutes", "0", "--num-workers", "1", "--resume", "none"],
                       cwd=REPO, check=True, capture_output=True)
        held = json.loads((run / "summary.json").read_text())["tensor_mb"]
        parts = state_bytes(shape.params, Setup.of(config), world=2)
        rows.append({"config": name, "precision": "bf16", "ranks": 2, "params": shape.params,
                     "modelled_bytes": sum(parts.values()), "modelled": parts,
                     "held_bytes": [mb * 2**20 for mb in held]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def fits() -> list[dict]:
    from argparse import Namespace

    from commodity_bert.plan.fit import run
    rows = []
    for card in GPUS:
        for model in ("base", "large"):
            for seq_len in (128, 512):
                args = Namespace(gpu=card, gpu_mem=None, capability="8.0", model=model, seq_len=seq_len, config=None,
                                 nodes=1, gpus_per_node="8", vocab_size=VOCAB, json=None)
                rows.append(run(args))
    return rows


def markdown(result: dict) -> str:
    lines = ["| model | sequences × width (real tokens) | tensors, kernels | precision | dropout | saved (autograd) MiB "
             "| modelled MiB | error |", "|---|---|---|---|---:|---:|---:|---:|"]
    for r in result["activations"]:
        lines.append(f"| {r['model']} | {r['sequences']} × {r['width']} ({r['tokens']:,}) | {r['tensors']}, "
                     f"{r['kernels']} | {r['precision']} | {r['dropout']} | {r['traced_bytes'] / 2**20:,.2f} | "
                     f"{r['modelled_bytes'] / 2**20:,.2f} | {r['error']:+.3%} |")
    if result.get("state"):
        lines += ["", "| config (tiny, bf16, 2 ranks) | modelled MiB | held MiB (rank 0, rank 1) | held / modelled |",
                  "|---|---:|---:|---:|"]
        for r in result["state"]:
            held = ", ".join(f"{b / 2**20:.2f}" for b in r["held_bytes"])
            lines.append(f"| {r['config']} | {r['modelled_bytes'] / 2**20:.2f} | {held} | "
                         f"{max(r['held_bytes']) / r['modelled_bytes']:.4f} |")
    lines += ["", "| GPU | GiB | model | seq | precision | micro-batch | accumulation (8 ranks) | checkpointing "
              "| peak GiB | largest micro-batch that fits |", "|---|---:|---|---:|---|---:|---:|---|---:|---:|"]
    for r in result["fits"]:
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
        lines.append(f"| {r['gpu']} | {r['memory_gib']:.1f} | {r['model']} | {r['seq_len']} | {r['precision']} | "
                     f"{r['micro_batch'] or 'does not fit'} | {r['accumulation'] or '-'} | {r['checkpointing'] or '-'} "
                     f"| {peak} | {r.get('micro_fits_up_to') or '-'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--work")
    parser.add_argument("--skip-runs", action="store_true", help="leave out part 2 (the training runs)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="memory_model_"))
    work.mkdir(parents=True, exist_ok=True)
    result = {"activations": activations(), "state": [] if args.skip_runs else state(work), "fits": fits(),
              "machine": memory_trace_machine()}
    text = markdown(result)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def memory_trace_machine() -> str:
    from commodity_bert.host import device_name
    return device_name(torch.device("cpu"))


if __name__ == "__main__":
    main()
