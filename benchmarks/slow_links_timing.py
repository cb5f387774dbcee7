"""The slow-links study's step times: LAMB, 1-bit LAMB, 0/1 Adam and DiLoCo on the namespace
cluster, links rate-limited and delayed, measured beside what bert-plan predicts for them.

For each link setting (rate × one-way delay per host): bring up the cluster (`--hosts` hosts of
one rank, tools/netns_cluster.py), run `bert-plan preflight` on it (compute and the links, as a
user would), then train each variant a few steps through DeepSpeed's pdsh launcher and take the
median of its steady windows (`--log-every` steps each, the metrics row's own collectives
included, as in any run). Each variant's config puts its steady state early:
  lamb          every step a full fp32 allreduce
  onebit_lamb   frozen at step 4: the compressed exchange from then on
  zero_one_adam variance frozen at step 4, local-step gap doubling every 2 steps up to 5: from
                step 11 on, windows of 10 hold 8 local steps and 2 syncs
  diloco_h10    H = 10, bf16 pseudo-gradient: windows of 10 hold 9 inner steps and 1 outer step
  diloco_inner  H larger than the run: inner steps only (with diloco_h10 this separates an
                outer step's cost from an inner step's)
  diloco_int4_h10    H = 10, int4 pseudo-gradient with error feedback (the streaming study's choice)
  diloco_stream_h10  the same in 2 fragments (offsets 0 and 5), each exchange overlapped with
                     the next 3 inner steps: windows of 10 hold 2 half-model exchanges
  diloco_sparse_h10  H = 10, sparse pseudo-gradient (the top 1% of each 4,096 values in 2 bits,
                     error feedback): one all-gather of payloads a round
Runs of 0/1 Adam and DiLoCo are 31 steps and their last step's window is left out (under
DiLoCo the last step ends a round); LAMB and 1-bit LAMB run 12 steps, as plan_vs_measured.py's.
Predictions: bert-plan's step model from that setting's preflight profile, per kind of step,
averaged over the same windows.

    sudo python benchmarks/slow_links_timing.py [--hosts 4] [--links 100mbit:0 1gbit:0 100mbit:20ms]
        [--variants ...] [--work DIR] [--json OUT] [--markdown OUT.md]

Timing runs are fp32 with a micro-batch of 2 (benchmarks/slow_network.py's balance: the link,
not this machine's shared cores, dominates); the slow-links study's accuracy runs are bf16. In
fp16/bf16 1-bit LAMB's and 0/1 Adam's steps without the engine's allreduce also pay the wrapper's
overflow-flag round, which bert-plan counts and these fp32 runs do not show.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from plan_vs_measured import preflight  # noqa: E402
from slow_network import one_thread_per_rank, run_variant, set_up, variant_config  # noqa: E402
from tools.netns_cluster import Cluster  # noqa: E402

from commodity_bert.plan import estimate as e  # noqa: E402
from commodity_bert.plan.step_model import step_estimates  # noqa: E402

VARIANTS = {  # variant: (planner optimizer, steps, log every); a run's last step (an outer step
    "lamb": ("lamb", 12, 4),                # under DiLoCo, and it evaluates) is left out of the windows
    "onebit_lamb": ("onebit_lamb", 12, 4),
    "zero_one_adam": ("zero_one_adam", 31, 10),
    "diloco_h10": ("diloco", 31, 10),
    "diloco_inner": ("diloco", 31, 10),
    "diloco_int4_h10": ("diloco", 31, 10),
    "diloco_stream_h10": ("diloco", 31, 10),
    "diloco_sparse_h10": ("diloco", 31, 10),
}
FREEZE = 4


def config_of(variant: str, micro_batch: int, steps: int) -> dict:
    if variant in ("lamb", "onebit_lamb"):
        return variant_config(variant, micro_batch, steps, FREEZE)
    config = variant_config("lamb", micro_batch, steps, FREEZE)
    if variant == "zero_one_adam":
        config["optimizer"] = {"type": "ZeroOneAdam", "params": {
            "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "var_freeze_step": FREEZE,
            "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 5, "scale_block": 32}}
    else:
        block = {"inner_steps": 10 * steps if variant == "diloco_inner" else 10, "outer_lr": 1.0,
                 "outer_momentum": 0.0, "nesterov": False, "compression": "bf16"}
        if variant in ("diloco_int4_h10", "diloco_stream_h10"):
            block.update(compression="int4", error_feedback=True)
        if variant == "diloco_stream_h10":
            block.update(fragments=2, overlap_steps=3)
        if variant == "diloco_sparse_h10":
            block.update(compression="sparse", density=0.01, value_bits=2, error_feedback=True)
        config["commodity_bert"] = {"diloco": block}
    return config


def predict(profile: dict, variant: str, config: dict, args, steps: int, windows: list[tuple[int, int]]) -> dict:
    optimizer = VARIANTS[variant][0]
    compute = e.compute_from_profile(profile)
    net = e.network_from_profile(profile, None, None, None)
    work = e.workload(variant, config, args.model, profile["ranks"][0]["seq_len"], compute, 30522, steps, FREEZE,
                      world_hint=args.hosts, log_every=VARIANTS[variant][2],
                      optimizer=optimizer)
    per_step, cache = step_estimates(work, optimizer, args.hosts, 1, net)
    window_s = [statistics.fmean(per_step[t - 1].step_s for t in range(prev + 1, s + 1)) for prev, s in windows]
    return {"predicted_step_s": statistics.median(window_s),
            "predicted_by_kind": {k: {"step_s": v.step_s, "compute_s": v.compute_s, "comm_s": v.comm_s,
                                      "bytes": v.bytes_per_rank, "rounds": v.rounds} for k, v in cache.items()}}


def table(results: list[dict]) -> str:
    lines = ["| link | variant | measured s/step | predicted | error | bytes_sent/step | comm_rounds/step |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['link']} | {r['variant']} | {r['step_s']:.3f} | {r['predicted_step_s']:.3f} | "
                     f"{r['predicted_step_s'] / r['step_s'] - 1:+.0%} | {r['bytes_metrics']:,.0f} | "
                     f"{r['rounds']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--links", nargs="+", default=["100mbit:0", "1gbit:0"],
                        help="RATE:DELAY, the delay one way per host (0: none); RATE 'unlimited': no "
                             "rate limit (the veth pair's own speed)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--model", default="mini")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--work")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    work, data = set_up("slow_links_timing.py", args.work)
    results, profiles = [], {}
    for link in args.links:
        rate, delay = link.split(":")
        try:
            cluster = Cluster.up(work / f"cluster_{link.replace(':', '_')}", args.hosts, slots=1,
                                 rate=None if rate == "unlimited" else rate,
                                 delay=None if delay == "0" else delay)
        except RuntimeError as exc:  # a kernel without netem: no delayed links (the others still run)
            print(f"{link}: skipped: {exc}", flush=True)
            continue
        one_thread_per_rank(cluster)
        try:
            started = time.time()
            args.steps, args.log_every, args.freeze_step = 12, 4, FREEZE  # the preflight's config (LAMB)
            profile = preflight(cluster, data, work, args)
            profiles[link] = profile
            print(f"{link}: preflight {time.time() - started:.0f} s, problems: {profile['problems']}", flush=True)
            for variant in args.variants:
                _, steps, log_every = VARIANTS[variant]
                config = config_of(variant, args.micro_batch, steps)
                args.steps, args.log_every, args.current_rate = steps, log_every, link
                measured = run_variant(cluster, data, work, variant, args, config=config,
                                       first_steady=11 if variant == "zero_one_adam" else None,
                                       last_steady=steps - 1 if steps > 12 else None)
                windows = measured.pop("windows")
                results.append({**measured, **predict(profile, variant, config, args, steps, windows)})
                print(json.dumps(results[-1]), flush=True)
        finally:
            cluster.down()
    print(f"\n{args.model}, seq 128, micro-batch {args.micro_batch}, fp32, {args.hosts} hosts of 1 rank; "
          f"medians of the steady windows\n")
    print(table(results))
    errors = [abs(r["predicted_step_s"] / r["step_s"] - 1) for r in results]
    print(f"\nlargest error {max(errors):.0%}, median {statistics.median(errors):.0%}")
    if args.markdown:
        Path(args.markdown).write_text(table(results) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                        if k not in ("current_rate", "steps", "log_every")},
                                               "results": results, "profiles": profiles}, indent=1))


if __name__ == "__main__":
    main()
