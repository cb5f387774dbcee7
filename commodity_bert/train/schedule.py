"""A pretraining schedule sized to a time budget on the machine at hand (recipes/domain.sh).

`--time-budget` alone stops a run when the time is spent, wherever its schedule is: a linear
decay sized for more steps than the budget holds ends with the rate still high, and one sized
for fewer leaves time unused. So the recipe first times a few steps of the very job (model,
batch, ranks, precision), then sets DeepSpeed's `total_num_steps` to the steps that fit:

    python -m commodity_bert.train.schedule config BASE.json OUT.json --steps N --lr LR --batch B
    python -m commodity_bert.train.schedule size RUN/metrics.jsonl 90m      # prints N
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from commodity_bert.host import atomic_write_text
from commodity_bert.run_config import ConfigError, RunConfig

# Time a run spends beside its steps: evaluations, checkpoints, the export, the start-up; a
# 2-core CPU's measured share at five evaluations and checkpoints a run (docs/domain.md).
RESERVE = 0.06
WARMUP_FRACTION = 0.1
SKIPPED_STEPS = 5  # the first steps of a timing run (start-up, first allocations) are not timed


class ScheduleError(Exception):
    """One line for the user."""


def parse_duration(text: str) -> float:
    """'24h', '90m', '1h30m', '45s' or plain seconds → seconds."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 24h, 90m, 1h30m or 3600")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def seconds_per_step(metrics: Path) -> float:
    """The mean step time of a timing run's logged steps after the first SKIPPED_STEPS."""
    try:
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise ScheduleError(f"{metrics}: no timing to read ({exc}); run the timing steps again") from None
    timed = [(r["step"], r["elapsed_s"]) for r in rows if "elapsed_s" in r and "val_loss" not in r]
    timed = [t for t in timed if t[0] >= SKIPPED_STEPS]
    if len(timed) < 2:
        raise ScheduleError(f"{metrics}: fewer than two logged steps after step {SKIPPED_STEPS}; log every few "
                            f"steps of a timing run of 20 or more")
    (first_step, first_s), (last_step, last_s) = timed[0], timed[-1]
    return (last_s - first_s) / (last_step - first_step)


def steps_for(budget_s: float, step_s: float) -> int:
    return max(1, int(budget_s * (1 - RESERVE) / step_s))


def sized_config(base: dict, steps: int, lr: float, batch: int) -> dict:
    """`base` at this rate and micro-batch, its schedule warmed up over the first WARMUP_FRACTION
    of `steps` and decayed linearly to 0 at the end."""
    config = RunConfig.parse(base).sized(steps, lr, batch, WARMUP_FRACTION)
    config["_comment"] = (f"{base.get('_comment', '')} Sized: {steps} steps at lr {lr:g}, micro-batch {batch} "
                          f"(commodity_bert.train.schedule).").strip()
    return config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m commodity_bert.train.schedule", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("config", help="write BASE at this length, rate and micro-batch to OUT")
    c.add_argument("base", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--steps", type=int, required=True)
    c.add_argument("--lr", type=float, required=True)
    c.add_argument("--batch", type=int, required=True)
    s = sub.add_parser("size", help="print the steps that fit BUDGET at a timing run's step time")
    s.add_argument("metrics", type=Path)
    s.add_argument("budget")
    args = p.parse_args(argv)
    try:
        if args.command == "size":
            step_s = seconds_per_step(args.metrics)
            try:
                budget = parse_duration(args.budget)
            except argparse.ArgumentTypeError as exc:
                raise ScheduleError(str(exc)) from None
            steps = steps_for(budget, step_s)
            print(f"{step_s:.3f} s a step: {steps} steps fit {args.budget} ({RESERVE:.0%} kept for evaluations "
                  f"and checkpoints)", file=sys.stderr)
            print(steps)
            return 0
        if args.steps <= 0 or args.batch <= 0 or not args.lr > 0:
            raise ScheduleError("--steps, --batch and --lr must be positive")
        try:
            base = json.loads(args.base.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ScheduleError(f"{args.base}: not a readable DeepSpeed config ({exc})") from None
        try:
            sized = sized_config(base, args.steps, args.lr, args.batch)
        except ConfigError as exc:
            raise ScheduleError(f"{args.base}: {exc}") from None
        atomic_write_text(args.out, json.dumps(sized, indent=1) + "\n")
        return 0
    except ScheduleError as exc:
        print(f"schedule: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
