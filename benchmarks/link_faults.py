"""A link that goes down under a running job: what the job does, timed.

Two namespace hosts (tools/netns_cluster.py) of one rank each, `tiny` through `bert-launch` and
DeepSpeed's pdsh launcher, as a user's two-node job runs. At step `--at`, node2's cable comes out
of the switch (its connections stall, neither end told) for `--flap` seconds, or for good
(`--flap 0`): then the link comes back and a relaunch with `--resume auto` finishes the run. Reported:
whether the job trained on, and for a link down for good, when each rank and the launch ended
after the cut, the ranks' lines, the step the relaunch resumed from and whether any step was
logged twice.

    python benchmarks/link_faults.py --data DATA --work DIR --flap 20 [--dist-timeout-minutes 10]
    python benchmarks/link_faults.py --data DATA --work DIR --flap 0 --dist-timeout-minutes 1 [--json OUT]

Why a driver of our own: the cut must land at a chosen step of a real launch across hosts.
Needs root (network namespaces) and pdsh.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_common import cpu_name

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tools.netns_cluster import Cluster  # noqa: E402

BERT_LAUNCH = Path(sys.executable).parent / "bert-launch"
RANK_LINE = re.compile(r"^node\d+: (train\.py: error: .*)$")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="shards of bert-data-prep")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--flap", type=float, required=True, help="seconds the link stays down; 0: for good")
    p.add_argument("--at", type=int, default=40, help="the step at which the link goes down")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dist-timeout-minutes", type=float, default=None, help="default: train.py's")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    cluster = Cluster.up(args.work / "cluster", hosts=2, slots=1)
    run = args.work / "run"
    command = [*cluster.exec_prefix(0), str(BERT_LAUNCH), "--hostfile", str(cluster.hostfile), "--master_port", "29677",
               "train.py", "--deepspeed_config", "ds_configs/cpu_tiny_lamb.json", "--data", str(args.data),
               "--model", "tiny", "--output-dir", str(run), "--max-steps", str(args.steps), "--log-every", "5",
               "--num-workers", "1", "--save-every", "20", "--resume", "auto",
               *(["--dist-timeout-minutes", str(args.dist_timeout_minutes)] if args.dist_timeout_minutes else [])]
    result = {"machine": cpu_name(), "command": " ".join(sys.argv), "flap_s": args.flap, "at_step": args.at,
              "dist_timeout_minutes": args.dist_timeout_minutes}
    try:
        log = args.work / "launch1.log"
        launch = subprocess.Popen(command, cwd=REPO, env=cluster.env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        metrics = run / "metrics.jsonl"

        def step() -> int:
            rows = metrics.read_text().split("\n")[:-1] if metrics.exists() else []
            return max((json.loads(r)["step"] for r in rows), default=0)
        while step() < args.at:
            if launch.poll() is not None:
                raise SystemExit(f"the launch ended before step {args.at}: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        cluster.set_link_up(1, False)
        cut = time.monotonic()
        result["cut_at_step"] = step()
        if args.flap:
            time.sleep(args.flap)
            cluster.set_link_up(1, True)
            launch.wait(timeout=3600)
            result.update(trained_on=launch.returncode == 0, returncode=launch.returncode, final_step=step(),
                          seconds=round(time.monotonic() - cut, 1))
        else:
            ended = {}
            while launch.poll() is None and time.monotonic() - cut < 1800:
                for line in log.read_text().splitlines():
                    if (m := RANK_LINE.match(line)) and m.group(1) not in ended:
                        ended[m.group(1)] = round(time.monotonic() - cut, 1)
                time.sleep(0.5)
            result.update(launch_ended_s=round(time.monotonic() - cut, 1), returncode=launch.poll(),
                          rank_lines_seen_s=ended, tail=log.read_text().splitlines()[-6:])
            cluster.set_link_up(1, True)
            if launch.poll() is None:
                launch.kill()
            relaunch = subprocess.run(command, cwd=REPO, env=cluster.env, capture_output=True, text=True,
                                      timeout=1800, check=False)
            (args.work / "launch2.log").write_text(relaunch.stdout + relaunch.stderr)
            resumed = re.search(r"resuming from \S+ at step (\d+)", relaunch.stdout)
            steps = [json.loads(r)["step"] for r in metrics.read_text().splitlines() if "loss" in json.loads(r)]
            result.update(relaunch_returncode=relaunch.returncode, resumed_at=int(resumed.group(1)) if resumed else None,
                          final_step=step(), steps_logged_twice=len(steps) - len(set(steps)))
    finally:
        cluster.down()
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
