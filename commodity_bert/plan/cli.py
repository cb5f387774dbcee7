"""bert-plan: how long will BERT pretraining take on this cluster, and what will it cost?

    # 1. measure the cluster, launched like training (every host, every GPU)
    deepspeed --hostfile hostfiles/my_cluster --module commodity_bert.plan preflight \\
        --model large --seq-len 128 --deepspeed_config ds_configs/bert_large_phase1_lamb_fp16.json --out profile.json
    # 2. predict the shipped recipe (phase 1 + phase 2) on 1..64 nodes
    bert-plan estimate --profile profile.json --nodes 1,2,4,8,16 --gpus-per-node 8 --model large \\
        --recipe --optimizer lamb,onebit_lamb,bucketwise --usd-per-gpu-hour 2.5 --json plan.json --plot plan.png
    # or without a profile, from a GPU's peak and a link's rate
    bert-plan estimate --gpu-tflops 312 --link 10gbit --nodes 1,2,4,8 --gpus-per-node 4 --model large --recipe
    # a cluster of unequal cards: the equal split against micro-batches dealt by speed
    bert-plan estimate --gpu 3090,3090,2080ti --gpus-per-node 4,4,4 --link 10gbit --model base --recipe
    # 3. what fits one card: precision, micro-batch, accumulation, activation checkpointing
    bert-plan fit --gpu 3090 --model base --seq-len 128 --gpus-per-node 4,4,2

The model (commodity_bert/plan/step_model.py): step = compute + exposed communication, a ring
allreduce's bytes over the measured per-rank bandwidth plus its latency hops; bucket-wise
clipping hides buckets behind backward; 1-bit LAMB pays full-gradient steps until its freeze
step, then 1 bit per element plus scales; 0/1 Adam follows its variance and local-step schedules
(full, 1-bit, local and sync steps); DiLoCo sends nothing for H − 1 steps, then the pseudo-gradient. docs/planning.md: "How long will it take on my cluster?".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from commodity_bert.cli_help import one_line_parser, show_defaults
from commodity_bert.optim.registry import registered
from commodity_bert.plan.step_model import MODES, PlanError, recipe_rows, step_models, world_size

PROG = "bert-plan"


OneLineParser = one_line_parser(PlanError, see_help=True)


def step_model_of(name: str) -> str | None:
    """The step model --optimizer names: an optimizer's, in any spelling of its registered name
    (`OneBitLamb`, `onebit_lamb`: optim/registry.py), or a communication mode's (bucketwise,
    diloco); None for a name bert-plan has no model of."""
    entry = registered(name)
    if entry is not None and entry.plan:
        return entry.plan.name
    return name if name in MODES else None


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # DeepSpeed's launcher puts --local_rank=N before the subcommand
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    rehearse = sub.add_parser("rehearse", allow_abbrev=False,
                              help="rehearse the training job under its launcher: the job's train.py flags follow "
                                   "(docs/training.md, Rehearsal)")
    rehearse.add_argument("--steps", type=int, default=8, help="steps of the straight run (a relaunch goes on from "
                          "its halfway checkpoint)")

    pre = sub.add_parser("preflight", help="measure compute and network on every rank (under the launcher)")
    pre.add_argument("--model", default="base", help="tiny | mini | small | medium | base | large | a BertConfig JSON")
    pre.add_argument("--seq-len", type=int, default=128, help="sequence length of the synthetic batches")
    pre.add_argument("--micro-batch", type=int, help="sequences per GPU (default: the config's micro-batch, else 8)")
    pre.add_argument("--deepspeed_config", "--deepspeed-config", type=Path,
                     help="the training config: precision, optimizer, micro-batch (default: LAMB in --precision)")
    pre.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16",
                     help="without --deepspeed_config")
    pre.add_argument("--data", type=Path, help="train on real batches of this dataset instead of synthetic ones")
    pre.add_argument("--num-workers", type=int, default=2, help="with --data: loader processes per rank, as train.py's")
    pre.add_argument("--vocab-size", type=int, default=30522, help="of the synthetic batches")
    pre.add_argument("--steps", type=int, default=5, help="measured training steps (after 2 to warm up)")
    pre.add_argument("--matmul-size", type=int, help="square matmul side (default 8192 on GPU, 1024 on CPU)")
    pre.add_argument("--sizes-mb", default="1,4,16,64,256", help="allreduce sizes, MB")
    pre.add_argument("--comm-budget-s", type=float, default=60.0,
                     help="time for the allreduce sweep; larger sizes that would overrun it are skipped")
    pre.add_argument("--link-mb", type=float, default=16.0, help="most bytes sent host to host per direction")
    pre.add_argument("--join-timeout", type=float, default=120.0, help="seconds to wait for every rank to join")
    pre.add_argument("--out", type=Path, default=Path("profile.json"))

    est = sub.add_parser("estimate", help="predict step time, days and cost for node counts and optimizers")
    src = est.add_argument_group("the hardware (a profile, or by hand)")
    src.add_argument("--profile", type=Path, help="profile.json from bert-plan preflight")
    src.add_argument("--gpu-tflops", type=float, help="by hand: the GPU's matmul peak in the training precision")
    src.add_argument("--gpu", help="by hand: each node's card, e.g. 3090,3090,2080ti (one cluster of those nodes; "
                                   "--gpus-per-node each node's count): priced at each card's peak × MFU, with "
                                   "the step's micro-batches split equally and by speed (docs/clusters.md)")
    src.add_argument("--mfu", type=float, help="by hand: share of that peak training reaches (default 0.35)")
    src.add_argument("--link", help="network rate per node, e.g. 1gbit, 10gbit, 25gbit (overrides the profile's)")
    src.add_argument("--latency-ms", type=float, help="per ring hop (default: the profile's, else 0.05)")
    src.add_argument("--intra-link", help="between a node's GPUs (default: a one-host profile's, else 200gbit)")
    work = est.add_argument_group("the training")
    work.add_argument("--model", default="base", help="base | large | tiny | mini | a BertConfig JSON")
    work.add_argument("--recipe", action="store_true",
                      help="the shipped phase-1 + phase-2 configs of --model (the default without --config)")
    work.add_argument("--config", type=Path, help="one DeepSpeed config instead of the recipe")
    work.add_argument("--seq-len", type=int, default=128, help="with --config")
    work.add_argument("--steps", type=int, help="with --config (default: its scheduler's total_num_steps)")
    work.add_argument("--freeze-step", type=int, help="1-bit LAMB's freeze step (0/1 Adam's var_freeze_step) to "
                                                      "assume (default: the config's; for auto, its freeze_max_step)")
    work.add_argument("--vocab-size", type=int, default=30522)
    work.add_argument("--log-every", type=int, default=50,
                      help="train.py's --log-every (the recipes': 50); 0 leaves logging out")
    grid = est.add_argument_group("the grid")
    grid.add_argument("--nodes", default=None, help="node counts to price (default 1,2,4,8,16,32,64)")
    grid.add_argument("--gpus-per-node", default=None,
                      help="GPUs a node (default: the profile's, else 8), or one count a node for a cluster of "
                           "unequal nodes, e.g. 4,4,2 (priced as that cluster alone)")
    grid.add_argument("--optimizer", default="lamb,onebit_lamb,bucketwise", help=f"any of {', '.join(step_models())}")
    grid.add_argument("--usd-per-gpu-hour", type=float)
    grid.add_argument("--json", type=Path, help="write the rows here")
    grid.add_argument("--plot", type=Path, help="days (and USD) against GPUs, one line per optimizer")

    fit = sub.add_parser("fit", help="what fits one GPU: precision, micro-batch, accumulation, activation checkpointing")
    fit.add_argument("--gpu", help="2080ti | t4 | v100-16 | v100-32 | 3090 | 4090 | a100-40 | a100-80 | h100")
    fit.add_argument("--gpu-mem", type=float, help="instead of --gpu: the card's memory, GB")
    fit.add_argument("--capability", default="8.0", help="with --gpu-mem: its compute capability (bf16 from 8.0)")
    fit.add_argument("--model", default="base", help="base | large | tiny | mini | a BertConfig JSON")
    fit.add_argument("--seq-len", type=int, default=128)
    fit.add_argument("--config", type=Path,
                     help="the DeepSpeed config (default: the shipped LAMB recipe's for --model and --seq-len)")
    fit.add_argument("--nodes", type=int, default=1)
    fit.add_argument("--gpus-per-node", default="1", help="GPUs a node, or each node's: 4,4,2")
    fit.add_argument("--vocab-size", type=int, default=30522)
    fit.add_argument("--json", type=Path, help="write the answer here")
    return show_defaults(p)


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "rehearse":  # the rest are the job's train.py flags, which train.py's parser checks
        args.train_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def estimate(args) -> list[dict]:
    from commodity_bert.plan import estimate as e
    from commodity_bert.plan.report import estimate_plot, estimate_table
    from commodity_bert.plan.step_model import Network

    if sum(map(bool, (args.profile, args.gpu_tflops, args.gpu))) != 1:
        raise PlanError("give --profile profile.json (from bert-plan preflight), --gpu-tflops X or --gpu CARD,CARD,... "
                        "(with --link RATE for more than one node)")
    cards = e.cards_of(args.gpu, args.gpus_per_node, args.nodes) if args.gpu else None
    if args.recipe and args.config:
        raise PlanError("--recipe and --config: give one (the recipe is the shipped phase-1 + phase-2 configs)")
    nodes_list = e.parse_list(args.nodes or "1,2,4,8,16,32,64", "--nodes")
    per_node = e.parse_list(args.gpus_per_node, "--gpus-per-node") if args.gpus_per_node else None
    if per_node and len(per_node) > 1:
        if args.nodes and nodes_list != [len(per_node)]:
            raise PlanError(f"--nodes {args.nodes} and --gpus-per-node {args.gpus_per_node}: a list of GPUs per "
                            f"node is one cluster of {len(per_node)} nodes; drop --nodes")
        nodes_list = [len(per_node)]
    if cards:
        nodes_list, per_node = [len(cards.per_node)], list(cards.per_node)
    shape = None if not per_node else per_node[0] if len(set(per_node)) == 1 else tuple(per_node)
    given = [o.strip() for o in args.optimizer.split(",") if o.strip()]
    optimizers = [step_model_of(o) for o in given]
    if None in optimizers or not optimizers:
        raise PlanError(f"--optimizer {args.optimizer!r}: choose from {', '.join(step_models())}")
    if args.profile:
        profile = e.load_profile(args.profile)
        compute = e.compute_from_profile(profile)
        net = e.network_from_profile(profile, args.link, args.latency_ms, args.intra_link)
        gpus_per_node = shape or profile.get("gpus_per_node", 1)
        if net.link_bytes_per_s == 0 and max(nodes_list) > 1:
            raise PlanError(f"--profile {args.profile} was measured on one host: it knows no network; add "
                            f"--link RATE (e.g. 10gbit), or run preflight across hosts")
    else:
        if not args.link and max(nodes_list) > 1:
            raise PlanError("--gpu-tflops needs --link RATE (e.g. 10gbit) for more than one node")
        compute = e.hand_compute(cards.slowest_tflops if cards else args.gpu_tflops, args.mfu or e.DEFAULT_MFU)
        if cards:
            compute.source = f"by hand: {cards.describe()} × MFU {args.mfu or e.DEFAULT_MFU:g}"
        net = Network(link_bytes_per_s=e.parse_rate(args.link) if args.link else 1.0,
                      latency_s=(args.latency_ms if args.latency_ms is not None else 0.05) / 1000)
        if args.intra_link:
            net.intra_bytes_per_s = e.parse_rate(args.intra_link)
        gpus_per_node = shape or 8
    phases, notes = {}, []
    for optimizer in optimizers:
        if args.config:
            config = e.read_config(args.config)
            works = [e.workload("config", config, args.model, args.seq_len, compute, args.vocab_size, args.steps,
                                args.freeze_step, world_size(1, gpus_per_node), args.log_every, optimizer)]
        else:
            works = [e.workload(phase, e.read_config(path), args.model, seq_len, compute, args.vocab_size, None,
                                args.freeze_step, log_every=args.log_every, optimizer=optimizer)
                     for phase, path, seq_len in e.recipe_configs(args.model, optimizer)]
        for w in works:
            notes += [n for n in w.notes if n not in notes]
        phases[optimizer] = works
    rows = recipe_rows(phases, nodes_list, gpus_per_node, net, args.usd_per_gpu_hour)
    # ranks of unequal speed (the cards named, or the profile's ranks): the same cluster with the
    # micro-batches dealt by speed (train/balance.py) beside the equal split
    speeds = cards.speeds if cards else e.speeds_from_profile(profile) if args.profile else None
    if speeds:
        balanced = {o: [dataclasses.replace(w, speeds=speeds, balanced=True) for w in works]
                    for o, works in phases.items()}
        dealt = iter(recipe_rows(balanced, nodes_list, gpus_per_node, net, args.usd_per_gpu_hour))
        paired = []
        for row in rows:
            other = next(dealt)
            if row["gpus"] == len(speeds):
                paired += [{**row, "split": "equal"}, {**other, "split": "balanced"}]
            else:
                paired.append(row)
        rows = paired
        notes += cards.notes() if cards else [
            f"the profile's ranks differ in speed ({min(speeds):.2f} of the fastest at the slowest): priced split "
            f"equally and by speed on its {len(speeds)} ranks"]
    what = f"{args.config}" if args.config else f"BERT-{args.model} recipe (phase 1 seq 128 + phase 2 seq 512)"
    layout = (f"nodes of {', '.join(map(str, gpus_per_node))} GPUs"
              if isinstance(gpus_per_node, tuple) else f"{gpus_per_node} GPU(s) per node")
    print(f"{what}; {layout}; {compute.source}; network "
          f"{e.default_link_note(net)}")
    print(estimate_table(rows))
    for note in notes:
        print(f"note: {note}")
    if args.json:
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(rows, indent=1))
        tmp.replace(args.json)
    if args.plot:
        estimate_plot(rows, args.plot, f"{what}, {layout}, {e.default_link_note(net)}")
    return rows


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        if args.command == "preflight":
            from commodity_bert.plan.preflight import run
            status = run(args)
            # released while the interpreter is whole: left to its exit, gloo's threads can abort
            # the rank ("terminate called without an active exception"), a status 0 read as a crash
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
            return status
        if args.command == "rehearse":
            from commodity_bert.plan.rehearsal import run as rehearse
            return rehearse(args.steps, args.train_args)
        if args.command == "fit":
            from commodity_bert.plan.fit import run as fit
            fit(args)
            return 0
        estimate(args)
        return 0
    except PlanError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
