"""An ablation's record (ABL/ablation.json: its settings, variants and runs) and a finished
run's downstream probe: what `bert-ablate` and its Slurm array tasks (slurm.py) both write."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from commodity_bert.ablate import grid, runs
from commodity_bert.host import atomic_write_text

# settings that must be the same for every run in one ABL directory, or the comparison is not one
FIXED = ("data", "model", "ranks", "hostfile", "samples", "minutes")


class AblationError(Exception):
    pass


class Ablation:
    """ABL/ablation.json: the settings, every variant and every run this directory has seen."""

    def __init__(self, out: Path, settings: dict):
        self.out = out
        self.path = out / "ablation.json"
        self.state = {"settings": settings, "variants": {}, "runs": [], "failures": {}}
        if self.path.exists():
            try:
                earlier = json.loads(self.path.read_text())
            except json.JSONDecodeError as exc:
                raise AblationError(f"{self.path} is not valid JSON ({exc}); repair or remove it") from exc
            for key in FIXED:
                if earlier["settings"].get(key) != settings.get(key):
                    raise AblationError(
                        f"{out} holds runs with {key} = {earlier['settings'].get(key)!r}, not {settings.get(key)!r}; "
                        f"an ablation compares runs made alike: use another --out, or the same {key}")
            self.state = {**earlier, "settings": {**earlier["settings"], **settings}}

    def add_variant(self, variant: grid.Variant, config: dict, max_steps: int) -> Path:
        config_path = self.out / "configs" / f"{variant.name}.json"
        text = json.dumps(config, indent=2) + "\n"
        if config_path.exists() and config_path.read_text() != text:
            raise AblationError(f"{config_path} differs from the variant {variant.name} asked for now; its runs "
                                f"were made with the old one: use another --out, or remove that file and "
                                f"{self.out / 'runs' / variant.name}")
        config_path.parent.mkdir(parents=True, exist_ok=True)
        if not config_path.exists():
            atomic_write_text(config_path, text)
        self.state["variants"][variant.name] = {"config": str(config_path), "changes": variant.changes,
                                                "source": variant.source, "max_steps": max_steps}
        return config_path

    def add_run(self, run: runs.Run) -> None:
        known = {(r["variant"], r["seed"]) for r in self.state["runs"]}
        if (run.variant, run.seed) not in known:
            self.state["runs"].append({"variant": run.variant, "seed": run.seed})

    def all_runs(self) -> list[runs.Run]:
        out = []
        for r in self.state["runs"]:
            v = self.state["variants"][r["variant"]]
            out.append(runs.Run(r["variant"], r["seed"], Path(v["config"]),
                                self.out / "runs" / r["variant"] / f"seed_{r['seed']}", v["max_steps"]))
        return out

    def save(self) -> None:
        atomic_write_text(self.path, json.dumps(self.state, indent=1) + "\n")


def downstream_file(run: runs.Run, task: str) -> Path:
    """RUN/downstream/TASK.json, the layout recipes/evaluate.sh writes (the model card reads both)."""
    return run.run_dir / "downstream" / f"{task.replace(':', '_').replace('/', '_')}.json"


def run_downstream(run: runs.Run, task_names: list[str], extra: str) -> str | None:
    """bert-finetune on the run's exported model, task after task (RUN/downstream/TASK.json; the
    first task's result is also RUN/downstream.json, the report's column); the first error line."""
    finetune = Path(sys.executable).parent / "bert-finetune"
    for k, task in enumerate(task_names):
        out = downstream_file(run, task)
        if out.exists():
            continue  # done before an interruption
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [str(finetune) if finetune.exists() else "bert-finetune", "--model", str(run.run_dir),
               "--task", task, "--json", str(out), "--quiet", *shlex.split(extra)]
        with open(run.run_dir / "downstream.log", "a") as log:
            log.write(f"\n$ {shlex.join(cmd)}\n")
            log.flush()
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
        if proc.returncode:
            return f"{task}: {runs.error_line((run.run_dir / 'downstream.log').read_text())}"
        if k == 0:
            atomic_write_text(run.run_dir / "downstream.json", out.read_text())
    return None
