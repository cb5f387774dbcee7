"""Pretrain BERT with DeepSpeed on the shards of `bert-data-prep`.

    deepspeed [--hostfile hostfiles/X] train.py --deepspeed_config ds_configs/Y.json \
        --data DATA_DIR --model base --output-dir RUN

Reads top to bottom: arguments → data → model → DeepSpeed engine → loop → export. The
machinery lives in `commodity_bert/`.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import itertools
import json
import os
import re
import resource
import signal
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import deepspeed
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters as dynamo_counters

from commodity_bert.cli_help import show_defaults
from commodity_bert.comm import mode as comm_mode
from commodity_bert.comm.bytes_counter import BytesCounter
from commodity_bert.comm.deepspeed_shm import clear_stale_build_locks, release_deepspeed_shm_buffer
from commodity_bert.comm.topology import Topology
from commodity_bert.data.shard_format import ShardFormatError
from commodity_bert.data.dataset import ShardSet
from commodity_bert.host import atomic_write_text, device_name, speaker
from commodity_bert.launcher_env import adopt_launcher_environment
from commodity_bert.data.deal import DealError
from commodity_bert.data.loader import SHARDS_IN_MEMORY, DataError, TrainingBatches, ValidationBatches
from commodity_bert.model.bert import (
    ModelConfigError,
    PretrainingModel,
    build_config,
    build_model,
    executed_training_flops,
    fresh_head_line,
    init_shape_line,
    load_pretrained,
    pretrained_config,
    set_dropout,
    use_activation_checkpointing,
)
from commodity_bert.model.card import write_card
from commodity_bert.model.export import export_hf_model
from commodity_bert.model.sections import activation_checkpointing, attention_layout
from commodity_bert.optim.precision import cpu_bf16_warning, current_loss_scale, loss_for_backward
from commodity_bert.run_config import RunConfig
from commodity_bert.run_dir import CHECKPOINTS, HF_MODEL, RUN_CONFIG, SUMMARY, read_run_config
from commodity_bert.train import checkpoint, downstream_watcher, failures, run_lock
from commodity_bert.train.balance import Balancer
from commodity_bert.train.bookkeeping import Bookkeeping, agree, sum_across_ranks
from commodity_bert.train.engine import build_engine
from commodity_bert.train.host_memory import HeapTrimmer
from commodity_bert.train.launch_checks import (
    BatchSizes,
    LaunchError,
    batch_for_resume,
    check_against_device,
    check_command_line,
    check_data_against_model,
    check_deepspeed_config,
    check_vocabulary_against_source,
    init_source,
    load_deepspeed_config,
    pretraining_settings,
    schedule_end_warning,
)
from commodity_bert.train.memory import live_tensor_bytes, peak_allocated_bytes
from commodity_bert.train.metrics import MetricsLogger, monitor_problem
from commodity_bert.train.plateau import AFTER_SAMPLES, PlateauCheck, unigram_accuracy
from commodity_bert.train.schedule import parse_duration


DEFAULT_MODEL = "base"  # --model's, where --init-from does not give the shape


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="dataset directory made by bert-data-prep shards")
    p.add_argument("--model", help="tiny | mini | small | medium | base | large | a BertConfig JSON (default: --init-from's own "
                   "shape, else base)")
    p.add_argument("--output-dir", required=True, help="RUN directory: metrics, checkpoints, hf_model")
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps "
                   "(default, or 0: the scheduler's total_num_steps)")
    p.add_argument("--time-budget", type=parse_duration,
                   help="stop cleanly after this long in all, across relaunches (kept in checkpoints), e.g. 24h")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--resume", default="auto", help="auto (latest checkpoint in RUN, if any) | PATH | none")
    p.add_argument("--allow-data-change", action="store_true",
                   help="resume onto a dataset other than the checkpoint's (from its first batch)")
    p.add_argument("--allow-batch-change", action="store_true",
                   help="resume on a world size that cannot make the checkpoint's global batch, at the "
                        "config's batch for this world size (said in one line)")
    p.add_argument("--init-from", help="start from these weights: a RUN, its hf_model, a checkpoint directory, or any "
                   "Hugging Face BERT directory with its tokenizer (a missing masked-LM head starts fresh)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=0, help="validate every N steps (0: only at the end)")
    p.add_argument("--plateau-check-samples", type=int, default=AFTER_SAMPLES,
                   help="at the first evaluation after this many samples (and after the warm-up), warn if "
                        "validation MLM accuracy has not passed 1.5x the most-frequent-token accuracy "
                        "(default %(default)s; 0: no check)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    p.add_argument("--save-every-minutes", type=float, default=30.0, help="checkpoint every M minutes (0: off)")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="keep the last K checkpoints")
    p.add_argument("--on-save-error", choices=("stop", "continue"), default="stop",
                   help="a checkpoint that cannot be written (full disk, read-only, ...): stop with status 3, or "
                        "say so and train on without it (the last whole checkpoint stays the one to resume)")
    p.add_argument("--num-workers", type=int, default=2, help="data-loading processes per rank")
    p.add_argument("--trim-host-memory-every", type=int, default=10, metavar="STEPS",
                   help="hand the C heap's free pages back to the system every STEPS steps (glibc's "
                        "malloc_trim; 0: never), so a rank's host memory grows far less in a long run")
    p.add_argument("--shards-in-memory", type=int, default=SHARDS_IN_MEMORY,
                   help="training shards a rank holds in memory at a time (its RAM for data is about this "
                        "times the shard size, whatever the data set's size); 0: all of its shards")
    p.add_argument("--dist-timeout-minutes", type=float, default=failures.DIST_TIMEOUT_MINUTES,
                   help="collective timeout: how long ranks wait on a peer that is gone or silent (a link down) "
                        "before each stops in one line naming it")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (DeepSpeed's engine.compile; dynamic shapes): see docs/training.md")
    p.add_argument("--export-only", action="store_true", help="export RUN/hf_model from the checkpoint and exit")
    p.add_argument("--eval-batches", type=int, default=0, metavar="N",
                   help="validate on each rank's first N micro-batches of the held-out split (0: all of it)")
    p.add_argument("--watch-downstream", metavar="FINETUNE_ARGS",
                   help="fine-tune each checkpoint as it appears, beside the training on rank 0's host "
                        "(bert-finetune --watch; e.g. \"--task embedded:polarity --seeds 1 2 3\"): "
                        "RUN/downstream.jsonl, RUN/downstream.log")
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.add_config_arguments(p)
    return show_defaults(p)


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


class StopRequest:
    """SIGTERM / SIGUSR1 (preemption, Slurm's warning signal) ask for a checkpoint and a clean exit.
    They reach a rank when sent to it, or through bert-launch (commodity_bert/launch/launcher.py), which
    passes a signal sent to the launcher on to the ranks; DeepSpeed's own launcher does not."""

    def __init__(self):
        self.signalled = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signalled = True


def evaluate(engine, batches, device, shared_model=contextlib.nullcontext, limit: int = 0) -> dict:
    engine.eval()
    totals = {"correct": 0.0, "count": 0.0, "loss_sum": 0.0}
    with torch.no_grad(), shared_model():
        for batch in itertools.islice(batches, limit or None):
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


say = speaker(rank_zero=True)  # lines for the user, once


def release_process_group():
    """Destroy the process group while the interpreter is whole: left to its finalization, gloo's
    worker threads can end the rank with SIGABRT ("terminate called without an active exception";
    pytorch/pytorch#190489), a finished run's status 0 or a refusal's 2 reading as a crash."""
    failures.stop_heartbeat()
    if dist.is_initialized():
        dist.destroy_process_group()


def leave(status: int):
    """Exit with `status`, the process group released first."""
    release_process_group()
    sys.exit(status)


def stop_for_error(bookkeeping: Bookkeeping, step: int):
    """Every rank, together: one line for the error, one naming the rank that met it. One write per
    rank: under `python -u` print's text and newline are two, and two ranks' lines ran together."""
    sys.stderr.write("".join(line + "\n" for line in bookkeeping.error_lines(step)))
    sys.stderr.flush()
    leave(2)


def fail(message: str, everyone: bool = False, status: int = 2):
    """One error line (from rank 0, or from every rank that found the problem), then exit."""
    if everyone or not dist.is_initialized() or dist.get_rank() == 0:
        sys.stderr.write(f"train.py: error: {message}\n")  # one write: not run together with another rank's
        sys.stderr.flush()
    leave(status)


def start_watcher(flags: str, run_dir: Path, rank: int) -> None:
    """--watch-downstream: bert-finetune --watch beside the training, on rank 0's host. Bad flags
    stop every rank with one line; a watcher that cannot start is a warning."""
    problem = [None]
    if rank == 0:
        try:
            command = downstream_watcher.watcher_command(run_dir, flags, os.getpid())
            downstream_watcher.check(command)
        except downstream_watcher.WatcherError as exc:
            problem[0] = f"--watch-downstream: {exc}"
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        fail(problem[0])
    if rank == 0:
        try:
            downstream_watcher.start(command, run_dir)
            say(f"downstream probes: {run_dir / 'downstream.jsonl'}, log {run_dir / 'downstream.log'}")
        except OSError as exc:  # the probes are optional; the training is not
            say(f"warning: --watch-downstream: could not start the watcher ({exc}); training goes on")


def join_the_ranks(args) -> torch.device:
    """This rank's device, its threads, and the process group (gloo on CPUs, NCCL on GPUs)."""
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda", args.local_rank) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:
        # each rank would take every core (torch's default) and N ranks would fight over them;
        # DeepSpeed's --bind_cores_to_rank does this split too, but needs numactl
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", "1"))))
    if not on_cuda and os.environ.get("LOCAL_RANK", "0") == "0":
        for stale in clear_stale_build_locks():  # else init_distributed would wait on it for ever
            print(f"removed {stale}: an interrupted compile of DeepSpeed's CPU op left it", flush=True)
    timeout = timedelta(minutes=args.dist_timeout_minutes)
    failures.groups_time_out_after(timeout)
    deepspeed.init_distributed(dist_backend="nccl" if on_cuda else "gloo", timeout=timeout)
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    failures.start_heartbeat(hosts)
    if not on_cuda:
        dist.barrier()
        release_deepspeed_shm_buffer(dist.get_rank())
    return device


class CheckedInputs(NamedTuple):
    """What the launch was given, checked: the config, the batch sizes, the data, the model's shape."""
    config: RunConfig
    batch: BatchSizes
    data: ShardSet
    model_config: object
    recipe: dict  # the config's "pretraining" section: masking rate, dropout
    batches: TrainingBatches
    val_batches: ValidationBatches
    max_steps: int  # --max-steps, or the scheduler's total

    @property
    def total_batch(self) -> int:
        return self.batch.total

    @property
    def accumulation(self) -> int:
        return self.batch.accumulation

    def batch_note(self) -> str | None:
        """One line where this world size cannot train the config's batch as written."""
        return self.batch.note(dist.get_world_size(), self.config.micro_batch or self.batch.micro)


def data_batches(args, data: ShardSet, micro_batch: int, recipe: dict) -> tuple[TrainingBatches, ValidationBatches]:
    rank, world = dist.get_rank(), dist.get_world_size()
    return (TrainingBatches(data, rank, world, micro_batch, args.seed, args.num_workers, args.shards_in_memory,
                            mask_prob=recipe.get("mask_prob")),
            ValidationBatches(data, rank, world, micro_batch))


def check_inputs(args, device: torch.device) -> CheckedInputs:
    """Any rank's problem stops every rank before a step runs, in one line: the first rank that
    found it says it (a shard may be one rank's), the others exit with the same status."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problem = None
    try:
        check_command_line(args)
        config = load_deepspeed_config(args.deepspeed_config)
        batch = check_deepspeed_config(config, world)
        check_against_device(config, device.type == "cuda", path=args.deepspeed_config,
                             bf16_native=device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 8,
                             device_name=device_name(device))
        if rank == 0 and (trouble := monitor_problem(config.given, Path(args.output_dir))):  # rank 0 logs
            raise LaunchError(trouble)
        data = ShardSet.open(args.data)
        model_config = build_config(args.model or DEFAULT_MODEL, data.vocab_size)
        check_data_against_model(data, model_config)
        recipe = pretraining_settings(config, data)
        batches, val_batches = data_batches(args, data, batch.micro, recipe)
    except (LaunchError, ModelConfigError, DataError, ShardFormatError) as exc:
        problem = str(exc)
    if agree([problem is not None], device)[0]:
        problems = [None] * world
        dist.all_gather_object(problems, problem)
        if rank == next(r for r, p in enumerate(problems) if p):
            fail(problem, everyone=True)
        leave(2)
    max_steps = args.max_steps or config.total_num_steps
    if not max_steps:
        fail("give --max-steps (or total_num_steps in the config's scheduler)")
    if warning := schedule_end_warning(config, max_steps):
        say(warning)
    if device.type == "cpu" and (warning := cpu_bf16_warning(args.deepspeed_config, config)):
        say(warning)
    return CheckedInputs(config, batch, data, model_config, recipe, batches, val_batches, max_steps)


def fit_to_checkpoint(args, inputs: CheckedInputs, step_dir: Path) -> CheckedInputs:
    """A resumed run trains at its checkpoint's global batch, whatever the world size or the
    micro-batch of this launch (or refuses in one line), and says what changed."""
    recorded = checkpoint.progress(step_dir)
    if recorded is None or "batch" not in recorded:  # written before checkpoints kept their batch
        if line := inputs.batch_note():
            say(line)
        return inputs
    try:
        batch, line = batch_for_resume(inputs.config, dist.get_world_size(), recorded["batch"], step_dir.name,
                                       args.allow_batch_change)
    except LaunchError as exc:
        fail(str(exc))
    if line:
        say(line)
    if batch.micro == inputs.batch.micro:
        return inputs._replace(batch=batch)
    batches, val_batches = data_batches(args, inputs.data, batch.micro, inputs.recipe)
    return inputs._replace(batch=batch, batches=batches, val_batches=val_batches)


def hold_the_run(run_dir: Path) -> run_lock.RunLock | None:
    """Rank 0 holds RUN for this launch (run_lock.py); a RUN a live launch holds stops every rank,
    in one line naming its host and process, before anything in it is touched."""
    held, problem = None, [None]
    if dist.get_rank() == 0:
        try:
            held = run_lock.hold(run_dir)
        except run_lock.RunHeld as exc:
            problem[0] = str(exc)
        except OSError as exc:
            problem[0] = f"--output-dir {run_dir}: cannot write there ({exc.strerror or exc}); give a directory you can write"
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        fail(problem[0])
    return held


def intact_weights_to_start_from(directory: Path) -> str:
    """--init-from a checkpoint directory: the newest checkpoint whose weights its digest vouches
    for (the directory is another run's: read, never changed), the same on every rank, said in one
    line when it is not the newest."""
    tag, line = checkpoint.newest_intact_weights(directory)
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (socket.gethostname(), tag, line))
    if none := [found_line for _, found, found_line in views if found is None]:
        fail(f"--init-from {directory}: {none[0]}")
    if len({view[1] for view in views}) > 1:
        fail(f"--init-from {directory}: the ranks find different checkpoints intact "
             f"({', '.join(f'{host}: {found}' for host, found, _ in views)}); copy the same checkpoints to every node")
    if line:
        say(f"--init-from: {line}")
    return tag


def checkpoints_model_config(checkpoints: Path):
    """The BertConfig of the run whose checkpoint directory this is (its run_config.json's
    model_config), or None where the directory is not a run's."""
    saved = (read_run_config(checkpoints.parent) or {}).get("model_config")
    if not isinstance(saved, dict):
        return None
    from transformers import BertConfig
    return BertConfig.from_dict(saved)


def pretraining_model(args, inputs: CheckedInputs, resuming: bool):
    """The HF BERT to train (from --init-from's weights where given), its config, and the
    checkpoint --init-from names instead, if it does. A resumed run takes its weights from its
    checkpoint, but its architecture still from the --init-from directory where there is one,
    not from --model."""
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DeepSpeed also broadcasts them)
    model_config, data = inputs.model_config, inputs.data
    init_checkpoint, weights, source_config = None, None, None
    source = Path(args.init_from) if args.init_from else None
    if source is not None and (not resuming or source.exists()):
        try:
            kind, where = init_source(source)
            if kind == "weights":
                check_vocabulary_against_source(data, where)  # before loading: a refusal costs no load
                weights = where
                source_config = pretrained_config(weights)
            else:  # a run's checkpoints: its run_config.json, where it has one, holds the shape
                source_config = checkpoints_model_config(where)
                if not resuming:
                    init_checkpoint = where, intact_weights_to_start_from(where)
            if source_config is not None:
                if line := init_shape_line(args.model, model_config, source, source_config):
                    say(line)
                model_config = source_config
        except (LaunchError, ModelConfigError) as exc:
            fail(str(exc))
    try:
        if weights is not None and not resuming:
            hf_model, missing = load_pretrained(weights, nsp=data.nsp)
            model_config = hf_model.config  # the architecture is the source's
            if line := fresh_head_line(source, missing):
                say(line)
        if source_config is not None:  # the architecture is the source's, resumed or not
            check_data_against_model(data, model_config)
    except (ModelConfigError, LaunchError) as exc:
        fail(str(exc))
    if weights is None or resuming:
        hf_model = build_model(model_config, nsp=data.nsp)
    if "dropout" in inputs.recipe:  # in training only: the exported config keeps its own rate for fine-tuning
        set_dropout(hf_model, inputs.recipe["dropout"])
    if activation_checkpointing(inputs.config):
        use_activation_checkpointing(hf_model)  # recompute each layer in backward: less memory
    return hf_model, model_config, init_checkpoint


def checkpoint_place(args, run_dir: Path) -> tuple[bool, Path, str | None]:
    """Whether checkpoints are node-local (the run directory is not shared: every node keeps a
    whole checkpoint of its own), where checkpoints are read from, and the one every rank resumes
    from (None: a fresh start)."""
    node_local = not checkpoint.storage_is_shared(run_dir)
    explicit = args.resume not in ("auto", "none")
    resume_dir = Path(args.resume) if explicit else run_dir / CHECKPOINTS
    try:
        tag, note = (None, None) if args.resume == "none" else \
            checkpoint.agree_on_resume(resume_dir, explicit, node_local)
    except checkpoint.CheckpointError as exc:
        fail(str(exc))
    if note:
        say(note)
    if args.export_only and tag is None:
        fail(f"--export-only: no checkpoint in {resume_dir} to export; train first, or give --resume PATH")
    return node_local, resume_dir, tag


def plateau_check(args, inputs: CheckedInputs, vocab_size: int, device) -> PlateauCheck | None:
    """The check that warns while validation accuracy sits at the most frequent token's."""
    if args.plateau_check_samples <= 0 or not inputs.data.manifest["splits"]["validation"]["samples"]:
        return None
    return PlateauCheck(unigram_accuracy(inputs.val_batches, vocab_size, device), args.plateau_check_samples,
                        inputs.config.warmup_num_steps)


def resume(args, engine, mode, batches, resume_dir: Path, tag: str, data: ShardSet) -> tuple[int, dict, dict]:
    """Every rank loads checkpoint `tag` (the same one: checkpoint.agree_on_resume) and goes on
    from its batch, unless the data changed; the samples and clocks it had reached, and its deal."""
    state, rank_state = checkpoint.load(engine, resume_dir, tag=tag)
    try:
        mode.resume(state, rank_state, resume_dir / tag)
    except comm_mode.ModeStateError as exc:
        fail(str(exc))
    trained_on = state.get("data_digest")
    if trained_on in (None, data.digest):
        if line := batches.load_state_dict(state["data"]):
            say(line)
    elif args.allow_data_change:
        say(f"--allow-data-change: {args.data} is not the data {tag} was trained on; starting at its first batch")
    else:
        fail(f"{resume_dir / tag} was trained on other data (manifest sha256 {trained_on[:12]}…, "
             f"--data {args.data} has {data.digest[:12]}…); give the same --data to resume, "
             f"or --allow-data-change to go on from these weights with this data")
    say(f"resuming from {resume_dir / tag} at step {engine.global_steps}")
    return state["samples"], state.get("clocks", {}), state.get("balance")


def share_the_steps(inputs: CheckedInputs, batches: TrainingBatches, mode, saved: dict | None,
                    device: torch.device) -> Balancer:
    """Who trains which micro-batches of a step (train/balance.py): the equal split, the config's
    speeds, or the checkpoint's deal; said at launch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        balancer = Balancer(inputs.config, world, rank, inputs.accumulation, device)
    except DealError as exc:
        fail(str(exc))
    if line := balancer.load_state_dict(saved):
        say(line)
    batches.set_deal(balancer.deal)
    mode.balance(balancer.rank_weight)
    if line := balancer.describe():
        say(line)
    return balancer


def start_records(run_dir: Path, args, inputs, ds_config: dict, mode_name: str, model_config,
                  node_local: bool) -> dict:
    """The run's record (every rank): what run_config.json holds, which rank 0 writes; the summary of
    an earlier launch goes, or it would say "finished" while this one trains."""
    run_config = json.loads(json.dumps(
        {"args": vars(args), "deepspeed_config": inputs.config.given, "deepspeed_config_effective": ds_config,
         "comm_mode": mode_name, "world_size": dist.get_world_size(),
         "model_config": model_config.to_dict(), "checkpoints_node_local": node_local}, default=str))
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / SUMMARY).unlink(missing_ok=True)
        (run_dir / RUN_CONFIG).write_text(json.dumps(run_config, indent=1))
    return run_config


def final_summary(engine, model, device, bookkeeping, samples: int, stopped_by: str, last_eval: dict) -> dict:
    """What summary.json says of the run (on every rank; rank 0 writes it): where it stopped, which
    machine each rank ran on and its peak memory, whether the ranks hold one model."""
    identical = parameters_identical_across_ranks(model, device)
    hosts = [None] * dist.get_world_size()
    held, peak = live_tensor_bytes(device), peak_allocated_bytes(device)
    dist.all_gather_object(hosts, (socket.gethostname(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                                   device_name(device), held, peak))
    return {"step": engine.global_steps, "samples": samples, "wall_s": bookkeeping.wall_s(),
            "trained_s": bookkeeping.trained_s(), "stopped_by": stopped_by, "world_size": len(hosts),
            "hosts": [h[0] for h in hosts],
            "peak_rss_mb": [round(h[1], 1) for h in hosts], "devices": [h[2] for h in hosts],
            # what bert-plan fit's memory model predicts (plan/memory.py): the tensors held between steps
            "tensor_mb": [round(h[3] / 2**20, 2) for h in hosts],
            "peak_allocated_mb": [None if h[4] is None else round(h[4] / 2**20, 1) for h in hosts],
            "params_identical_across_ranks": identical, **last_eval}


def write_summary(run_dir: Path, summary: dict) -> None:
    """RUN/summary.json (renamed into place: a watcher may read it at any moment), then the model
    card from the records just written."""
    atomic_write_text(run_dir / SUMMARY, json.dumps(summary, indent=1))
    print(f"done: {json.dumps(summary)}", flush=True)
    try:
        write_card(run_dir)  # hf_model/README.md
    except (OSError, KeyError, ValueError, ImportError) as exc:  # the model is exported; the card is extra
        print(f"warning: no model card ({type(exc).__name__}: {exc})", flush=True)


def main(argv: list[str] | None = None) -> None:
    """One training run; `argv` as on the command line (benchmarks/gpu/session.py runs several in
    one process, so that GPU time does not pay a launch per check)."""
    adopt_launcher_environment()  # torchrun's or srun's names for the rank, before --local_rank's default is read
    args = parse_args(argv)
    run_dir = Path(args.output_dir)
    failures.keep_tracebacks_in(run_dir / "errors")
    device = join_the_ranks(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = check_inputs(args, device)
    data, batches, max_steps = inputs.data, inputs.batches, inputs.max_steps
    held = hold_the_run(run_dir)
    node_local, resume_dir, resume_tag = checkpoint_place(args, run_dir)
    if resume_tag is not None:
        inputs = fit_to_checkpoint(args, inputs, resume_dir / resume_tag)
        batches = inputs.batches
    elif line := inputs.batch_note():
        say(line)

    hf_model, model_config, init_checkpoint = pretraining_model(args, inputs, resuming=resume_tag is not None)
    model = PretrainingModel(hf_model, attention=attention_layout(inputs.config))
    torch.manual_seed(args.seed + rank)  # dropout differs per rank

    # ---- how the ranks communicate: one object, chosen from the config (comm/mode.py)
    engine, optimizer, scheduler, mode, ds_config = build_engine(inputs.config, model, node_local_checkpoints=node_local,
                                                                 batch=tuple(inputs.batch))
    topology = Topology.discover()  # which ranks share a node: the launcher's hostfile
    say(*mode.attach(engine, optimizer, model, topology))
    if args.compile:
        engine.compile(compile_kwargs={"dynamic": True})  # batch widths and token counts vary
    traffic = BytesCounter(topology.node_of).install()
    samples, clocks, dealt = 0, {}, None
    if resume_tag is not None:
        samples, clocks, dealt = resume(args, engine, mode, batches, resume_dir, resume_tag, data)
    elif init_checkpoint is not None:
        checkpoint.load(engine, *init_checkpoint, weights_only=True)
    say(*mode.ready())
    balancer = share_the_steps(inputs, batches, mode, dealt, device)

    def export() -> None:
        # in a DiLoCo round, or between two 0/1 Adam syncs, each rank has a model of its own;
        # evaluation and export use the one the ranks share
        with mode.shared_model():
            if rank == 0:
                export_hf_model(hf_model, data.vocab_path, data.lowercase, run_dir / HF_MODEL)

    if args.export_only:
        export()
        dist.barrier()
        if held:
            held.release()
        return
    run_config = start_records(run_dir, args, inputs, ds_config, mode.name, model_config, node_local)
    if args.watch_downstream:
        start_watcher(args.watch_downstream, run_dir, rank)
    # metrics.jsonl, and the sinks of the config's tensorboard / csv_monitor / wandb blocks
    metrics = MetricsLogger(run_dir, enabled=rank == 0, start_step=engine.global_steps, ds_config=ds_config,
                            run_config=run_config)
    stop = StopRequest()
    bookkeeping = Bookkeeping(device=device, world=world, total_batch=inputs.total_batch, max_steps=max_steps,
                              log_every=args.log_every, eval_every=args.eval_every, save_every=args.save_every,
                              save_every_minutes=args.save_every_minutes, time_budget=args.time_budget,
                              traffic=traffic, nodes=len(topology.nodes), clocks=clocks)

    def save() -> None:
        client_state = {"data": batches.state_dict(), "samples": samples, "args": vars(args),
                        "balance": balancer.state_dict(),
                        "batch": {"global_batch": inputs.batch.total, "micro_batch": inputs.batch.micro,
                                  "accumulation": inputs.batch.accumulation, "world_size": world},
                        "clocks": bookkeeping.clocks(), "data_digest": data.digest}
        shared, rank_state = mode.state()
        client_state.update(shared)
        checkpoint.save(engine, run_dir / CHECKPOINTS, engine.global_steps, client_state,
                        args.keep_checkpoints, rank_state, node_local)
        bookkeeping.saved()

    mode.begin(bookkeeping.unlogged)

    with bookkeeping.unlogged():  # the loop's own allreduce, not training's traffic
        plateau = plateau_check(args, inputs, model_config.vocab_size, device)

    def validate(step: int) -> dict:
        """The held-out MLM accuracy and loss, and whether the run is still on the plateau."""
        result = bookkeeping.evaluate(lambda: evaluate(engine, inputs.val_batches, device, mode.shared_model,
                                                       args.eval_batches))
        if plateau:
            fields, warning = plateau.fields(step, samples, result["val_mlm_acc"])
            result.update(fields)
            if warning:
                say(warning)
        return result

    # ---- the loop
    last_eval: dict = {}
    stopped_by = "max steps"
    data_iter = iter(batches)
    trimmer = HeapTrimmer(args.trim_host_memory_every)
    loss_to_backward = loss_for_backward(engine)  # fp16 at ZeRO stage 0: the loss scale DeepSpeed 0.19 leaves out
    # each rank ends its step at its own last micro-batch (ranks of unequal speed train unequal
    # numbers of them); a config with "managed_gradient_accumulation": false owns it through step()
    own_boundary = engine.managed_gradient_accumulation()
    engine.train()
    try:
        while engine.global_steps < max_steps:
            step = engine.global_steps + 1
            mode.start_step(logged=bookkeeping.is_log_step(step))
            balancer.start_step(step)
            micro_batches = batches.micro_batches_per_step(inputs.accumulation)  # this rank's share
            for micro in range(micro_batches):
                batch = bookkeeping.next_batch(data_iter)
                flops = executed_training_flops(model_config, batch)  # from the host copy: no device sync
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                boundary = micro == micro_batches - 1
                if own_boundary:
                    engine.set_gradient_accumulation_boundary(boundary)
                with mode.micro_batch(boundary):
                    with balancer.forward():
                        loss, stats = engine(batch)
                    engine.backward(loss_to_backward(loss))
                    balancer.after_backward()
                if boundary:
                    mode.after_backward()
                engine.step()
                bookkeeping.add_micro_batch(loss, stats, batch["real_tokens"], flops)
            mode.after_step(step, last=step >= max_steps)
            dealt_fields = balancer.metric_fields()  # the shares this step trained on
            if (deal := balancer.after_step(step, bookkeeping.unlogged)) is not None:
                data_iter.close()  # at the step's boundary: the loader goes on with the new owners
                batches.set_deal(deal)
                mode.balance(balancer.rank_weight)
                data_iter = iter(batches)
                say(f"balance at step {step}: {balancer.counts_line()}")
            trimmer.after_step(step)
            bookkeeping.end_step(*mode.grad_norm())
            samples += inputs.total_batch
            decision = bookkeeping.decide(step, stop.signalled)

            if decision.log:
                row = bookkeeping.row(step, samples, scheduler.get_last_lr()[0] if scheduler else engine.get_lr()[0],
                                      current_loss_scale(engine.optimizer))
                row.update(mode.metric_fields())
                row.update(dealt_fields)
                if args.compile:  # grows with every recompile: a step whose shapes the graphs did not cover
                    row["compiled_graphs"] = dynamo_counters["stats"]["unique_graphs"]
                if decision.evaluate:
                    last_eval = validate(step)
                    row.update(last_eval)
                with bookkeeping.holding(Exception, what="the metrics could not be written: "):
                    metrics.log(row)
                say(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
            elif decision.evaluate:
                trained_s = bookkeeping.trained_s()
                last_eval = validate(step)
                with bookkeeping.holding(Exception, what="the metrics could not be written: "):
                    metrics.log({"step": step, "samples": samples, "elapsed_s": trained_s, **last_eval})
            if decision.save and bookkeeping.any_error():  # a step after some rank's error is not saved
                decision.stop = "error"
            elif decision.save:
                with bookkeeping.unlogged():
                    try:
                        save()
                    except checkpoint.CheckpointError as exc:
                        if args.on_save_error == "stop" or decision.stop is not None:
                            raise
                        say(f"warning: {exc} (--on-save-error continue: training goes on without it)")
            if decision.stop == "error":
                data_iter.close()
                stop_for_error(bookkeeping, step)
            if decision.stop in ("signal", "time budget"):
                stopped_by = decision.stop
                say(f"stopping at step {step}: {decision.stop}; checkpoint saved")
                break
    except checkpoint.CheckpointError as exc:
        data_iter.close()
        fail(str(exc), status=3)
    # the loader's workers ignore SIGTERM (data/loader.py): kept alive to the interpreter's exit (a
    # compiled graph did), multiprocessing's exit handler would wait on them for ever
    data_iter.close()
    summary = final_summary(engine, model, device, bookkeeping, samples, stopped_by, last_eval)
    export()
    if rank == 0:
        write_summary(run_dir, summary)
    metrics.close(summary if rank == 0 else None)
    dist.barrier()
    if held:
        held.release()


def run_as_a_rank(argv: list[str] | None = None) -> None:
    """main() as a launched rank runs it: a failure ends the rank in one line (its own, or naming
    the peer that failed or went silent), with status 1 and no traceback on the terminal."""
    try:
        main(argv)
        # Done: a stop signal now changes nothing. Left to the handler, one arriving while the
        # interpreter exits (which restores the default action, a kill) would end a rank that has
        # saved and exported with a signal's status; such signals come late because bert-launch
        # asks each host's ranks again while some host has none left, and namespace hosts, sharing
        # one process table, signal each rank twice.
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
        # Here, not in main(): benchmarks/gpu/session.py calls main() again in the same process.
        release_process_group()
        # The interpreter's exit then frees torch's and transformers' objects one by one: ~1 s a
        # rank, paid by every launch; frozen, the collector skips them (0.15 s).
        gc.freeze()
    except Exception as exc:  # noqa: BLE001 - any failure: one line, from this rank or naming another
        # A collective that failed (a peer died) must end this rank now: a normal exit would
        # join the data-loader workers, which wait on their queues for ever.
        rank, host = os.environ.get("RANK", "?"), socket.gethostname()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        line = failures.lost_peer_line(exc, rank, host)
        if line is not None and rank.isdigit():  # did the peer leave a line? (failures.tell_the_others)
            named = failures.peer_error_line(int(rank), host, world)
            line = line if named is None else named
        if line is None:  # this rank's own error: its line, told to the others
            line = failures.crash_line(exc, rank, host)
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            failures.tell_the_others(line, int(rank) if rank.isdigit() else -1, world)
        elif line:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    run_as_a_rank()
