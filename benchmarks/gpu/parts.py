"""The parts of a GPU session (session.py's docstring says what each checks and why), each run by
`session.py part NAME` in a process of its own, so that `run` can stop it at its cap. A part
writes its JSON after every cell (`Recorder`): one cut short keeps what it measured."""
from __future__ import annotations

import copy
import importlib.metadata
import io
import json
import os
import statistics
import sys
import tarfile
import time
import traceback
from pathlib import Path

from bench_common import single_rank_environment
from bundle import normalise

REPO = Path(__file__).resolve().parents[2]
OUT_FILE_MIB = 15  # pieces of the packed model: files of at most 16 MiB come back from the device

OPTIMIZERS = {  # name -> (shipped CPU config, what this check changes in it)
    "lamb": ("cpu_tiny_lamb.json", {"commodity_bert": {"lamb": {"implementation": "project"}}}),
    "onebit_lamb": ("cpu_tiny_onebit_lamb.json", {}),
    "zero_one_adam": ("cpu_tiny_zero_one_adam.json", {}),
    "diloco_int4": ("cpu_tiny_diloco_lamb.json", {"commodity_bert": {
        "lamb": {"implementation": "project"},
        "diloco": {"inner_steps": 10, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True,
                   "compression": "int4", "error_feedback": True}}}),
    "bucketwise_clip": ("cpu_tiny_lamb_bucketwise_clip.json", {"commodity_bert": {
        "lamb": {"implementation": "project"},
        "bucketwise_clipping": {"enabled": True, "bucket_mb": 1, "max_norm": 1.0}}}),
}
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
              "fp16": {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}}}
# A 16-bit run against fp32, same weights, data and seed:
#   step-1 loss: the same forward pass in lower precision;
#   step-1 gradient norm, as a ratio: a scale left in the gradients (65,536x once) fails it;
#   the median loss over the last third of the steps: learning kept on course;
#   1-bit LAMB instead: each of the 3 steps after its freeze (it spikes later, in fp32 too).
TOLERANCES = {"step1_loss": 0.05, "step1_grad_norm_ratio": 0.1, "late_loss": 0.1, "after_freeze": 0.02,
              "checkpointing": 1e-3}
LEARNED = 0.3  # fp32's late median loss at least this far below its step-1 loss (GPU sizes only)

SIZES = {  # the rehearsal runs every path of the plan, small
    "gpu": {"steps": 30, "resume_steps": 10, "correctness_micro_batch": None, "speed_models": ["base", "large"], "speed_micro_batch": 64,
            "speed_steps": 8, "speed_repeats": 2, "max_micro_batch": 4096, "mfu_micro_batch": 256,
            "small_model": "mini", "small_micro_batch": 4096, "small_steps": 2,
            "pretrain_model": "mini", "pretrain_micro_batch": 4096, "pretrain_minutes": 1.25, "probe_steps": 10,
            "pretrain_workers": 4},
    "rehearse": {"steps": 3, "resume_steps": 1, "correctness_micro_batch": 8, "speed_models": ["tiny"], "speed_micro_batch": 8,
                 "speed_steps": 2, "speed_repeats": 1, "max_micro_batch": 32, "mfu_micro_batch": 16,
                 "small_model": "tiny", "small_micro_batch": 16, "small_steps": 2,
                 "pretrain_model": "tiny", "pretrain_micro_batch": 16, "pretrain_minutes": 0.05, "probe_steps": 3,
                 "pretrain_workers": 1},
}


def write_json(path: Path, data: dict) -> None:
    from commodity_bert.host import atomic_write_text
    atomic_write_text(path, json.dumps(data, indent=1, default=str))


class Recorder:
    """The part's JSON, rewritten after every cell: a part killed at its cap keeps what it measured."""

    def __init__(self, path: Path, **fields):
        self.path, self.data = path, {**fields, "cells": [], "checks": []}

    def save(self) -> None:
        write_json(self.path, self.data)

    def check(self, name: str, value, limit, passed: bool) -> None:
        self.data["checks"].append({"name": name, "value": value, "limit": limit, "passed": bool(passed)})
        self.data["passed"] = all(c["passed"] for c in self.data["checks"])
        self.save()


