"""--watch-downstream: `bert-finetune --watch` beside the training, as a process of its own.

The training only builds a command line and starts it: the fine-tuning code and its imports stay
in their own process, so the pretraining entry point does not depend on evaluation. The flags are
checked before the first step by running the same command with `--check-only`, so a typo fails
the launch instead of the first probe an hour in.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

FINETUNE = [sys.executable, "-m", "commodity_bert.finetune"]
ERROR_PREFIX = "bert-finetune: error: "


class WatcherError(Exception):
    """Flags bert-finetune refuses, in its own words."""


def watcher_command(run_dir: Path, finetune_args: str, training_pid: int) -> list[str]:
    """On the CPU with one thread unless the flags say otherwise (the training owns the cores
    and GPUs), ending with the training."""
    try:
        argv = shlex.split(finetune_args)
    except ValueError as exc:  # an unclosed quote
        raise WatcherError(str(exc)) from exc
    if "-h" in argv or "--help" in argv:
        raise WatcherError("give bert-finetune's flags (see bert-finetune --help)")

    def given(flag):
        return any(a == flag or a.startswith(flag + "=") for a in argv)
    if not given("--device"):
        argv += ["--device", "cpu"]
    if not given("--threads"):
        argv += ["--threads", "1"]
    return [*FINETUNE, "--watch", str(run_dir), "--stop-with-pid", str(training_pid), "--quiet", *argv]


def check(command: list[str], timeout: float = 300) -> None:
    """bert-finetune parses the flags and reads the task's files, and says what is wrong."""
    proc = subprocess.run([*command, "--check-only"], capture_output=True, text=True, timeout=timeout, check=False,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        line = lines[-1] if lines else f"bert-finetune exited with status {proc.returncode}"
        raise WatcherError(line.removeprefix(ERROR_PREFIX))


def start(command: list[str], run_dir: Path) -> subprocess.Popen:
    """In its own session (the launcher's signals are for the ranks), at the lowest CPU
    priority; its output goes to RUN/downstream.log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "downstream.log", "a") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=lambda: os.nice(19))
