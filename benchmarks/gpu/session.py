"""Every check the project runs on a GPU, in one command, in priority order, each part with its
own time cap.

GPU time is short and a GPU machine's start is slow, so the work is prepared here and rehearsed on
CPU in CI; the GPU machine only runs it. What the script needs from that machine: a copy of the
working tree with gpu_bundle/ beside it (64 MiB in all; `prepare` builds the bundle, `check` checks
it), the packages the bundle does not bring (bundle.py's DEVICE_PACKAGES), one command run under a
time limit (the plan takes at most 420 s; 560 s with --model-minutes), and the files it writes
under OUT copied back, each under 16 MiB.

    python benchmarks/gpu/session.py prepare          # here: gpu_bundle/ (wheels the device lacks + shards)
    bash benchmarks/gpu/session.sh                    # there: install from gpu_bundle/, then `run`
    bash benchmarks/gpu/session.sh --rehearse         # here: the same parts, tiny, seconds-long caps

The parts (`run` starts each as a child process of its own, killed at its cap; a child writes its
JSON after every cell, so a part cut short keeps what it measured, and `run` rewrites
OUT/session.json and appends to OUT/session.log after every part):

  a. correctness   LAMB, 1-bit LAMB, 0/1 Adam, DiLoCo int4 and bucket-wise clipping, each in fp32,
                   bf16 and fp16 (fp16 only on CUDA) on `tiny`, the same shards and seed, checked
                   against fp32 within the tolerances in TOLERANCES; a checkpoint resumed bit for bit;
                   the export loaded on the CPU. All cells are train.py's `main()` called in one
                   process, at world size 1: one GPU cannot host two NCCL ranks, and at world size 1
                   the compressed modes still run their arithmetic (compression, error feedback,
                   the frozen variance, the outer step) through NCCL's collectives.
  b. speed         benchmarks/throughput.py's measurement for BERT-base and -large at seq 128 in bf16:
                   padded against the project's path, tokens/s and MFU against a matmul peak timed in
                   the same process; the largest micro-batch that fits; activation checkpointing's
                   memory and time.
  profile          a profile of BERT-large's step on both paths (the device's time by kind of
                   kernel, the costliest kernels), so a missed MFU goal says where the time goes.
  c. model         `mini` pretrained for a fixed number of minutes (75 s; --model-minutes) on the
                   bundle's shards (--model-data: the State of the Union, or the prose corpus that
                   `prepare` builds where data_prep's corpus command has made it), its hf_model
                   packed into pieces under 16 MiB that come back from the device: fine-tune it on
                   CPU afterwards.
  d. fused_lamb    DeepSpeed's FusedLamb (a JIT build: TORCH_CUDA_ARCH_LIST=9.0) against the project's
                   LAMB: their curves on the same run (another formulation: optim/build.py) and one
                   optimizer step over BERT-large's parameters; last, since its build alone takes
                   most of a minute (--skip-fused-lamb).

Nothing here is a mock: the cells are real DeepSpeed engines on real shards of real text.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the device installs no project: its package is read from the tree (parts.py writes through it)
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from bundle import BUNDLE, check_bundle, prepare, project_needs_absent_on_device, say
from parts import run_part, write_json

PARTS = ("correctness", "speed", "profile", "model", "fused_lamb")
# seconds per part: on the GPU the plan, install included, fits in 7 minutes (420 s), short enough
# to run again after a failure; the rehearsal's are for 2 CPU cores. Each part's seconds on an
# H200 are in the raw data of benchmarks/RESULTS.md#gpu-precision, #gpu-step-profile and
# #gpu-mini-pretraining.
CAPS = {"gpu": {"install": 20, "correctness": 95, "speed": 100, "profile": 50, "model": 115, "fused_lamb": 40},
        "rehearse": {"install": 60, "correctness": 240, "speed": 90, "profile": 60, "model": 120, "fused_lamb": 10}}
PLAN_LIMIT_S = 420
EMULATED_BF16_CAP_FACTOR = 3
# --model-minutes M: a call of its own for a longer pretraining (the top of the gain curve); the
# part's cap grows with M, and the plan must fit a 600 s command with room for copying OUT back
CALL_LIMIT_S = 560
MODEL_OVERHEAD_S = 60  # the probe, the model's start, its evaluations and the packing (104 s for 75 s)


def run_plan(args) -> int:
    kind = "rehearse" if args.rehearse else "gpu"
    if args.model_minutes is not None and args.model_minutes <= 0:
        raise SystemExit(f"session.py: error: --model-minutes {args.model_minutes}: give a positive number")
    caps = dict(CAPS[kind])
    if kind == "rehearse":
        from commodity_bert.optim.precision import native_cpu_bf16
        if not native_cpu_bf16():
            # bf16 emulated (no AVX512_BF16 or AMX): its matmuls run 5-40x slower than fp32, and
            # the rehearsal checks the script, not the CPU
            caps = {p: s * EMULATED_BF16_CAP_FACTOR for p, s in caps.items()}
    if args.model_minutes:
        caps["model"] = round(args.model_minutes * 60 * 1.1 + 20 + MODEL_OVERHEAD_S)  # part_model's --time-budget, then the packing
    limit_s = CALL_LIMIT_S if args.model_minutes else PLAN_LIMIT_S
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    parts = [p for p in PARTS if not (p == "fused_lamb" and args.skip_fused_lamb) and (not args.only or p in args.only)]
    plan_s = caps["install"] + sum(caps[p] for p in parts)
    session = {"kind": kind, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
               "python": platform.python_version(), "install_s": args.install_s,
               "plan": {"caps_s": {"install": caps["install"], **{p: caps[p] for p in parts}}, "total_s": plan_s,
                        "limit_s": limit_s, "gpu_total_s": sum(CAPS["gpu"].values())},
               "bundle": check_bundle(Path(args.bundle)), "parts": {}}
    say(f"plan ({kind}): install {caps['install']} s, " + ", ".join(f"{p} {caps[p]} s" for p in parts) +
        f"; {plan_s} s in all" + (f" (limit {limit_s} s)" if kind == "gpu" else ""))
    if kind == "gpu" and plan_s > limit_s:  # the rehearsal's caps only guard a CPU's slow day
        raise SystemExit(f"session.py: error: the plan takes {plan_s} s, over {limit_s} s"
                         + ("; give a smaller --model-minutes or fewer parts (--only)" if args.model_minutes else ""))
    # part c's shards: --model-data's; else the session's own (the rehearsal's small ones there)
    model_data = Path(args.bundle) / args.model_data if args.model_data else (
        None if args.rehearse else Path(args.bundle) / "data")
    if "model" in parts and model_data is not None and not (model_data / "manifest.json").is_file():
        raise SystemExit(f"session.py: error: --model-data {args.model_data}: no shards in {model_data}; "
                         f"run: python benchmarks/gpu/session.py prepare")
    log = (out / "session.log").open("a")
    write_json(out / "session.json", session)
    for part in parts:
        started = time.perf_counter()
        result_file = work / f"{part}.json"
        data = Path(args.bundle) / ("rehearsal_data/shards" if args.rehearse else "data")
        if part == "model" and model_data is not None:
            data = model_data
        # a parent run without site (the rehearsal's stand-in for the device, where the project is
        # not installed) starts its children so too
        cmd = [sys.executable, *(["-S"] if sys.flags.no_site else []), str(Path(__file__).resolve()), "part", part,
               "--data", str(data),
               "--work", str(work / part), "--json", str(result_file), "--out", str(out)]
        if part == "model" and args.model_minutes:
            cmd += ["--model-minutes", str(args.model_minutes)]
        if args.rehearse:
            cmd.append("--rehearse")
        log.write(f"\n===== {part} (cap {caps[part]} s): {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = proc.wait(timeout=caps[part])
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = "cap"
        result = json.loads(result_file.read_text()) if result_file.exists() else {}
        result.update({"status": "ok" if status == 0 else "cut at its cap" if status == "cap" else f"exit {status}",
                       "seconds": round(time.perf_counter() - started, 1), "cap_s": caps[part]})
        session["parts"][part] = result
        write_json(out / "session.json", session)
        say(f"{part}: {result['status']} in {result['seconds']} s; " + summary_line(part, result))
    log.close()
    absent = set(project_needs_absent_on_device())
    imported = sorted(absent & {d for r in session["parts"].values() for d in r.get("distributions", [])})
    session["imports_absent_on_device"] = {"absent_on_device": sorted(absent), "imported": imported}
    write_json(out / "session.json", session)
    if imported:
        say(f"the parts imported {', '.join(imported)}, which the device lacks and the bundle leaves out")
    failed = [p for p, r in session["parts"].items() if r["status"] != "ok" or r.get("passed") is False]
    failed += ["imports"] if imported else []
    say("all parts ok" if not failed else f"not ok: {', '.join(failed)} (see session.json, session.log)")
    return 1 if failed else 0


def summary_line(part: str, result: dict) -> str:
    if part in ("correctness", "fused_lamb"):
        checks = result.get("checks", [])
        bad = [c["name"] for c in checks if not c["passed"]]
        return f"{len(checks) - len(bad)}/{len(checks)} checks passed" + (f"; failed: {', '.join(bad)}" if bad else "")
    if part == "speed":
        return "; ".join(f"{r['model']} {r['path']} mb {r['micro_batch']}: {r['tokens_per_s']:,.0f} tok/s, "
                         f"MFU {r['mfu']:.1%}" for r in result.get("rows", []))
    if part == "model":
        return f"{result.get('steps', '?')} steps, val MLM {result.get('val_mlm_acc', '?')}, pieces {result.get('pieces', [])}"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="build gpu_bundle/ here: the device's missing wheels and the shards")
    prep.add_argument("--bundle", default=str(BUNDLE))
    prep.add_argument("--corpus", help="also bundle shards of this prose corpus (a `bert-data-prep corpus` "
                      "directory, built there first if absent) as gpu_bundle/corpus, for --model-data corpus")
    check = sub.add_parser("check", help="is gpu_bundle/ complete, and does it fit beside the tree?")
    check.add_argument("--bundle", default=str(BUNDLE))
    plan = sub.add_parser("run", help="run the parts in order, each capped (session.sh calls this)")
    plan.add_argument("--out", default=os.environ.get("OUT", str(REPO / "runs" / "gpu_session")))
    plan.add_argument("--bundle", default=str(BUNDLE))
    plan.add_argument("--work", default="/tmp/gpu_session_work")
    plan.add_argument("--rehearse", action="store_true", help="the CPU's rehearsal: tiny sizes, no fp16")
    plan.add_argument("--skip-fused-lamb", action="store_true", help="leave out part d (FusedLamb's JIT build)")
    plan.add_argument("--only", nargs="+", choices=PARTS, help="run only these parts")
    plan.add_argument("--install-s", type=float, help="seconds the install took (session.sh)")
    plan.add_argument("--model-minutes", type=float, help="part c pretrains this long instead of the plan's "
                      "75 s (a call of its own: the plan then may take up to 560 s)")
    plan.add_argument("--model-data", help="part c's shards, a folder of the bundle (default: "
                      "data, the State of the Union; corpus: the prose corpus, where prepare built it)")
    part = sub.add_parser("part", help="one part, in this process (run starts these)")
    part.add_argument("part", choices=PARTS)
    for flag in ("--data", "--work", "--json", "--out"):
        part.add_argument(flag, required=True)
    part.add_argument("--rehearse", action="store_true")
    part.add_argument("--model-minutes", type=float)
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(Path(args.bundle), Path(args.corpus) if args.corpus else None)
    elif args.command == "check":
        print(json.dumps(check_bundle(Path(args.bundle)), indent=1))
    elif args.command == "run":
        sys.exit(run_plan(args))
    else:
        run_part(args)


if __name__ == "__main__":
    main()
