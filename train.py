"""Pretrain BERT with DeepSpeed on the shards of `bert-data-prep`.

    deepspeed [--hostfile hostfiles/X] train.py --deepspeed_config ds_configs/Y.json \
        --data DATA_DIR --model base --output-dir RUN

Reads top to bottom: arguments → data → model → DeepSpeed engine → loop → export. The
machinery lives in `commodity_bert/`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from commodity_bert import checkpoint
from commodity_bert import shard_format as fmt
from commodity_bert.bucket_clip import PROJECT_BLOCK, BucketwiseClipAllreduce, bucketwise_settings
from commodity_bert.bytes_counter import BytesCounter
from commodity_bert.data import DataError, TrainingBatches, validation_batches
from commodity_bert.deepspeed_shm import release_deepspeed_shm_buffer
from commodity_bert.export import export_hf_model
from commodity_bert.launch_checks import (
    LaunchError,
    check_data_against_model,
    check_deepspeed_config,
    load_deepspeed_config,
)
from commodity_bert.metrics import MetricsLogger
from commodity_bert.model import (
    ModelConfigError,
    PretrainingModel,
    build_config,
    build_model,
    executed_training_flops,
    load_pretrained,
)
from commodity_bert.onebit_lamb import OneBitLamb
from commodity_bert.optim import build_optimizer


def parse_duration(text: str) -> float:
    """'24h', '90m', '1h30m', '45s' or plain seconds → seconds."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 24h, 90m, 1h30m or 3600")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="dataset directory made by bert-data-prep shards")
    p.add_argument("--model", default="base", help="tiny | mini | base | large | a BertConfig JSON")
    p.add_argument("--output-dir", required=True, help="RUN directory: metrics, checkpoints, hf_model")
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps "
                   "(default: the scheduler's total_num_steps)")
    p.add_argument("--time-budget", type=parse_duration, help="stop cleanly after this long, e.g. 24h")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--resume", default="auto", help="auto (latest checkpoint in RUN, if any) | PATH | none")
    p.add_argument("--init-from", help="start from these weights: a RUN, its hf_model, or a checkpoint directory")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=0, help="validate every N steps (0: only at the end)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    p.add_argument("--save-every-minutes", type=float, default=30.0, help="checkpoint every M minutes (0: off)")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="keep the last K checkpoints")
    p.add_argument("--num-workers", type=int, default=2, help="data-loading processes per rank")
    p.add_argument("--dist-timeout-minutes", type=float, default=10.0,
                   help="collective timeout: how long ranks wait for a dead peer before failing")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (DeepSpeed's engine.compile; dynamic shapes): see README")
    p.add_argument("--export-only", action="store_true", help="export RUN/hf_model from the checkpoint and exit")
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.add_config_arguments(p)
    return p.parse_args(argv)


class StopRequest:
    """SIGTERM / SIGUSR1 (preemption, Slurm's warning signal) ask for a checkpoint and a clean exit."""

    def __init__(self):
        self.signalled = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signalled = True


def agree(flags: list[bool], device) -> list[bool]:
    """Every rank takes the same decision: any rank's flag counts."""
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def sum_across_ranks(values: dict, device) -> dict:
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def local_grad_norm(model) -> float | None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))) if grads else None


def evaluate(engine, batches, device) -> dict:
    engine.eval()
    totals = {"correct": 0.0, "count": 0.0, "loss_sum": 0.0}
    with torch.no_grad():
        for batch in batches:
            _, stats = engine({k: v.to(device) for k, v in batch.items()})
            totals["correct"] += float(stats["mlm_correct"])
            totals["count"] += float(stats["mlm_count"])
            totals["loss_sum"] += float(stats["mlm_loss"]) * float(stats["mlm_count"])
    engine.train()
    totals = sum_across_ranks(totals, device)
    count = max(totals["count"], 1.0)
    return {"val_mlm_acc": totals["correct"] / count, "val_loss": totals["loss_sum"] / count}


