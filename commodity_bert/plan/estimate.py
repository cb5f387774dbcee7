"""`bert-plan estimate`: the step-time model (step_model.py) fed from a preflight profile or
from figures given by hand, over the shipped recipe's phases or one config."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from commodity_bert.comm.bucketwise import bucket_mb
from commodity_bert.comm.diloco import DEFAULTS as DILOCO_DEFAULTS
from commodity_bert.comm.diloco import diloco_settings
from commodity_bert.comm.topology import hierarchy_setting
from commodity_bert.data.masking import MASK_PROB
from commodity_bert.plan.step_model import (
    GBIT,
    Network,
    PlanError,
    Workload,
    parse_rate,
    plan_of,
)
from commodity_bert.run_config import RunConfig

REPO = Path(__file__).resolve().parents[2]
DS_CONFIGS = REPO / "ds_configs"
RECIPE_SEQ_LEN = {"phase1": 128, "phase2": 512}
DEFAULT_MFU = 0.35  # by hand only: a share of the matmul peak that BERT training reaches (assumed)


@dataclass
class Compute:
    """How fast one GPU trains: a FLOP rate for forward + backward, and the optimizer's and the
    1-bit compression's time per parameter."""
    flops_per_s: float
    optimizer_s_per_param: float = 0.0
    compress_s_per_param: float = 0.0
    lowbit_s_per_param: float = 0.0  # DiLoCo's int4/int8 average's own passes (preflight)
    sparse_encode_s_per_param: float = 0.0  # DiLoCo sparse: top-k and coding (preflight, at 1%, 2 bits)
    sparse_decode_s_per_param: float = 0.0  # and one payload's decoding
    grad_sync_local_s_per_param: float = 0.0
    measured: dict | None = None  # the profile's step, used as is when the workload matches it
    source: str = ""


def parameter_count(model: str, vocab_size: int, nsp: bool = True) -> int:
    from commodity_bert.model.bert import build_config
    from commodity_bert.plan.memory import Shape
    return Shape.of(build_config(model, vocab_size), nsp=nsp).params


def forward_backward_flops(model: str, vocab_size: int, seq_len: int, micro_batch: int) -> float:
    """Full-length sequences, 15% of positions predicted."""
    from commodity_bert.model.bert import build_config, training_flops
    tokens = micro_batch * seq_len
    return training_flops(build_config(model, vocab_size), tokens, micro_batch * seq_len * seq_len,
                          micro_batch * round(MASK_PROB * seq_len))


def load_profile(path: str | Path) -> dict:
    path = Path(path)
    try:
        profile = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"--profile {path}: no such file; run `bert-plan preflight --out {path}` first") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlanError(f"--profile {path}: not a preflight profile (invalid JSON: {exc}); run preflight again") from None
    missing = [k for k in ("version", "ranks", "allreduce", "hosts") if k not in profile]
    if missing or not profile.get("ranks"):
        raise PlanError(f"--profile {path}: not a preflight profile (no {', '.join(missing) or 'ranks'}); "
                        f"run `bert-plan preflight` again")
    return profile


def compute_from_profile(profile: dict) -> Compute:
    """The slowest rank sets a synchronous step's pace: its figures are taken."""
    slowest = max(profile["ranks"], key=lambda r: r["forward_backward_s"])
    return Compute(flops_per_s=slowest["model_flops_per_micro_batch"] / slowest["forward_backward_s"],
                   optimizer_s_per_param=slowest["optimizer_s"] / slowest["params"],
                   compress_s_per_param=max(0.0, slowest["onebit_optimizer_s"] - slowest["optimizer_s"])
                   / slowest["params"],
                   lowbit_s_per_param=slowest.get("lowbit_average_s", 0.0) / slowest["params"],
                   sparse_encode_s_per_param=slowest.get("sparse_encode_s", 0.0) / slowest["params"],
                   sparse_decode_s_per_param=slowest.get("sparse_decode_s", 0.0) / slowest["params"],
                   grad_sync_local_s_per_param=slowest.get("grad_sync_local_s", 0.0) / slowest["params"],
                   measured=slowest, source=f"profile: {slowest['host']} rank {slowest['rank']}, {slowest['device']}")


