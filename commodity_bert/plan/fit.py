"""`bert-plan fit`: what a GPU can train, from the memory model (memory.py): the precision the card
computes in, the micro-batch that fits, the accumulation that makes the config's global batch on
the cluster's ranks (train/launch_checks.py's rule, as train.py applies it), and whether
activation checkpointing is needed."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

from commodity_bert.comm.topology import Topology
from commodity_bert.host import atomic_write_text
from commodity_bert.plan.estimate import DS_CONFIGS, read_config
from commodity_bert.plan.memory import (
    CONTEXT_BYTES,
    FRAGMENTATION,
    GIB,
    GPUS,
    Gpu,
    Setup,
    Shape,
    exchange_split,
    fit,
    gpu_named,
    largest_micro,
)
from commodity_bert.plan.step_model import PlanError
from commodity_bert.run_config import RunConfig


def card_of(args) -> Gpu:
    if bool(args.gpu) == bool(args.gpu_mem):
        raise PlanError("give --gpu NAME (one of " + ", ".join(GPUS) + ") or --gpu-mem GB, not both")
    if args.gpu_mem:
        major, _, minor = args.capability.partition(".")
        return Gpu(f"a {args.gpu_mem:g} GB GPU", args.gpu_mem * 1e9 / GIB, (int(major), int(minor or 0)))
    card = gpu_named(args.gpu)
    if card is None:
        raise PlanError(f"--gpu {args.gpu}: not a card bert-plan knows; give one of {', '.join(GPUS)}, "
                        f"or --gpu-mem GB (with --capability)")
    return card


def config_path(args, card: Gpu) -> Path:
    """--config, or the shipped LAMB recipe's config for --model and --seq-len in the card's precision."""
    if args.config:
        return args.config
    phase = {128: "phase1", 512: "phase2"}.get(args.seq_len)
    path = DS_CONFIGS / f"bert_{args.model}_{phase}_lamb_{'bf16' if card.bf16 else 'fp16'}.json"
    if phase is None or not path.is_file():
        raise PlanError(f"no shipped config for --model {args.model} at --seq-len {args.seq_len}; give --config")
    return path


def run(args) -> dict:
    """The answer for --gpu's card, or, for a card per node (--gpu 3090,2080ti), each card's, then
    the micro-batch every rank trains: one size for all (ranks of unequal speed take unequal
    numbers of micro-batches, not unequal sizes: data/deal.py), so the smallest card's."""
    if not args.gpu or "," not in args.gpu:
        return run_one(args)
    names = list(dict.fromkeys(n.strip() for n in args.gpu.split(",") if n.strip()))
    answers = []
    for name in names:
        answers.append(run_one(argparse.Namespace(**{**vars(args), "gpu": name, "json": None})))
        print()
    fitting = [a for a in answers if a["micro_batch"] is not None]
    out = {"cards": answers}
    if len(fitting) == len(answers):
        smallest = min(fitting, key=lambda a: a["micro_batch"])
        out["micro_batch"] = smallest["micro_batch"]
        print(f"every rank: micro-batch {smallest['micro_batch']} (the {smallest['gpu']}'s), the same on all; a faster "
              f"card takes more of the step's micro-batches with \"balance\": {{\"split\": \"speed\"}} "
              f"(docs/clusters.md)")
    if len({a["precision"] for a in answers}) > 1:
        print("precision: fp16 on every card: a job of cards with and without bf16 trains in the precision all have")
    if args.json:
        atomic_write_text(args.json, json.dumps(out, indent=1))
    return out


