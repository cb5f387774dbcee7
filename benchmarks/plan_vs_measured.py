"""bert-plan's step-time model against measured training, on the namespace cluster.

For each host count: bring up a cluster of 1-rank hosts whose links are rate-limited (slow
enough that the link, not this machine's shared cores, limits communication), run
`bert-plan preflight` on it with the training's config and data, then train each variant
(LAMB, 1-bit LAMB, LAMB with bucket-wise clipping; benchmarks/slow_network.py's runs) and set
the measured steady step time beside the step time the model predicts from that profile.

    sudo python benchmarks/plan_vs_measured.py [--hosts 1 2 4] [--rate 50mbit] [--model mini]
        [--steps 16] [--log-every 4] [--freeze-step 4] [--work DIR] [--json OUT] [--markdown OUT.md]

Each cell is predicted from the preflight of the same cluster: here all hosts share 2 cores,
so the compute per rank depends on how many hosts run (on a real cluster it does not, and
one profile serves every node count).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from slow_network import one_thread_per_rank, run_variant, set_up, variant_config  # noqa: E402
from tools.netns_cluster import Cluster  # noqa: E402

from commodity_bert.plan import estimate as e  # noqa: E402
from commodity_bert.plan.step_model import step_estimate  # noqa: E402

OPTIMIZER_OF = {"lamb": "lamb", "onebit_lamb": "onebit_lamb", "lamb_bucketwise_clip": "bucketwise"}


def preflight(cluster: Cluster, data: Path, work: Path, args) -> dict:
    config = work / "preflight_config.json"
    config.write_text(json.dumps(variant_config("lamb", args.micro_batch, args.steps, args.freeze_step)))
    out = work / f"profile_{len(cluster.hosts)}hosts.json"
    cmd = [*cluster.exec_prefix(0), str(Path(sys.executable).parent / "deepspeed"), "--hostfile",
           str(cluster.hostfile), "--master_port", "29710", "--module", "commodity_bert.plan", "preflight",
           "--model", args.model, "--data", str(data), "--deepspeed_config", str(config),
           "--micro-batch", str(args.micro_batch), "--sizes-mb", "1,4,16,64", "--comm-budget-s", "45",
           "--link-mb", "4", "--num-workers", "1", "--out", str(out)]
    with open(work / f"preflight_{len(cluster.hosts)}hosts.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=cluster.env, stdout=log, stderr=subprocess.STDOUT)
    if not out.exists():
        raise SystemExit(f"preflight on {len(cluster.hosts)} hosts failed ({proc.returncode}); see {log.name}")
    return json.loads(out.read_text())


def predict(profile: dict, variant: str, args, hosts: int) -> dict:
    config = variant_config(variant, args.micro_batch, args.steps, args.freeze_step)
    compute = e.compute_from_profile(profile)
    net = e.network_from_profile(profile, None, None, None)
    work = e.workload(variant, config, args.model, profile["ranks"][0]["seq_len"], compute, 30522, args.steps,
                      args.freeze_step, world_hint=hosts, log_every=args.log_every,
                      optimizer=OPTIMIZER_OF[variant])
    optimizer = OPTIMIZER_OF[variant]
    stage = "compressed" if optimizer == "onebit_lamb" else "full"  # the measured steps are after the freeze
    est = step_estimate(work, optimizer, stage, hosts, 1, net)
    return {"predicted_step_s": est.step_s, "predicted_compute_s": est.compute_s, "predicted_comm_s": est.comm_s,
            "predicted_bytes": est.bytes_per_rank, "predicted_wire_bytes": est.bytes_per_rank + est.metrics_bytes}


def table(results: list[dict]) -> str:
    lines = ["| hosts | variant | measured step s | predicted step s | error | compute s | comm s (exposed) |"
             " bytes_sent/step measured | predicted | eth0 bytes/step measured | predicted |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        error = r["predicted_step_s"] / r["step_s"] - 1
        lines.append(f"| {r['hosts']} | {r['variant']} | {r['step_s']:.3f} | {r['predicted_step_s']:.3f} | "
                     f"{error:+.0%} | {r['predicted_compute_s']:.3f} | {r['predicted_comm_s']:.3f} | "
                     f"{r['bytes_metrics']:,.0f} | {r['predicted_bytes']:,.0f} | {r['bytes_interface']:,.0f} | "
                     f"{r['predicted_wire_bytes']:,.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rate", default="50mbit")
    parser.add_argument("--variants", nargs="+", default=list(OPTIMIZER_OF))
    parser.add_argument("--model", default="mini")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--log-every", type=int, default=4, help="as training logs (a logged step does more work)")
    parser.add_argument("--freeze-step", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank")
    parser.add_argument("--work")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--repredict", metavar="JSON",
                        help="no runs: predict again, with the model as it is now, the cells of an earlier --json")
    args = parser.parse_args()
    if args.repredict:
        earlier = json.loads(Path(args.repredict).read_text())
        vars(args).update({k: v for k, v in earlier["args"].items() if k not in ("repredict", "json", "markdown")})
        results = [{**r, **predict(earlier["profiles"][str(r["hosts"])], r["variant"], args, r["hosts"])}
                   for r in earlier["results"]]
        print(table(results))
        return
    work, data = set_up("plan_vs_measured.py", args.work)
    results, profiles = [], {}
    args.current_rate = args.rate
    for hosts in args.hosts:
        cluster = Cluster.up(work / f"cluster_{hosts}", hosts, slots=1, rate=args.rate)
        one_thread_per_rank(cluster, args.threads)
        try:
            started = time.time()
            profile = preflight(cluster, data, work, args)
            profiles[str(hosts)] = profile
            print(f"{hosts} hosts: preflight {time.time() - started:.0f} s, problems: {profile['problems']}", flush=True)
            for variant in args.variants:
                measured = run_variant(cluster, data, work, variant, args)
                results.append({**measured, **predict(profile, variant, args, hosts)})
                print(json.dumps(results[-1]), flush=True)
        finally:
            cluster.down()
    errors = [abs(r["predicted_step_s"] / r["step_s"] - 1) for r in results]
    print(f"\n{args.model}, seq 128, micro-batch {args.micro_batch}, fp32, 1 rank per host, links {args.rate}; "
          f"{args.steps} steps, 1-bit LAMB frozen at {args.freeze_step}; measured: median of the steady steps\n")
    print(table(results))
    print(f"\nlargest error {max(errors):.0%}, median {statistics.median(errors):.0%}")
    if args.markdown:
        Path(args.markdown).write_text(table(results) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "current_rate"},
                                               "results": results, "profiles": profiles}, indent=1))


if __name__ == "__main__":
    main()