def speeds_from_profile(profile: dict) -> tuple[float, ...] | None:
    """Each rank's speed against the fastest's (its forward + backward), in rank order; None where
    every rank is within 10% of the fastest (a deal by speed would change nothing worth pricing)."""
    ranks = sorted(profile["ranks"], key=lambda r: r["rank"])
    times = [r["forward_backward_s"] for r in ranks]
    if max(times) < 1.1 * min(times):
        return None
    return tuple(min(times) / t for t in times)


def network_from_profile(profile: dict, link: str | None, latency_ms: float | None, intra_link: str | None) -> Network:
    fit = profile["allreduce"].get("fit")
    net = Network(link_bytes_per_s=parse_rate(link) if link else 0.0)
    if fit and profile["hosts"] > 1 and not link:
        net.link_bytes_per_s = fit["bus_bytes_per_s"]
        net.latency_s = fit["latency_per_hop_s"]
    if fit and profile["hosts"] == 1:
        net.intra_bytes_per_s = fit["bus_bytes_per_s"]
        net.intra_latency_s = fit["latency_per_hop_s"]
    if latency_ms is not None:
        net.latency_s = latency_ms / 1000
    if intra_link:
        net.intra_bytes_per_s = parse_rate(intra_link)
    return net


def workload(name: str, config: RunConfig | dict, model: str, seq_len: int, compute: Compute, vocab_size: int,
             steps: int | None, freeze_override: int | None, world_hint: int = 1, log_every: int = 0,
             optimizer: str = "lamb") -> Workload:
    config = RunConfig.of(config)
    micro = int(config.micro_batch or 0)
    batch = int(config.train_batch_size or 0)
    if not micro:
        raise PlanError(f"{name}: the config has no train_micro_batch_size_per_gpu")
    if not batch:  # CPU configs give accumulation instead of a global batch
        batch = micro * int(config.accumulation or 1) * world_hint
    total = steps or config.total_num_steps
    if not total:
        raise PlanError(f"{name}: give --steps (the config's scheduler has no total_num_steps)")
    notes: list[str] = []
    measured = compute.measured
    if measured and (measured["model"], measured["seq_len"], measured["micro_batch"]) == (model, seq_len, micro):
        params = measured["params"]
        fb_s = measured["forward_backward_s"]
    else:
        params = parameter_count(model, vocab_size)
        fb_s = forward_backward_flops(model, vocab_size, seq_len, micro) / compute.flops_per_s
        if measured:
            notes.append(f"{name}: forward + backward scaled by FLOPs from the profile's {measured['model']} "
                         f"seq {measured['seq_len']} micro-batch {measured['micro_batch']}")
    if measured:  # waiting for data, per micro-batch, as preflight saw it beside the step
        fb_s += measured.get("loop_overhead_s", 0.0)
    sync_local_s = compute.grad_sync_local_s_per_param * params
    buckets_mb = bucket_mb(config)
    params_block = config.optimizer_params
    extra = {}
    plan = plan_of(optimizer)
    if plan is not None:
        extra["schedule"] = plan.schedule(name, config, int(total), freeze_override, notes)
    if optimizer == "diloco":
        settings = diloco_settings(config)
        if settings is None:
            settings = {**DILOCO_DEFAULTS, "enabled": True}
            notes.append(f"{name}: no commodity_bert.diloco block in the config; DiLoCo's defaults assumed "
                         f"(inner_steps {settings['inner_steps']}, compression {settings['compression']})")
        extra.update(inner_steps=int(settings["inner_steps"]), outer_compression=settings["compression"],
                     fragments=int(settings["fragments"]), overlap_steps=int(settings["overlap_steps"]),
                     warmup_steps=int(settings["warmup_steps"]), density=float(settings["density"]),
                     value_bits=int(settings["value_bits"]))
    return Workload(name=name, params=params, global_batch=batch, micro_batch=micro, steps=int(total),
                    grad_bytes=2 if config.precision in ("fp16", "bf16") else 4, fb_s=fb_s,
                    optimizer_s=compute.optimizer_s_per_param * params, grad_sync_local_s=sync_local_s,
                    compress_s=compute.compress_s_per_param * params,
                    lowbit_s=compute.lowbit_s_per_param * params,
                    sparse_encode_s=compute.sparse_encode_s_per_param * params,
                    sparse_decode_s=compute.sparse_decode_s_per_param * params,
                    scale_block=params_block.get("scale_block", 256), bucket_bytes=buckets_mb * 2**20,
                    log_every=log_every, wrapped=config.precision != "fp32",
                    loss_scaled=config.precision == "fp16" and not config.static_loss_scale,
                    hierarchy=hierarchy_setting(config), notes=notes, **extra)


