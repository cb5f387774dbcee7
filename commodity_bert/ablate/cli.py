"""bert-ablate: run DeepSpeed config variants one after another on the same data, seeds and
budget, and compare them.

    bert-ablate --configs A.json B.json --data DIR --model mini --ranks 2 --samples 19200 --out ABL
    bert-ablate --base C.json --vary optimizer.params.lr=1e-3,5e-3 [--vary KEY=...] ... --out ABL

Each variant becomes a complete config in ABL/configs/ (its lr schedule fitted to the budget)
and each (variant, seed) one plain `train.py` run under the DeepSpeed launcher, listed in
ABL/commands.sh, with its RUN directory in ABL/runs/VARIANT/seed_N. Running the command again
skips finished runs and resumes interrupted ones from their checkpoints; a later command with
other variants but the same data, model, ranks and budget adds them to the same comparison.
A failing run is recorded with its error line and the others go on. Output: ABL/results.json,
ABL/results.md, ABL/curves.png and, when bytes differ, ABL/bytes.png.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import math
import shlex
import signal
import sys
import time
from pathlib import Path

from tqdm import tqdm

from commodity_bert.ablate import grid, report, runs, slurm
from commodity_bert.ablate.record import Ablation, AblationError, downstream_file, run_downstream
from commodity_bert.cli_help import one_line_parser, show_defaults
from commodity_bert.host import atomic_write_text, free_port
from commodity_bert.model.card import refresh_card
from commodity_bert.run_config import RunConfig
from commodity_bert.train.launch_checks import LaunchError, resolve_batch_sizes


OneLineParser = one_line_parser(AblationError)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="bert-ablate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_argument_group("the variants (one of)")
    which.add_argument("--configs", type=Path, nargs="+", metavar="JSON", help="whole DeepSpeed configs, one variant each")
    which.add_argument("--base", type=Path, metavar="JSON", help="a DeepSpeed config that --vary changes")
    which.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2",
                       help="a dotted key into the config and its values (JSON, or text such as auto; null "
                            "removes the key); several --vary make the grid")
    what = p.add_argument_group("the runs")
    what.add_argument("--data", type=Path, required=True, help="shards of bert-data-prep")
    what.add_argument("--model", required=True, help="tiny | mini | small | medium | base | large | a BertConfig JSON")
    where = what.add_mutually_exclusive_group()
    where.add_argument("--ranks", type=int, default=1, help="ranks on this machine (deepspeed --num_gpus)")
    where.add_argument("--hostfile", type=Path, help="a DeepSpeed hostfile (the RUN directories must be reachable "
                                                     "by every host at the same path)")
    budget = what.add_mutually_exclusive_group(required=True)
    budget.add_argument("--samples", type=int, help="train every run on this many samples")
    budget.add_argument("--minutes", type=float, help="train every run this long (train.py --time-budget)")
    what.add_argument("--seeds", type=int, nargs="+", default=[1])
    what.add_argument("--eval-every", type=int, help="validate every N steps (default: 10 evaluations a run)")
    what.add_argument("--log-every", type=int, help="a metrics row every N steps (default: about 30 a run, ≤ 10)")
    what.add_argument("--save-every-minutes", type=float, default=5.0,
                      help="checkpoint period: what an interruption can lose")
    what.add_argument("--train-args", default="", help="more train.py flags for every run, e.g. \"--num-workers 1\"")
    judge = p.add_argument_group("the comparison")
    judge.add_argument("--target", type=float, help="validation MLM accuracy to reach (0.11 or 11 for 11%%): "
                                                    "samples_to_target, seconds_to_target")
    judge.add_argument("--downstream", metavar="TASK", nargs="+", help="fine-tune each finished run's model on each TASK "
                                                            "(bert-finetune --task, e.g. embedded:polarity)")
    judge.add_argument("--downstream-args", default="--seeds 1 2 3",
                       help="bert-finetune flags for --downstream (default: %(default)s)")
    p.add_argument("--out", type=Path, required=True, help="the ablation's directory, ABL")
    p.add_argument("--slurm", action="store_true", help="submit the unfinished runs as a Slurm job array (each "
                   "through recipes/slurm/pretrain.sbatch) and the report as a job after it, then return")
    p.add_argument("--sbatch-args", default="", metavar="ARGS",
                   help="sbatch options for --slurm's jobs, e.g. \"--partition gpu --gpus-per-node 8 --cpus-per-task 32 --time 4:00:00\"")
    p.add_argument("--dry-run", action="store_true", help="write the configs and commands.sh, run nothing")
    p.add_argument("--report-only", action="store_true", help="rebuild results and plots from ABL's runs, run nothing")
    return show_defaults(p)


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if bool(args.configs) == bool(args.base):
        raise AblationError("give either --configs A.json B.json ... or --base C.json --vary KEY=V1,V2")
    if args.configs and args.vary:
        raise AblationError("--vary changes --base; with --configs every file is a variant as it is")
    if args.base and not args.vary:
        raise AblationError("--base needs at least one --vary KEY=V1,V2")
    for name in ("ranks", "samples", "eval_every", "log_every"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise AblationError(f"--{name.replace('_', '-')} must be a positive integer, not {value}")
    if args.minutes is not None and args.minutes <= 0:
        raise AblationError(f"--minutes must be positive, not {args.minutes}")
    if args.sbatch_args and not args.slurm:
        raise AblationError("--sbatch-args goes with --slurm")
    if args.target is not None and args.target > 1:
        args.target /= 100
    return args


def hostfile_slots(path: Path) -> int:
    if not path.is_file():
        raise AblationError(f"--hostfile {path} not found")
    slots = 0
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        parts = dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)
        if "slots" not in parts or not parts["slots"].isdigit():
            raise AblationError(f"--hostfile {path}: {line!r} is not 'HOST slots=N'")
        slots += int(parts["slots"])
    if not slots:
        raise AblationError(f"--hostfile {path} lists no hosts")
    return slots


def failure_of(run: runs.Run, failures: dict) -> str | None:
    """Why the run failed: bert-ablate's record, or the one its Slurm array task left (failed.json)."""
    recorded = run.run_dir / "failed.json"
    if recorded.exists():
        slurm = json.loads(recorded.read_text())
        return f"exit {slurm['exit']}: {slurm['error']}"
    return failures.get(f"{run.variant}/{run.seed}")