def run_one(args) -> dict:
    from commodity_bert.model.bert import ModelConfigError, build_config
    from commodity_bert.plan.estimate import parse_list
    from commodity_bert.train.launch_checks import fit_global_batch, precision_twin

    card = card_of(args)
    path = config_path(args, card)
    config = RunConfig.of(read_config(path))
    gpus = parse_list(args.gpus_per_node, "--gpus-per-node")
    nodes = len(gpus) if len(gpus) > 1 else args.nodes
    world = sum(gpus) if len(gpus) > 1 else nodes * gpus[0]
    # the compressed exchanges in two levels where train.py's topology would choose them
    topology = Topology([node for node, count in enumerate(gpus if len(gpus) > 1 else gpus * nodes)
                         for _ in range(count)])
    slices, among = exchange_split(topology, config)
    try:
        shape = Shape.of(build_config(args.model, args.vocab_size), nsp=True)
    except ModelConfigError as error:
        raise PlanError(str(error)) from None
    setup = Setup.of(config)
    asked_micro = int(config.micro_batch or 8)
    result = fit(shape, args.seq_len, setup, card, asked_micro, world, slices, among)
    shown = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else str(path)
    lines = [f"{args.model} ({shape.params / 1e6:.0f}M parameters), seq {args.seq_len}, {shown} on {card.name} "
             f"({card.memory_gib:.1f} GiB, compute capability {card.capability[0]}.{card.capability[1]}), "
             f"{world} rank{'s' if world > 1 else ''}"]
    if result.precision == "fp16":
        lines.append(f"precision: fp16 with dynamic loss scaling (from 2^{config.initial_scale_power}, "
                     f"halved on an overflow): the card has no bf16"
                     + (f"; use {precision_twin(path, 'fp16')}" if setup.precision == "bf16"
                        and precision_twin(path, "fp16") else ""))
    elif result.precision == "bf16":
        lines.append("precision: bf16 (no loss scaling)"
                     + (f"; use {precision_twin(path, 'bf16')}" if setup.precision == "fp16"
                        and precision_twin(path, "bf16") else ""))
    else:
        lines.append("precision: fp32, as the config asks")
    out = {"gpu": card.name, "memory_gib": card.memory_gib, "model": args.model, "params": shape.params,
           "seq_len": args.seq_len, "config": str(path), "world": world, "precision": result.precision,
           "micro_batch": None, "accumulation": None, "global_batch": None, "checkpointing": None}
    advice = result.checkpointing
    micro = result.micro_checkpointed if advice in ("needed", "recommended") else result.micro
    if micro is None:
        lines.append(f"does not fit: even one sequence with activation checkpointing needs "
                     f"more than {card.memory_gib:.1f} GiB; use ZeRO 1/2 (ds_configs/*zero*), a shorter sequence or a "
                     f"larger card")
    else:
        asked = int(config.train_batch_size or micro * int(config.accumulation or 1) * world)
        batch = fit_global_batch(asked, micro, world)
        kept = "" if batch.total == asked else f" (the config's {asked:,} is not a multiple the ranks make)"
        whose = " (the config's)" if batch.micro == asked_micro else f" (the config asks {asked_micro})"
        lines.append(f"micro-batch: {batch.micro}{whose}, accumulation {batch.accumulation}: "
                     f"a global batch of {batch.total:,}{kept}")
        switch = '"commodity_bert": {"activation_checkpointing": {"enabled": true}}'
        lines.append({
            "needed": f"activation checkpointing: needed (nothing fits without it; it costs about one more forward "
                      f"pass): {switch}",
            "recommended": f"activation checkpointing: recommended: without it the micro-batch is {result.micro}; with "
                           f"it {result.micro_checkpointed}, for about one more forward pass: {switch}",
            "optional": f"activation checkpointing: not needed; with it the micro-batch could be "
                        f"{result.micro_checkpointed}, for about one more forward pass of compute",
            "no": "activation checkpointing: not needed"}[advice])
        most, _ = largest_micro(shape, args.seq_len, replace(setup, precision=result.precision), card,
                                8 * asked_micro, world, slices, among, False)
        if most and most > asked_micro:
            lines.append(f"room: up to {most} sequences a micro-batch fit without checkpointing "
                         f"(train_micro_batch_size_per_gpu; the same global batch in fewer passes)")
        out["micro_fits_up_to"] = most
        memory = result.chosen
        state = ", ".join(f"{k} {v / GIB:.2f}" for k, v in memory.state.items() if v)
        lines.append(f"memory at the peak: {memory.total / GIB:.1f} GiB of {card.memory_gib:.1f}: state "
                     f"{memory.state_total / GIB:.2f} ({state}), gradients {memory.gradients / GIB:.2f}, "
                     f"activations {memory.activations / GIB:.2f} (step's fp32 gradients "
                     f"{memory.step_transient / GIB:.2f}), {FRAGMENTATION:.0%} for fragmentation, "
                     f"{CONTEXT_BYTES / GIB:.1f} for the CUDA context and NCCL")
        out.update(micro_batch=batch.micro, accumulation=batch.accumulation, global_batch=batch.total,
                   checkpointing=advice, peak_gib=memory.total / GIB,
                   micro_without_checkpointing=result.micro, micro_with_checkpointing=result.micro_checkpointed)
    for line in lines:
        print(line)
    if args.json:
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(args.json)
    return out