def recipe_configs(model: str, optimizer: str) -> list[tuple[str, Path, int]]:
    """(phase, config, seq len) of the shipped recipe for `optimizer`."""
    kind = {"diloco": "diloco_lamb", "bucketwise": "lamb"}.get(optimizer, optimizer)  # an optimizer's: its name
    out = []
    for phase, seq_len in RECIPE_SEQ_LEN.items():
        path = DS_CONFIGS / f"bert_{model}_{phase}_{kind}_fp16.json"
        if not path.is_file():
            raise PlanError(f"--recipe: {path} not found; run from a checkout of the project, or give --config")
        out.append((phase, path, seq_len))
    return out


def read_config(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlanError(f"--config {path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"--config {path}: not valid JSON ({exc})") from None


def parse_list(text: str, flag: str, kind=int) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PlanError(f"{flag} {text!r}: give a comma-separated list, e.g. 1,2,4,8") from None
    if not values or any(v <= 0 for v in values):
        raise PlanError(f"{flag} {text!r}: give positive values, e.g. 1,2,4,8")
    return values


@dataclass(frozen=True)
class Cards:
    """`--gpu 3090,3090,2080ti`: each node's card and count, and each rank's speed (its card's peak
    against the fastest's: the same MFU on every card is assumed, which the balanced run's own
    measurement then corrects)."""
    names: tuple[str, ...]
    per_node: tuple[int, ...]
    peaks: tuple[float, ...]
    bf16: tuple[bool, ...]

    @property
    def speeds(self) -> tuple[float, ...]:
        fastest = max(self.peaks)
        return tuple(peak / fastest for peak, count in zip(self.peaks, self.per_node) for _ in range(count))

    @property
    def slowest_tflops(self) -> float:
        return min(self.peaks)

    def describe(self) -> str:
        return ", ".join(f"{count} × {name} ({peak:g} TFLOP/s)"
                         for name, count, peak in zip(self.names, self.per_node, self.peaks))

    def notes(self) -> list[str]:
        notes = []
        if any(self.bf16) and not all(self.bf16):
            without = sorted({n for n, b in zip(self.names, self.bf16) if not b})
            notes.append(f"{', '.join(without)} has no bf16: a job of cards with and without it trains fp16 on all "
                         f"(an _fp16 config)")
        return notes


def cards_of(gpu: str, gpus_per_node: str | None, nodes: str | None) -> Cards:
    from commodity_bert.plan.memory import GPUS, gpu_named
    names = [n.strip() for n in gpu.split(",") if n.strip()]
    found = [gpu_named(n) for n in names]
    if not names or None in found:
        unknown = next((n for n, g in zip(names, found) if g is None), gpu)
        raise PlanError(f"--gpu {unknown!r}: give one of {', '.join(GPUS)} per node, e.g. 3090,3090,2080ti")
    counts = parse_list(gpus_per_node, "--gpus-per-node") if gpus_per_node else [1]
    if len(counts) == 1:
        counts = counts * len(names)
    if len(counts) != len(names):
        raise PlanError(f"--gpu names {len(names)} nodes and --gpus-per-node {gpus_per_node} {len(counts)}; "
                        f"give one count for all, or one a node")
    if nodes and parse_list(nodes, "--nodes") != [len(names)]:
        raise PlanError(f"--nodes {nodes} and --gpu {gpu}: a card per node is one cluster of {len(names)} nodes; "
                        f"drop --nodes")
    return Cards(tuple(g.name for g in found), tuple(counts), tuple(g.tflops for g in found),
                 tuple(g.bf16 for g in found))


def hand_compute(gpu_tflops: float, mfu: float) -> Compute:
    return Compute(flops_per_s=gpu_tflops * 1e12 * mfu,
                   source=f"by hand: {gpu_tflops:g} TFLOP/s peak × MFU {mfu:g}; optimizer and 1-bit "
                          f"compression time not counted")


def default_link_note(net: Network) -> str:
    return f"{net.link_bytes_per_s / GBIT:.3g} Gbit/s per node, {net.latency_s * 1e6:.0f} µs per hop"