def train_once(config: dict, work: Path, name: str, data: Path, model: str, steps: int, *extra: str) -> list[dict]:
    """train.py's main() in this process; its metrics.jsonl rows."""
    import train
    from commodity_bert.comm import bytes_counter
    config_path = work / f"{name}.json"
    config_path.write_text(json.dumps(config))
    run_dir = work / name
    argv = ["--deepspeed_config", str(config_path), "--data", str(data), "--model", model, "--output-dir",
            str(run_dir), "--max-steps", str(steps), "--log-every", "1", "--num-workers", "0",
            "--save-every-minutes", "0", "--plateau-check-samples", "0", "--seed", "1", *extra]
    try:
        train.main(argv)
    finally:
        while (counter := bytes_counter.installed()) is not None:  # main() installs one per run
            counter.uninstall()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def with_changes(base: dict, changes: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = with_changes(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def trained_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "loss" in r]


def late_median(rows: list[dict]) -> float:
    trained = trained_rows(rows)
    return statistics.median(r["loss"] for r in trained[len(trained) * 2 // 3:])


def part_correctness(args, recorder: Recorder, sizes: dict, on_cuda: bool) -> None:
    work, data, steps = Path(args.work), Path(args.data), sizes["steps"]
    precisions = [p for p in PRECISIONS if on_cuda or p != "fp16"]  # DeepSpeed's CPU accelerator refuses fp16
    recorder.data.update({"steps": steps, "model": "tiny", "precisions": precisions, "tolerances": TOLERANCES})
    for optimizer, (shipped, changes) in OPTIMIZERS.items():
        base = with_changes(json.loads((REPO / "ds_configs" / shipped).read_text()), changes)
        if sizes["correctness_micro_batch"]:  # None: the shipped config's
            base["train_micro_batch_size_per_gpu"] = sizes["correctness_micro_batch"]
        if optimizer == "onebit_lamb":  # the freeze a third of the way in (the shipped 10 of 30 steps)
            base["optimizer"]["params"]["freeze_step"] = max(1, steps // 3)
        runs = {}
        for precision in precisions:
            name = f"{optimizer}_{precision}"
            started = time.perf_counter()
            try:
                rows = train_once(with_changes(base, PRECISIONS[precision]), work, name, data, "tiny", steps)
            except BaseException as exc:  # noqa: BLE001 - a cell that fails is a finding, the next cell runs
                recorder.data["cells"].append({"name": name, "error": error_line(exc)})
                recorder.check(f"{name} runs", error_line(exc), None, False)
                continue
            trained = trained_rows(rows)
            runs[precision] = trained
            recorder.data["cells"].append({
                "name": name, "seconds": round(time.perf_counter() - started, 2),
                "loss": [r["loss"] for r in trained], "grad_norm": [r.get("grad_norm") for r in trained],
                "loss_scale": [r.get("loss_scale") for r in trained][-1:],
                "val_mlm_acc": next((r["val_mlm_acc"] for r in reversed(rows) if "val_mlm_acc" in r), None)})
            recorder.save()
        reference = runs.get("fp32")
        if reference is None:
            continue
        if sizes is SIZES["gpu"]:
            drop = reference[0]["loss"] - late_median(reference)
            recorder.check(f"{optimizer}_fp32 learns", round(drop, 4), LEARNED, drop >= LEARNED)
        for precision, trained in runs.items():
            if precision == "fp32":
                continue
            name = f"{optimizer}_{precision}"
            diff = abs(trained[0]["loss"] - reference[0]["loss"])
            recorder.check(f"{name} step-1 loss", round(diff, 5), TOLERANCES["step1_loss"], diff <= TOLERANCES["step1_loss"])
            ours, theirs = trained[0].get("grad_norm"), reference[0].get("grad_norm")
            if ours is not None and theirs:
                ratio = ours / theirs
                recorder.check(f"{name} step-1 grad norm ratio", round(ratio, 5), TOLERANCES["step1_grad_norm_ratio"],
                               abs(ratio - 1) <= TOLERANCES["step1_grad_norm_ratio"])
            late = abs(late_median(trained) - late_median(reference))
            if optimizer != "onebit_lamb":
                recorder.check(f"{name} late loss", round(late, 5), TOLERANCES["late_loss"], late <= TOLERANCES["late_loss"])
                continue
            # 1-bit LAMB spikes for a step or two some steps after its freeze, in fp32 as in 16
            # bits, and a spike in one run and not the other moves its whole later curve (seen on
            # the H200: fp32's gradient norm 76 at step 22, bf16's 8): its late losses are recorded,
            # and held step by step over the steps just after the freeze, before any spike
            recorder.data.setdefault("onebit_late_loss_gap", {})[precision] = round(late, 5)
            freeze = base["optimizer"]["params"]["freeze_step"]
            window = [(a["loss"], b["loss"]) for a, b in zip(trained, reference) if freeze < a["step"] <= freeze + 3]
            gap = max((abs(a - b) for a, b in window), default=float("nan"))
            recorder.check(f"{name} steps after the freeze", round(gap, 5), TOLERANCES["after_freeze"],
                           bool(window) and gap <= TOLERANCES["after_freeze"])
    activation_checkpointing(work, data, steps, recorder)
    resume_bit_for_bit(work, data, sizes["resume_steps"], recorder, on_cuda)


def activation_checkpointing(work: Path, data: Path, steps: int, recorder: Recorder) -> None:
    """The config switch through train.py: LAMB in bf16 with and without it, losses compared.
    Recomputing a layer replays its dropout (torch restores the RNG state), so the losses are the
    same up to the order of floating-point sums in backward (exactly the same on the CPU)."""
    config = with_changes(json.loads((REPO / "ds_configs" / "cpu_tiny_lamb.json").read_text()),
                          {**OPTIMIZERS["lamb"][1], **PRECISIONS["bf16"]})
    losses = {}
    for enabled in (False, True):
        switched = with_changes(config, {"commodity_bert": {"activation_checkpointing": {"enabled": enabled}}})
        name = "checkpointed" if enabled else "not_checkpointed"
        losses[name] = [r["loss"] for r in trained_rows(train_once(switched, work, name, data, "tiny", steps))]
    gap = max(abs(a - b) for a, b in zip(losses["checkpointed"], losses["not_checkpointed"]))
    recorder.data["cells"].append({"name": "activation_checkpointing", **losses})
    recorder.check("activation checkpointing: the same losses", gap, TOLERANCES["checkpointing"],
                   gap <= TOLERANCES["checkpointing"])


def resume_bit_for_bit(work: Path, data: Path, half: int, recorder: Recorder, on_cuda: bool) -> None:
    """LAMB in bf16 (the path users run): 2N steps straight, twice (does the device repeat itself?),
    and N steps then a relaunch onto the checkpoint for N more; losses compared as exact floats.
    Deterministic kernels are asked for (CUDA's atomics in scatter-add backward would differ run to
    run otherwise); warn_only: an op with no deterministic kernel runs anyway, and the control run
    shows whether that mattered. Then the export is loaded on the CPU, as a user fine-tuning does."""
    import torch
    torch.use_deterministic_algorithms(True, warn_only=True)
    config = with_changes(json.loads((REPO / "ds_configs" / "cpu_tiny_lamb.json").read_text()),
                          {**OPTIMIZERS["lamb"][1], **PRECISIONS["bf16"]})
    straight = [r["loss"] for r in trained_rows(train_once(config, work, "straight", data, "tiny", 2 * half))]
    again = [r["loss"] for r in trained_rows(train_once(config, work, "straight_again", data, "tiny", 2 * half))]
    train_once(config, work, "resumed", data, "tiny", half)
    # the relaunch appends to the run's metrics.jsonl: its rows are those after step N
    relaunched = {r["step"]: r["loss"] for r in trained_rows(train_once(config, work, "resumed", data, "tiny", 2 * half))
                  if r["step"] > half}
    resumed = [relaunched[step] for step in sorted(relaunched)]
    torch.use_deterministic_algorithms(False)
    recorder.data["cells"].append({"name": "resume", "straight": straight, "straight_again": again,
                                   "resumed_second_half": resumed})
    recorder.check("two straight runs identical", straight == again, "exact", straight == again)
    recorder.check("resumed run identical to straight", resumed == straight[half:], "exact", resumed == straight[half:])

    from transformers import AutoTokenizer, BertForMaskedLM
    exported = work / "resumed" / "hf_model"
    model = BertForMaskedLM.from_pretrained(str(exported))  # on the CPU, as bert-finetune loads it
    tokenizer = AutoTokenizer.from_pretrained(str(exported))
    batch = tokenizer(["the state of the union is [MASK]."], return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    dtype = str(next(model.parameters()).dtype)
    fine = dtype == "torch.float32" and bool(torch.isfinite(logits).all()) and not next(model.parameters()).is_cuda
    recorder.data["cells"].append({"name": "export_on_cpu", "dtype": dtype, "vocab": tokenizer.vocab_size,
                                   "logits_finite": bool(torch.isfinite(logits).all())})
    recorder.check("export loads on the CPU in float32", dtype, "torch.float32", fine)


def part_speed(args, recorder: Recorder, sizes: dict, on_cuda: bool) -> None:
    import torch
    from throughput import matmul_peak_tflops, measure
    device = torch.device("cuda" if on_cuda else "cpu")
    precision = "bf16"
    data = Path(args.data)
    peak = matmul_peak_tflops(device, torch.bfloat16, 8192 if on_cuda else 1024)
    recorder.data.update({"peak_tflops": peak, "rows": [], "precision": precision})
    rows = recorder.data["rows"]

    def add(new_rows: list[dict], **labels) -> None:
        for row in new_rows:
            rows.append({**row, **labels})
        recorder.save()

    # first, a small model at a large batch as train.py runs it (bf16 weights in DeepSpeed's engine,
    # the one-pass master step, and DeepSpeed's own step beside it) against the autocast path
    add(measure(device, sizes["small_model"], data, precision, sizes["small_micro_batch"], sizes["small_steps"], 1,
                ["project", "engine_lamb", "engine_lamb_deepspeed_step"], peak), note="small model, large batch")
    for model in sizes["speed_models"]:  # padded against the project, then checkpointing's cost
        paths = ["padded_baseline", "project"] + (["project_checkpointed"] if model == sizes["speed_models"][-1] else [])
        add(measure(device, model, data, precision, sizes["speed_micro_batch"], sizes["speed_steps"],
                    sizes["speed_repeats"], paths, peak))
    largest = sizes["speed_models"][-1]
    add(measure(device, largest, data, precision, sizes["mfu_micro_batch"], sizes["speed_steps"],
                sizes["speed_repeats"], ["padded_baseline", "project", "project_jagged", "engine_lamb"], peak),
        note="larger micro-batch")
    # the largest micro-batch that fits, by doubling until the device runs out of memory
    fits, micro_batch = None, sizes["mfu_micro_batch"] * 2
    while micro_batch <= sizes["max_micro_batch"]:
        try:
            row = measure(device, largest, data, precision, micro_batch, 2, 1, ["project"], peak)[0]
        except torch.cuda.OutOfMemoryError:
            break
        fits = micro_batch
        add([row], note="largest micro-batch search")
        micro_batch *= 2
    if on_cuda:
        torch.cuda.empty_cache()
    recorder.data["largest_micro_batch"] = {"model": largest, "fits": fits, "tried_up_to": micro_batch,
                                            "limit_of_search": sizes["max_micro_batch"]}
    recorder.save()


def part_profile(args, recorder: Recorder, sizes: dict, on_cuda: bool) -> None:
    """Where a step's time goes, for the MFU goal: the largest speed model at the MFU micro-batch,
    padded and the project's path (a part of its own: the speed part's search for the largest
    micro-batch once took the minutes the profiles needed)."""
    import torch
    device = torch.device("cuda" if on_cuda else "cpu")
    recorder.data["profiles"] = []
    for path in ("padded_baseline", "project"):
        try:
            profile = profile_steps(device, sizes["speed_models"][-1], Path(args.data), "bf16",
                                    sizes["mfu_micro_batch"], path)
        except Exception as exc:  # noqa: BLE001 - a profiler that fails costs its figures, not the part's
            profile = {"path": path, "error": error_line(exc)}
        recorder.data["profiles"].append(profile)
        recorder.save()


# what a kernel's or operator's name says it does (the first pattern that matches wins)
OP_KINDS = [("matmul", ("gemm", "matmul", "addmm", "aten::mm", "aten::bmm", "cutlass", "nvjet", "sm90_xmma")),
            ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
            ("indexing", ("index", "scatter", "gather", "nonzero", "cumsum", "masked")),
            ("optimizer", ("adam", "foreach", "multi_tensor")),
            ("normalisation", ("layer_norm", "layernorm")),
            ("copies", ("copy", "cat", "fill", "zero", "memset", "memcpy"))]


def op_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in OP_KINDS if any(m in lowered for m in marks)), "elementwise and other")


def profile_steps(device, model_name: str, data: Path, precision: str, micro_batch: int, path_name: str,
                  steps: int = 3) -> dict:
    """torch.profiler over `steps` training steps of one path (after a warm-up): the device's time
    by kind of work and the 12 costliest kernels, so a missed MFU goal says what to fix."""
    import torch
    from throughput import TrainingPath, padded_batch, project_batches

    from commodity_bert.data import shard_format as fmt
    from commodity_bert.model.bert import PretrainingModel, build_config, build_model
    manifest = fmt.load_manifest(data)
    batches = project_batches(data, micro_batch, steps)
    torch.manual_seed(0)
    hf = build_model(build_config(model_name, manifest["vocab"]["size"]), nsp=manifest["nsp"])
    if path_name == "padded_baseline":
        hf.set_attn_implementation("sdpa")
        model, inputs = hf, [padded_batch(b, manifest["seq_len"], manifest["nsp"]) for b in batches]
    else:
        model, inputs = PretrainingModel(hf), batches
    path = TrainingPath(path_name, model, inputs, device, precision, 0.0)
    path.run()  # warm-up
    activities = [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        wall = path.run()
    path.release()
    on_device = device.type == "cuda"
    if on_device:  # the kernels' own entries (operators' would count the same time again)
        ranked = [(e.key, e.self_device_time_total) for e in prof.key_averages()
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    else:  # operators' own time, the CPU's kernels being inside them
        ranked = [(e.key, e.self_cpu_time_total) for e in prof.key_averages() if e.self_cpu_time_total > 0]
    ranked.sort(key=lambda kv: -kv[1])
    busy = sum(us for _, us in ranked)
    kinds: dict[str, float] = {}
    for name, us in ranked:
        kinds[op_kind(name)] = kinds.get(op_kind(name), 0.0) + us
    return {"model": model_name, "path": path_name, "micro_batch": micro_batch, "steps": steps,
            "wall_s": wall, "busy_s": busy / 1e6, "busy_share_of_wall": busy / 1e6 / wall if wall else None,
            "by_kind_s": {k: round(v / 1e6, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:120], "s": round(us / 1e6, 4), "kind": op_kind(n)} for n, us in ranked[:12]],
            "measures": "CUDA kernels' time" if on_device else "CPU operators' own time"}


GOAL_TOKENS = 1.5e9  # processed tokens (sequences x seq_len) where published small BERTs gain clearly


def part_model(args, recorder: Recorder, sizes: dict, on_cuda: bool) -> None:
    """`mini` with the large-batch recipe (ds_configs/gpu_mini_lamb_4k_bf16.json: LAMB at 4,096
    sequences a step, bf16) for a fixed number of minutes: a short probe measures the step, the
    schedule then spans the minutes (the config's warm-up share, 1/40, then linear decay to 0),
    --time-budget guards the end. The loader masks in worker processes beside the step. The
    record says how many tokens it processed against the 1.5 billion goal."""
    work, data = Path(args.work), Path(args.data)
    batch, model = sizes["pretrain_micro_batch"], sizes["pretrain_model"]
    base = with_changes(json.loads((REPO / "ds_configs" / "gpu_mini_lamb_4k_bf16.json").read_text()),
                        {"train_micro_batch_size_per_gpu": batch})
    workers = ("--num-workers", str(sizes["pretrain_workers"]))
    probing = time.perf_counter()
    probe = train_once(base, work, "probe", data, model, sizes["probe_steps"], *workers)
    probe_s = time.perf_counter() - probing  # a run's start, mostly: what --time-budget counts too
    speeds = [r["seq_per_s"] for r in trained_rows(probe)[1:] if r.get("seq_per_s")]
    seq_per_s = statistics.median(speeds) if speeds else batch
    minutes = args.model_minutes or sizes["pretrain_minutes"]
    seconds = minutes * 60
    steps = max(10, int(seconds * seq_per_s / batch))
    # --time-budget (it counts the start too; inside the cap): the minutes; or, where the floor of
    # 10 steps outlasts them (a slow CPU's rehearsal), a start as long as the probe's whole run and
    # those steps at the probe's speed twice over, for the evaluations the probe leaves out
    planned_s = steps * batch / seq_per_s
    budget_s = (seconds if planned_s <= seconds else probe_s + 2 * planned_s) * 1.1 + 20
    warmup = max(1, steps // 40)
    config = with_changes(base, {"scheduler": {"params": {"warmup_num_steps": warmup, "total_num_steps": steps}}})
    recorder.data.update({"model": model, "micro_batch": batch, "probe_seq_per_s": seq_per_s, "planned_steps": steps,
                          "minutes": minutes, "data": str(data), "config": config})
    recorder.save()
    started = time.perf_counter()
    rows = train_once(config, work, "pretrained", data, model, steps, "--eval-every", str(max(1, steps // 5)),
                      "--log-every", str(max(1, steps // 50)), "--time-budget", str(budget_s), *workers)
    run_dir = work / "pretrained"
    summary = json.loads((run_dir / "summary.json").read_text())
    seq_len = json.loads((data / "manifest.json").read_text())["seq_len"]
    recorder.data.update({"seconds": round(time.perf_counter() - started, 1), "steps": summary["step"],
                          "samples": summary["samples"], "stopped_by": summary["stopped_by"],
                          "processed_tokens": summary["samples"] * seq_len,
                          "share_of_goal_tokens": summary["samples"] * seq_len / GOAL_TOKENS,
                          "val_mlm_acc": summary.get("val_mlm_acc"), "devices": summary.get("devices"),
                          "curve": [{k: r.get(k) for k in ("step", "loss", "val_mlm_acc", "seq_per_s")}
                                    for r in rows]})
    recorder.save()
    # hf_model and the run's records, packed and cut into pieces small enough to come back
    packed = io.BytesIO()
    # level 1: the exported fp32 weights are bf16 values (DeepSpeed's bf16 module), whose zero low
    # halves gzip takes off fast; mini's 76 MB would not fit the 64 MiB that comes back uncompressed
    with tarfile.open(fileobj=packed, mode="w:gz", compresslevel=1) as tar:
        for name in ("hf_model", "summary.json", "run_config.json", "metrics.jsonl"):
            tar.add(run_dir / name, arcname=f"pretrained_{model}/{name}")
    blob, piece = packed.getvalue(), OUT_FILE_MIB * 2**20
    pieces = []
    for i in range(0, len(blob), piece):
        path = Path(args.out) / f"pretrained_{model}.tar.gz.part{i // piece:02d}"
        path.write_bytes(blob[i:i + piece])
        pieces.append(path.name)
    recorder.data.update({"pieces": pieces, "packed_mib": round(len(blob) / 2**20, 2),
                          "unpack": f"cat pretrained_{model}.tar.gz.part* | tar xz"})
    recorder.save()


def part_fused_lamb(args, recorder: Recorder, sizes: dict, on_cuda: bool) -> None:
    """DeepSpeed's FusedLamb against the project's LAMB, fp32, the same run otherwise."""
    if not on_cuda:
        recorder.data["skipped"] = "FusedLamb is CUDA-only"
        recorder.save()
        return
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"  # DeepSpeed 0.19.8 cannot parse 9.0a (docs/install.md)
    work, data = Path(args.work), Path(args.data)
    base = json.loads((REPO / "ds_configs" / "cpu_tiny_lamb.json").read_text())
    runs = {}
    for implementation in ("project", "deepspeed"):
        started = time.perf_counter()
        config = with_changes(base, {"commodity_bert": {"lamb": {"implementation": implementation}}})
        runs[implementation] = trained_rows(train_once(config, work, implementation, data, "tiny", sizes["steps"]))
        recorder.data["cells"].append({"name": implementation, "seconds": round(time.perf_counter() - started, 1),
                                       "loss": [r["loss"] for r in runs[implementation]],
                                       "grad_norm": [r.get("grad_norm") for r in runs[implementation]]})
        recorder.save()
    step1 = abs(runs["deepspeed"][0]["loss"] - runs["project"][0]["loss"])
    recorder.check("FusedLamb step-1 loss", round(step1, 6), 1e-4, step1 <= 1e-4)
    # not a check: FusedLamb is another formulation, whose early steps are smaller by
    # sqrt(1 - b2^t)/(1 - b1^t) (optim/lamb.py: implementation); benchmarks/lamb_formulations.py rebuilds it on CPU
    recorder.data["late_loss_gap"] = round(late_median(runs["deepspeed"]) - late_median(runs["project"]), 5)
    recorder.save()
    try:
        recorder.data["optimizer_step_s"] = optimizer_step_seconds()
    except Exception as exc:  # noqa: BLE001 - the timing is extra; the curves above are the part
        recorder.data["optimizer_step_s"] = {"error": error_line(exc)}
    recorder.save()


def optimizer_step_seconds(model_name: str = "large", steps: int = 10) -> dict:
    """One optimizer step over BERT-large's fp32 parameters (random gradients), the project's LAMB
    (torch._foreach ops) against DeepSpeed's FusedLamb (one kernel launch per tensor, twice): what
    choosing the paper's formulation costs on a GPU. Median of `steps` after 2 warm-ups."""
    import torch
    from deepspeed.ops.lamb import FusedLamb

    from commodity_bert.model.bert import build_config, build_model
    from commodity_bert.optim.lamb import Lamb
    model = build_model(build_config(model_name, 30522), nsp=False).cuda()
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    seconds = {}
    for name, make in (("project", Lamb), ("deepspeed", FusedLamb)):
        optimizer = make(model.parameters(), lr=1e-4, weight_decay=0.01)
        times = []
        for i in range(steps + 2):
            torch.cuda.synchronize()
            started = time.perf_counter()
            optimizer.step()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - started)
        seconds[name] = statistics.median(times)
        del optimizer
        torch.cuda.empty_cache()
    return {"model": model_name, "parameters": sum(p.numel() for p in model.parameters()), **seconds}


def error_line(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"exit {exc.code}"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def run_part(args) -> None:
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    if args.part == "correctness":  # cuBLAS repeats itself only with this set before it starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    on_cuda = torch.cuda.is_available()
    if args.rehearse and on_cuda:
        on_cuda = False  # the rehearsal is the CPU's path wherever it runs
    sizes = SIZES["rehearse" if args.rehearse else "gpu"]
    Path(args.work).mkdir(parents=True, exist_ok=True)
    from bench_common import cpu_name
    device = torch.cuda.get_device_name(0) if on_cuda else f"CPU: {cpu_name()}"
    recorder = Recorder(Path(args.json), device=device, torch=torch.__version__)
    recorder.save()
    single_rank_environment()
    part = {"correctness": part_correctness, "speed": part_speed, "profile": part_profile, "model": part_model,
            "fused_lamb": part_fused_lamb}[args.part]
    try:
        part(args, recorder, sizes, on_cuda)
    except BaseException as exc:
        traceback.print_exc()
        recorder.data["error"] = error_line(exc)
        recorder.data["passed"] = False
        raise
    finally:
        recorder.data["distributions"] = loaded_distributions()
        recorder.save()


def loaded_distributions() -> list[str]:
    """The installed distributions whose modules this process imported: the rehearsal checks
    each is on the device or in the bundle (standard library and the project's own excluded)."""
    owners = importlib.metadata.packages_distributions()
    names = {top for name in list(sys.modules) if (top := name.split(".")[0]) in owners}
    return sorted({normalise(d) for top in names for d in owners[top]} - {"commodity-bert"})
