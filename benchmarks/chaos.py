"""A chaos run: training that is killed again and again, and whose checkpoints are damaged, must
end where an uninterrupted run ends.

`tiny` on 2 ranks through `bert-launch` with `--resume auto`, relaunched after every fault until it
finishes; meanwhile the driver kills a random rank with SIGKILL (at a random step, or while a
checkpoint is being written) and, before some relaunches, truncates or flips a byte of the newest
checkpoint. At the end it compares with an uninterrupted run of the same command: every step's
loss, accuracy, gradient norm and samples (the data order), and the final weights, bit for bit
(fp32). It reports each fault, the steps it cost (trained again after the relaunch) and the time.

    python benchmarks/chaos.py --data DATA --work DIR [--steps 1000] [--kills 10] [--save-kills 3]
                               [--damages 2] [--save-every 50] [--seed 0] [--reference RUN] [--json OUT]

`--reference RUN`: an uninterrupted run of the same arguments made before (otherwise one is made).
Why a driver of our own: the faults must land at chosen moments of a real launch (during a save,
between two), which no test harness of the libraries offers.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from bench_common import cpu_name

REPO = Path(__file__).resolve().parents[1]
BERT_LAUNCH = Path(sys.executable).parent / "bert-launch"
STEP_LINE = re.compile(r"^step (\d+) ")
RESUMED = re.compile(r"resuming from \S+ at step (\d+)")
COMPARED = ("step", "samples", "loss", "mlm_acc", "grad_norm", "lr", "val_mlm_acc", "val_loss")


def training_args(data: Path, steps: int, save_every: int, config: Path) -> list[str]:
    return ["--deepspeed_config", str(config), "--model", "tiny", "--num-workers", "1", "--data", str(data),
            "--max-steps", str(steps), "--log-every", "1", "--eval-every", str(max(steps // 2, 1)),
            "--save-every", str(save_every), "--keep-checkpoints", "2", "--dist-timeout-minutes", "1"]


def config_spanning(config: Path, steps: int, work: Path) -> Path:
    """The config with its schedule's end at `steps`: past the end the rate is 0, and a run that
    trains nothing would end as the uninterrupted one however badly it resumed."""
    settings = json.loads(config.read_text())
    params = settings.get("scheduler", {}).get("params", {})
    if "total_num_steps" in params:
        params["total_num_steps"] = steps
    path = work / f"{config.stem}_{steps}_steps.json"
    path.write_text(json.dumps(settings, indent=1))
    return path


def command(run: Path, args: list[str], port: int) -> list[str]:
    return [str(BERT_LAUNCH), "--num_gpus", "2", "--master_port", str(port), "train.py", *args,
            "--output-dir", str(run), "--resume", "auto"]


def ranks_of(launcher: psutil.Process) -> list[psutil.Process]:
    found = []
    for child in launcher.children(recursive=True):
        try:
            line = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "train.py" in line and "--local_rank" in line:
            found.append(child)
    pids = {p.pid for p in found}
    return [p for p in found if p.ppid() not in pids]  # not the data loaders' workers (forked ranks)


class Launch:
    """One launch of the run, its output read as it comes: the steps it trained, where it resumed."""

    def __init__(self, run: Path, args: list[str], port: int):
        self.started = time.monotonic()
        self.proc = subprocess.Popen(command(run, args, port), cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.steps: list[int] = []
        self.resumed_from = 0
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if match := STEP_LINE.match(line):
                self.steps.append(int(match.group(1)))
            elif match := RESUMED.search(line):
                self.resumed_from = int(match.group(1))

    def wait(self, timeout: float = 900) -> int:
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        self.seconds = time.monotonic() - self.started
        return code


def saving(run: Path) -> bool:
    """A checkpoint is being written: a step directory newer than `latest`, without its digest."""
    directory = run / "checkpoints"
    if not directory.is_dir():
        return False
    latest = (directory / "latest").read_text().strip() if (directory / "latest").is_file() else ""
    return any(p.name > latest and not (p / "digest.json").exists()
               for p in directory.iterdir() if p.is_dir() and p.name.startswith("step_"))


def kill_a_rank(launch: Launch, run: Path, moment: int, during_save: bool, rng: random.Random) -> dict | None:
    """SIGKILL to one rank once the launch has trained step `moment`: at once, or while the next
    checkpoint is being written (polled every 5 ms); None if the launch ended first."""
    while launch.proc.poll() is None:
        due = bool(launch.steps) and launch.steps[-1] >= moment and (not during_save or saving(run))
        if due:
            ranks = ranks_of(psutil.Process(launch.proc.pid))
            if len(ranks) == 2:
                victim = rng.choice(ranks)
                local_rank = next(a.split("=")[1] for a in victim.cmdline() if a.startswith("--local_rank"))
                with_save = saving(run)
                victim.send_signal(signal.SIGKILL)
                return {"kind": "kill", "planned": "during a save" if during_save else "at a step",
                        "moment": moment, "rank": int(local_rank),
                        "after_step": launch.steps[-1], "during_save": with_save}
        time.sleep(0.005)
    return None


def checkpoints(run: Path) -> list[str]:
    """The whole checkpoints (a save killed midway leaves a step directory without its digest)."""
    directory = run / "checkpoints"
    return sorted(p.name for p in directory.iterdir() if re.fullmatch(r"step_\d{8}", p.name)
                  and (p / "digest.json").is_file()) if directory.is_dir() else []


def damage_newest(run: Path, how: str) -> str | None:
    directory = run / "checkpoints"
    latest = (directory / "latest").read_text().strip() if (directory / "latest").is_file() else None
    if not latest:
        return None
    model = directory / latest / "mp_rank_00_model_states.pt"
    data = bytearray(model.read_bytes())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    return latest


def uninterrupted(run: Path, args: list[str], port: int) -> float:
    launch = Launch(run, args, port)
    if launch.wait() != 0:
        raise SystemExit("the uninterrupted run failed:\n" + "\n".join(launch.lines[-30:]))
    return launch.seconds


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def same_weights(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file
    first, second = load_file(str(a / "hf_model" / "model.safetensors")), load_file(str(b / "hf_model" / "model.safetensors"))
    return first.keys() == second.keys() and all(first[k].equal(second[k]) for k in first)


def chaos(work: Path, args: list[str], steps: int, kills: int, save_kills: int, damages: int, seed: int,
          reference: Path | None, port: int = 29650) -> dict:
    """`args`: train.py's arguments but --output-dir and --resume (the same for the reference run);
    `steps`: its --max-steps."""
    rng = random.Random(seed)
    args = list(map(str, args))
    reference_s = None
    if reference is None:
        reference = work / "reference"
        shutil.rmtree(reference, ignore_errors=True)
        reference_s = uninterrupted(reference, args, port)
    run = work / "chaos"
    shutil.rmtree(run, ignore_errors=True)
    # the kills' moments spread over the run (a kill lands after its step, the next after the
    # relaunch has gone past it again); which of them wait for a checkpoint being written
    kinds = ["save"] * save_kills + ["step"] * (kills - save_kills)
    rng.shuffle(kinds)
    plan = list(zip(sorted(rng.sample(range(1, steps), kills)), kinds))
    damage_after = set(rng.sample(range(1, kills + 1), damages)) if damages else set()
    damage_kinds = ["truncate", "flip"] * damages
    faults, launches, started = [], [], time.monotonic()
    while True:
        launch = Launch(run, args, port)
        fault = None
        if plan:
            moment, kind = plan[0]
            fault = kill_a_rank(launch, run, moment, kind == "save", rng)
        code = launch.wait()
        launches.append({"resumed_from": launch.resumed_from, "trained": launch.steps, "exit": code,
                         "seconds": launch.seconds, "notes": [line for line in launch.lines if "is damaged" in line],
                         "errors": [line for line in launch.lines if "error" in line.lower()][-3:]})
        if fault is not None:
            plan.pop(0)
            faults.append(fault)
            due = len([f for f in faults if f["kind"] == "kill"]) >= min(damage_after, default=kills + 1)
            if due and len(checkpoints(run)) >= 2:  # else after the next kill: with one, none is left to go back to
                damage_after.discard(min(damage_after))
                how = damage_kinds.pop(0)
                faults.append({"kind": "damage", "checkpoint": damage_newest(run, how), "how": how})
            continue
        if code != 0:
            raise SystemExit(f"launch {len(launches)} failed without a fault (exit {code}):\n" + "\n".join(launch.lines[-40:]))
        if json.loads((run / "summary.json").read_text())["step"] != steps:
            raise SystemExit(f"launch {len(launches)} ended before step {steps} without a fault")
        break  # the kills still planned found no launch to land in
    # what each kill cost: the steps trained before it that the next launch trained again
    kill_indices = [i for i, f in enumerate(faults) if f["kind"] == "kill"]
    for number, index in enumerate(kill_indices):
        before = launches[number]["trained"][-1] if launches[number]["trained"] else launches[number]["resumed_from"]
        faults[index]["resumed_from_next"] = launches[number + 1]["resumed_from"]
        faults[index]["steps_lost"] = before - launches[number + 1]["resumed_from"]
    trained = [s for launch in launches for s in launch["trained"]]
    every_step_once_in_the_end = [r["step"] for r in rows(run)] == [r["step"] for r in rows(reference)]
    skipped = sorted({r["step"] for r in rows(reference)} - set(trained))  # logged steps no launch trained
    identical_rows = [[r.get(k) for k in COMPARED] for r in rows(run)] == \
        [[r.get(k) for k in COMPARED] for r in rows(reference)]
    return {
        "steps": steps, "kills": sum(f["kind"] == "kill" for f in faults),
        "kills_during_a_save": sum(f["kind"] == "kill" and f["during_save"] for f in faults),
        "damaged_checkpoints": sum(f["kind"] == "damage" for f in faults),
        "launches": len(launches), "steps_lost": sum(f.get("steps_lost", 0) for f in faults),
        "steps_skipped": skipped, "every_step_once_in_the_end": every_step_once_in_the_end,
        "identical_metrics": identical_rows, "identical_weights": same_weights(run, reference),
        "seconds": time.monotonic() - started, "reference_seconds": reference_s, "faults": faults,
        "launch_log": launches,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--save-kills", type=int, default=3, help="of the kills, those while a checkpoint is written")
    parser.add_argument("--damages", type=int, default=2, help="damaged checkpoints (truncated, then a byte flipped)")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", type=Path, default=REPO / "ds_configs" / "cpu_tiny_lamb.json")
    parser.add_argument("--reference", type=Path, help="an uninterrupted run of the same arguments")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    config = config_spanning(args.config, args.steps, args.work)
    result = chaos(args.work, training_args(args.data, args.steps, args.save_every, config), args.steps,
                   args.kills, args.save_kills, args.damages, args.seed, args.reference)
    result["machine"] = f"{cpu_name()}, {os.cpu_count()} cores"
    result["command"] = " ".join(sys.argv)
    print(f"chaos: {result['steps']} steps, {result['kills']} kills ({result['kills_during_a_save']} during a save), "
          f"{result['damaged_checkpoints']} damaged checkpoints, {result['launches']} launches; {result['steps_lost']} "
          f"steps trained again, skipped {result['steps_skipped'] or 'none'}; "
          f"identical metrics {result['identical_metrics']}, identical weights {result['identical_weights']}; "
          f"{result['seconds']:.0f} s against {result['reference_seconds'] or 0:.0f} s uninterrupted")
    for fault in result["faults"]:
        print("  ", json.dumps(fault))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    sys.exit(0 if result["identical_metrics"] and result["identical_weights"] and not result["steps_skipped"] else 1)


if __name__ == "__main__":
    main()