def parameters_identical_across_ranks(module, device) -> bool:
    """Data parallelism keeps one model: compare a digest of every rank's parameters."""
    digest = hashlib.sha256()
    for param in module.parameters():
        digest.update(param.detach().float().cpu().numpy().tobytes())
    mine = torch.tensor(list(digest.digest()), dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return all(torch.equal(every[0], d) for d in every)


def fail(message: str, everyone: bool = False):
    """One error line (from rank 0, or from every rank that found the problem), exit 2."""
    if everyone or not dist.is_initialized() or dist.get_rank() == 0:
        print(f"train.py: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def main() -> None:
    args = parse_args()
    run_dir = Path(args.output_dir)
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda", args.local_rank) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="nccl" if on_cuda else "gloo",
                               timeout=timedelta(minutes=args.dist_timeout_minutes))
    rank, world = dist.get_rank(), dist.get_world_size()
    if not on_cuda:
        dist.barrier()
        release_deepspeed_shm_buffer(rank)

    # ---- checks, data and model: any rank's problem stops every rank before a step runs
    problem = None
    try:
        ds_config = load_deepspeed_config(args.deepspeed_config)
        total_batch, micro_batch, accumulation = check_deepspeed_config(ds_config, world)
        manifest = fmt.load_manifest(args.data)
        model_config = build_config(args.model, manifest["vocab"]["size"])
        check_data_against_model(manifest, model_config, args.data)
        batches = TrainingBatches(args.data, manifest, rank, world, micro_batch, args.seed, args.num_workers)
        val_batches = validation_batches(args.data, manifest, rank, world, micro_batch)
    except (LaunchError, ModelConfigError, DataError, fmt.ShardFormatError) as exc:
        problem = str(exc)
    if agree([problem is not None], device)[0]:
        if problem:
            fail(problem, everyone=True)  # the rank that found it says it; a shard may be one rank's
        sys.exit(2)
    max_steps = args.max_steps or ds_config.get("scheduler", {}).get("params", {}).get("total_num_steps")
    if not max_steps:
        fail("give --max-steps (or total_num_steps in the config's scheduler)")

    torch.manual_seed(args.seed)  # the same initial weights everywhere (DeepSpeed also broadcasts them)
    hf_model = build_model(model_config, nsp=manifest["nsp"])
    resume_dir = run_dir / "checkpoints" if args.resume in ("auto", "none") else Path(args.resume)
    resuming = args.resume != "none" and checkpoint.latest(resume_dir) is not None
    if args.resume not in ("auto", "none") and not resuming:
        fail(f"--resume {args.resume}: no checkpoint there (no 'latest' file naming a step directory)")
    init_checkpoint = None
    if args.init_from and not resuming:
        source = Path(args.init_from)
        weights = source / "hf_model" if (source / "hf_model").is_dir() else source
        try:
            if any(weights.glob("*.safetensors")):
                hf_model = load_pretrained(weights, nsp=manifest["nsp"])
                model_config = hf_model.config  # the architecture is the source's
                check_data_against_model(manifest, model_config, args.data)
            elif checkpoint.latest(source) or checkpoint.latest(source / "checkpoints"):
                init_checkpoint = source if checkpoint.latest(source) else source / "checkpoints"
            else:
                raise ModelConfigError(f"--init-from {source}: neither a RUN, an hf_model nor a checkpoint directory")
        except (ModelConfigError, LaunchError) as exc:
            fail(str(exc))
    model = PretrainingModel(hf_model)
    torch.manual_seed(args.seed + rank)  # dropout differs per rank

    bucketwise = bucketwise_settings(ds_config)
    # the project's own block is not DeepSpeed's; with bucket-wise clipping DeepSpeed neither clips
    ds_config = {k: v for k, v in ds_config.items() if k != PROJECT_BLOCK}
    if bucketwise:
        ds_config["gradient_clipping"] = 0.0
    optimizer, parameters, ds_config = build_optimizer(ds_config, model, on_cuda)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer,
                                                   model_parameters=parameters, config=ds_config)
    if isinstance(optimizer, OneBitLamb):
        # from the freeze step on, momenta travel compressed instead of gradients
        optimizer.on_freeze = lambda: setattr(engine, "enable_backward_allreduce", False)
    clipper = None
    if bucketwise:
        engine.enable_backward_allreduce = False
        clipper = BucketwiseClipAllreduce(list(model.parameters()), bucketwise.get("bucket_mb", 25),
                                          bucketwise.get("max_norm", 1.0),
                                          lambda: float(getattr(engine.optimizer, "cur_scale", 1.0)))
    if args.compile:
        engine.compile(compile_kwargs={"dynamic": True})  # batch widths and token counts vary
    wire = BytesCounter().install()
    samples = 0
    if resuming:
        state, rank_state = checkpoint.load(engine, resume_dir)
        if isinstance(optimizer, OneBitLamb):
            optimizer.load_rank_state_dict(rank_state.get("optimizer", {}))
        batches.load_state_dict(state["data"])
        samples = state["samples"]
        if rank == 0:
            print(f"resuming from {resume_dir} at step {engine.global_steps}", flush=True)
    elif init_checkpoint is not None:
        checkpoint.load(engine, init_checkpoint, weights_only=True)
    lowercase = manifest["vocab"].get("lowercase", True)
    vocab_path = Path(args.data) / fmt.VOCAB_NAME

    def save() -> None:
        checkpoint.save(engine, run_dir / "checkpoints", engine.global_steps,
                        {"data": batches.state_dict(), "samples": samples, "args": vars(args)},
                        args.keep_checkpoints,
                        {"optimizer": optimizer.rank_state_dict()} if isinstance(optimizer, OneBitLamb) else None)

    def export() -> None:
        if rank == 0:
            export_hf_model(hf_model, vocab_path, lowercase, run_dir / "hf_model")

    if args.export_only:
        export()
        dist.barrier()
        return
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "run_config.json").write_text(json.dumps(
            {"args": vars(args), "deepspeed_config": ds_config, "world_size": world,
             "model_config": model_config.to_dict()}, indent=1, default=str))
    metrics = MetricsLogger(run_dir, enabled=rank == 0, start_step=engine.global_steps)
    stop = StopRequest()

    # ---- the loop
    started = last_log = last_save = time.time()
    evaluating = 0.0  # seconds spent scoring the held-out set, left out of elapsed_s

    def score() -> dict:
        nonlocal evaluating
        scoring = time.time()
        result = evaluate(engine, val_batches, device)
        evaluating += time.time() - scoring
        return result

    # summed on the device and read once per log step: no host sync per micro-batch
    window_keys = ("loss", "mlm_correct", "mlm_count", "nsp_correct", "nsp_count", "real_tokens")
    window = torch.zeros(len(window_keys), dtype=torch.float64, device=device)
    flops = 0.0
    micro_batches = 0
    grad_norm = None
    data_wait = 0.0
    steps_in_window = 0
    bytes_at_log, evaluating_at_log = wire.total, 0.0
    last_eval: dict = {}
    data_iter = iter(batches)
    engine.train()
    while engine.global_steps < max_steps:
        log_step = (engine.global_steps + 1) % args.log_every == 0
        for micro in range(accumulation):
            waited = time.perf_counter()
            batch = next(data_iter)
            data_wait += time.perf_counter() - waited
            flops += executed_training_flops(model_config, batch)  # from the host copy: no device sync
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss, stats = engine(batch)
            boundary = micro == accumulation - 1
            if clipper and boundary:
                clipper.start_boundary_backward()
            engine.backward(loss)
            if clipper and boundary:
                clipper.finish()
            if log_step and boundary:
                grad_norm = local_grad_norm(model)  # DeepSpeed reports none for fp32 without ZeRO
            engine.step()
            stats = {**stats, "loss": loss.detach(), "real_tokens": batch["real_tokens"]}
            window += torch.stack([stats[k].double() if k in stats else window.new_zeros(())
                                   for k in window_keys])
            micro_batches += 1
        samples += total_batch
        steps_in_window += 1
        step = engine.global_steps
        out_of_time = args.time_budget is not None and time.time() - started >= args.time_budget
        save_due = bool(args.save_every and step % args.save_every == 0) or \
            bool(args.save_every_minutes and time.time() - last_save >= args.save_every_minutes * 60)
        # one small collective a step: every rank stops and saves at the same step
        signalled, out_of_time, save_due = agree([stop.signalled, out_of_time, save_due], device)
        finished = signalled or out_of_time or step >= max_steps

        if step % args.log_every == 0 or finished:
            bytes_sent = (wire.total - bytes_at_log) / steps_in_window  # before the metrics' own collectives
            dist.all_reduce(window)
            totals = dict(zip(window_keys, window.tolist()))
            total_flops = sum_across_ranks({"flops": flops}, device)["flops"]
            window_s = time.time() - last_log - (evaluating - evaluating_at_log)  # rates leave scoring out
            row = {"step": step, "samples": samples, "elapsed_s": time.time() - started - evaluating,
                   "loss": totals["loss"] / (micro_batches * world),
                   "mlm_acc": totals["mlm_correct"] / max(totals["mlm_count"], 1),
                   "lr": scheduler.get_last_lr()[0] if scheduler else engine.get_lr()[0],
                   "loss_scale": float(getattr(engine.optimizer, "cur_scale", 1.0)),
                   "grad_norm": float(engine.get_global_grad_norm() or grad_norm or 0.0),
                   "seq_per_s": steps_in_window * total_batch / window_s,
                   "tokens_per_s": totals["real_tokens"] / window_s,
                   "tflops": total_flops / window_s / 1e12,
                   "data_wait_s": data_wait / steps_in_window,
                   "bytes_sent": bytes_sent}
            if totals["nsp_count"]:
                row["nsp_acc"] = totals["nsp_correct"] / totals["nsp_count"]
            if args.eval_every and step % args.eval_every == 0 or finished:
                last_eval = score()
                row.update(last_eval)
            metrics.log(row)
            if rank == 0:
                print(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                      flush=True)
            window.zero_()
            flops, micro_batches, grad_norm = 0.0, 0, None
            data_wait, steps_in_window, last_log = 0.0, 0, time.time()
            bytes_at_log, evaluating_at_log = wire.total, evaluating
        elif args.eval_every and step % args.eval_every == 0:
            trained_s = time.time() - started - evaluating
            last_eval = score()
            metrics.log({"step": step, "samples": samples, "elapsed_s": trained_s, **last_eval})

        if save_due or finished:
            save()
            last_save = time.time()
        if signalled or out_of_time:
            if rank == 0:
                print(f"stopping at step {step}: {'signal' if signalled else 'time budget'}; checkpoint saved",
                      flush=True)
            break
    # Stop the loader workers now: they ignore SIGTERM (see data.py), so if anything (a compiled
    # graph did) keeps the loader alive until interpreter exit, multiprocessing's exit handler
    # would wait on them for ever.
    data_iter.close()
    identical = parameters_identical_across_ranks(model, device)
    hosts = [None] * world  # which machine each rank ran on, for the record
    dist.all_gather_object(hosts, socket.gethostname())
    export()
    if rank == 0:
        summary = {"step": engine.global_steps, "samples": samples, "wall_s": time.time() - started,
                   "world_size": world, "hosts": hosts, "params_identical_across_ranks": identical,
                   **last_eval}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"done: {json.dumps(summary)}", flush=True)
    metrics.close()
    dist.barrier()


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001 - any failure, reported with its traceback
        # A collective that failed (a peer died) must end this rank now: a normal exit would
        # join the data-loader workers, which wait on their queues for ever.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