def status_of(run: runs.Run, failures: dict) -> str:
    if runs.is_finished(run):
        return "finished"
    if failure_of(run, failures):
        return "failed"
    if runs.has_checkpoint(run) or run.log_path.exists():
        return "interrupted"
    return "pending"


def write_outputs(ablation: Ablation) -> None:
    settings = ablation.state["settings"]
    results = []
    for run in ablation.all_runs():
        status = status_of(run, ablation.state["failures"])
        row = {"variant": run.variant, "config": str(run.config_path), "seed": run.seed, "status": status,
               "run_dir": str(run.run_dir), "max_steps": run.max_steps,
               **runs.figures(run, settings.get("target"))}
        if status == "failed":
            row["error"] = failure_of(run, ablation.state["failures"])
        downstream = run.run_dir / "downstream.json"
        if status == "finished" and downstream.exists():
            probe = json.loads(downstream.read_text())
            row["downstream"] = {k: v for k, v in probe.items()
                                 if k in ("task", "family", "metric", "median", "min", "max", "per_seed", "seconds",
                                          "lr")}
            # what needs no pretraining: the family's own baseline
            model_free = probe.get("bag_of_words") or probe.get("sliding_window") or probe.get("majority_tag") or {}
            row["downstream"]["bag_of_words"] = (probe.get("bag_of_words") or {}).get("value")
            row["downstream"]["no_model_baseline"] = model_free.get("value")
            if isinstance(probe.get("exact_match"), dict):
                row["downstream"]["exact_match"] = probe["exact_match"]["median"]
            row["downstream"]["random_init"] = (probe.get("random_init") or {}).get("median")
            frozen = probe.get("linear_probe") or {}
            row["downstream"]["linear_probe"] = (frozen.get("pretrained") or {}).get("value")
            row["downstream_tasks"] = {}
            for path in sorted((run.run_dir / "downstream").glob("*.json")):
                result = json.loads(path.read_text())
                row["downstream_tasks"][result["task"]] = {k: result.get(k) for k in ("family", "metric", "median",
                                                                                       "min", "max")}
        results.append(row)
    atomic_write_text(ablation.out / "results.json", json.dumps(results, indent=1) + "\n")
    atomic_write_text(ablation.out / "results.md", report.markdown(results, settings, ablation.state["variants"]))
    try:
        report.plots(results, ablation.out)
    except ImportError:
        print("bert-ablate: matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)


def write_commands(ablation: Ablation) -> None:
    settings = ablation.state["settings"]
    lines = ["#!/usr/bin/env bash",
             f"# written by: {settings.get('argv', 'bert-ablate')}",
             "# One training run per line, as bert-ablate runs them (it adds a free --master_port).",
             "# bert-launch takes deepspeed's arguments and passes Ctrl-C or a preemption on to the ranks,",
             "# which checkpoint; plain `deepspeed` in its place trains the same run.",
             "set -e", f"cd {shlex.quote(str(runs.REPO))}"]
    for run in ablation.all_runs():
        cmd = runs.command(run, settings, port=0)
        at = cmd.index("--master_port")
        lines.append(shlex.join(cmd[:at] + cmd[at + 2:]))
    path = ablation.out / "commands.sh"
    atomic_write_text(path, "\n".join(lines) + "\n")
    path.chmod(0o755)


def hold_lock(out: Path):
    """One bert-ablate per ABL directory: two would write its records over each other."""
    out.mkdir(parents=True, exist_ok=True)
    lock = open(out / ".lock", "a+")  # noqa: SIM115 - closed when the process ends
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        raise AblationError(f"another bert-ablate is running in {out}; wait for it, or use another --out") from exc
    return lock


def plan(args: argparse.Namespace) -> tuple[Ablation, list[runs.Run]]:
    if not (args.data / "manifest.json").is_file():
        raise AblationError(f"--data {args.data}: no manifest.json; make shards with bert-data-prep shards")
    world = hostfile_slots(args.hostfile) if args.hostfile else args.ranks
    variants = grid.from_configs(args.configs) if args.configs else grid.from_vary(args.base, args.vary)
    settings = {"data": str(args.data.resolve()), "model": args.model,
                "ranks": None if args.hostfile else args.ranks,
                "hostfile": str(args.hostfile.resolve()) if args.hostfile else None, "world_size": world,
                "samples": args.samples, "minutes": args.minutes, "target": args.target,
                "save_every_minutes": args.save_every_minutes, "train_args": args.train_args,
                "argv": shlex.join(["bert-ablate", *sys.argv[1:]])}
    out = args.out.resolve()
    ablation = Ablation(out, settings)
    planned = []
    for variant in variants:
        try:
            total_batch, _, _ = resolve_batch_sizes(variant.config, world)
        except LaunchError as exc:
            raise AblationError(f"variant {variant.name}: {exc}") from exc
        if args.samples:
            steps = math.ceil(args.samples / total_batch)
            config = grid.fit_to_budget(variant.config, steps)
        else:
            steps = RunConfig.parse(variant.config).total_num_steps
            if not steps:
                raise AblationError(f"variant {variant.name}: --minutes needs total_num_steps in the config's "
                                    f"scheduler (the step cap); or give --samples")
            config = variant.config
        config_path = ablation.add_variant(variant, config, steps)
        for seed in args.seeds:
            run = runs.Run(variant.name, seed, config_path, out / "runs" / variant.name / f"seed_{seed}", steps)
            ablation.add_run(run)
            planned.append(run)
    longest = max(r.max_steps for r in planned)
    settings["eval_every"] = args.eval_every or max(1, longest // 10)
    settings["log_every"] = args.log_every or max(1, min(10, longest // 30))
    return ablation, planned


def main(argv=None) -> None:
    try:
        args = parse_args(argv)
        lock = hold_lock(args.out)
    except AblationError as exc:
        print(f"bert-ablate: error: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        run_ablation(args, argv)
    finally:
        lock.close()


def run_ablation(args: argparse.Namespace, argv: list[str] | None = None) -> None:
    try:
        ablation, planned = plan(args)
    except (AblationError, grid.GridError) as exc:
        print(f"bert-ablate: error: {exc}", file=sys.stderr)
        sys.exit(2)
    out = ablation.out
    ablation.save()
    write_commands(ablation)
    print(f"{len(planned)} runs in {out} ({len({r.variant for r in planned})} variants × {len(args.seeds)} seeds); "
          f"commands: {out / 'commands.sh'}", flush=True)
    if args.slurm and not args.report_only:
        every = ablation.all_runs()
        todo = [i for i, run in enumerate(every) if not runs.is_finished(run)]
        if not todo:
            write_outputs(ablation)
            print(f"every run has finished: nothing to submit; results: {out / 'results.md'}", flush=True)
            return
        try:
            print(slurm.submit(out, ablation.state["settings"], todo, sys.argv[1:] if argv is None else argv,
                               args.sbatch_args, args.downstream, args.downstream_args, args.dry_run), flush=True)
        except slurm.SlurmError as exc:
            print(f"bert-ablate: error: {exc}", file=sys.stderr)
            sys.exit(2)
        return
    if args.dry_run or args.report_only:
        if args.report_only:
            write_outputs(ablation)
            print(f"results: {out / 'results.md'}")
        return

    stop = {"asked": False}

    def ask_stop(signum, frame):
        stop["asked"] = True
        print(f"\nbert-ablate: stopping ({signal.Signals(signum).name}): the current run checkpoints; "
              f"run the same command again to go on", file=sys.stderr, flush=True)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, ask_stop)
    settings = ablation.state["settings"]
    failed = 0
    for i, run in enumerate(planned, 1):
        head = f"[{i}/{len(planned)}] {run.variant} seed {run.seed}"
        if runs.is_finished(run):
            print(f"{head}: finished earlier, kept", flush=True)
        else:
            how = "resuming from its checkpoint" if runs.has_checkpoint(run) else "training"
            print(f"{head}: {how}, {run.max_steps} steps; log {run.log_path}", flush=True)
            cmd = runs.command(run, settings, free_port())
            started = time.time()
            bar = tqdm(total=run.max_steps, desc=run.variant[:40], unit="step", disable=None, leave=False)

            def progress(run=run, bar=bar):
                step = runs.last_step(run)
                if step > bar.n:
                    bar.update(step - bar.n)
                return stop["asked"]

            code = runs.execute(cmd, run, progress)
            bar.close()
            key = f"{run.variant}/{run.seed}"
            if runs.is_finished(run):
                ablation.state["failures"].pop(key, None)
                acc = (runs.summary(run) or {}).get("val_mlm_acc")
                print(f"{head}: finished in {(time.time() - started) / 60:.1f} min"
                      + (f", validation MLM accuracy {100 * acc:.2f}%" if acc is not None else ""), flush=True)
            elif stop["asked"]:
                print(f"{head}: interrupted (exit {code}); its checkpoint is kept", flush=True)
            else:
                failed += 1
                line = runs.error_line(run.log_path.read_text()) if run.log_path.exists() else "no log"
                ablation.state["failures"][key] = f"exit {code}: {line}"
                print(f"{head}: FAILED (exit {code}): {line}", flush=True)
            ablation.save()
        if args.downstream and runs.is_finished(run) \
                and not all(downstream_file(run, task).exists() for task in args.downstream) \
                and not stop["asked"]:
            print(f"{head}: fine-tuning on {', '.join(args.downstream)}", flush=True)
            problem = run_downstream(run, args.downstream, args.downstream_args)
            if problem:
                print(f"{head}: downstream failed: {problem}", flush=True)
            else:
                refresh_card(run.run_dir, lambda line: print(f"{head}: {line}", flush=True))
        write_outputs(ablation)
        if stop["asked"]:
            print(f"stopped; results so far: {out / 'results.md'}", flush=True)
            sys.exit(130)
    write_outputs(ablation)
    print((out / "results.md").read_text())
    print(f"results: {out / 'results.json'}, {out / 'results.md'}, {out / 'curves.png'}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
