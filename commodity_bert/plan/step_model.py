"""The step-time model of `bert-plan estimate`: one optimizer step = compute + exposed communication.

Everything here is arithmetic on measured (or stated) quantities, so each term can be checked
by hand (tests/test_plan.py does) and against a measured run (benchmarks/plan_vs_measured.py).

Compute, per step and GPU:   accumulation × t_fb(micro-batch) + t_optimizer + t_sync_local
    t_fb is the forward + backward of one micro-batch, measured by `bert-plan preflight`
    (or FLOPs ÷ (peak × MFU) by hand); for another model, sequence length or micro-batch it
    is scaled by the training FLOPs (model.training_flops) at the measured FLOP rate.
    t_sync_local: the gradient allreduce's memory passes (flatten, scale, unflatten, copy
    back), which run at any world size; measured by preflight with DeepSpeed's own code.
    Cards of unequal speed: t_fb is the slowest card's; balanced (train/balance.py), the
    accumulation × t_fb term becomes the slowest rank's share of the step's micro-batches.

Communication, per step, over the slowest link of a ring:
    a ring allreduce of S bytes over n members sends 2(n−1)/n · S per member and takes
    2(n−1) latency hops. Nodes hold G GPUs: the gradient is reduced within the node
    (intra-node link) and across the N nodes (the network), as NCCL's and gloo's rings do.
    bytes per gradient element: the communicated dtype (fp16/bf16: 2, fp32: 4).
An optimizer's steps are priced by what its registration says each kind of step sends
(optim/registry.py: StepPlan, PlannedStep), so a new optimizer brings its own model:
  gradient allreduce  DeepSpeed's allreduce of the gradients after backward (ZeRO 0): all exposed,
              and its memory passes (t_sync_local). LAMB's every step; 1-bit LAMB's until its
              freeze step; 0/1 Adam's variance ("full") steps.
  1-bit exchange  the compressed allreduce (onebit_allreduce.py): signs, 1 bit per element, plus
              one fp32 scale per `scale_block` elements, in an all-to-all and an all-gather,
              2(W−1)/W · P · (1/8 + 4/scale_block) bytes per rank over all W ranks, in the
              optimizer step (not overlapped), plus the compression stage's extra work over
              LAMB's step (measured by preflight on a one-rank group). 1-bit LAMB's steps after
              the freeze; 0/1 Adam's "onebit" and "sync" steps (zero_one_adam.step_kinds).
  overflow flag  under fp16/bf16 where the engine's allreduce is off, DeepSpeed's wrapper's
              overflow-flag allreduce: one latency-bound round (1 byte). 1-bit LAMB's compressed
              steps and 0/1 Adam's "onebit" steps; 0/1 Adam's local steps pay none (each rank
              skips its own overflows).
  loss-scale agreement  under a dynamic fp16 loss scale, 0/1 Adam's syncs agree on it (16 bytes).
The communication modes that are not optimizers are priced here:
  bucketwise  bucket-wise clipping (comm/bucketwise.py) sends fp32 buckets as backward produces
              them: all but the last bucket hide behind the rest of the last micro-batch's
              backward (2/3 of its forward + backward); exposed = max(comm − hidden, last bucket).
  diloco      H − 1 inner steps with no communication at all, then an outer step: the pseudo-
              gradient's allreduce, fp32 (4 bytes a parameter) or bf16 (2), or int8 / int4 (1 or
              0.5 byte a parameter plus a 4-byte scale per 256, in an all-to-all and an
              all-gather), or int2 (0.25), and the outer update's passes over the parameters
              (counted as one optimizer step). Sparse (`density` d, `value_bits` b): an all-gather
              of each rank's payload (d · (12 + b) / 8 bytes a parameter plus a 4-byte scale per
              4,096) to the W − 1 others, a ring, so the node's link carries W − 1 payloads, plus
              the top-k coding and the decoding of W payloads (preflight's); where the dense
              int-b exchange sends fewer bytes (many workers) it is priced, as diloco.py chooses. Streamed (`fragments` P): P such steps per H, each on a P-th of
              the parameters; with `overlap_steps` τ the exchange runs behind the next τ inner
              steps' compute and only what exceeds it is exposed. The last step syncs every
              fragment, blocking. `warmup_steps` W: the first W steps are "warmup" steps,
              priced as lamb's (the engine's gradient allreduce), and the rounds count from W.
  two levels  the compressed exchanges (1-bit LAMB's, 0/1 Adam's, DiLoCo's int8) where nodes hold
              G > 1 GPUs and the config's hierarchy block says so (comm/topology.py; "auto": on
              more than one node): a reduce-scatter and an all-gather of the fp32 buffer inside
              the node (as an allreduce of 4 bytes a parameter over G), and between nodes the
              exchange of the node's G slices at once, which put on the node's link what one
              rank of a flat exchange among the N nodes would: a G-th of the flat exchange's
              bytes on the link for its all-to-all half (the papers' 1-bit LAMB counts G = 1).
              On unequal nodes the fullest node's ring inside, and S slices between nodes (S
              the smallest node's GPUs), the same bytes on every link.
  logged steps: the gradient norm of the metrics costs nothing on the wire in any mode (where
              gradients are never averaged in full, the ranks' own norms are combined in the
              row's small allreduce); those latency-bound rows, two small allreduces every
              `log_every` steps, are not modelled.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

from commodity_bert.collectives.lowbit import BLOCK as LOWBIT_BLOCK
from commodity_bert.collectives.lowbit import dense_bytes
from commodity_bert.collectives.sparse import payload_bytes, sparse_bytes
from commodity_bert.comm.diloco import LOW_BITS
from commodity_bert.data.deal import Deal
from commodity_bert.optim import build  # noqa: F401  (the optimizers register themselves)
from commodity_bert.optim.registry import PlannedStep, StepPlan, planned

GBIT = 1e9 / 8  # bytes per second in one Gbit/s
BACKWARD_SHARE = 2 / 3  # of a forward + backward: backward is twice the forward's FLOPs
MODES = ("bucketwise", "diloco")  # communication modes priced here, beside the optimizers' own plans


class PlanError(Exception):
    """Bad planner input: the message is the one line the user sees."""


def parse_rate(text: str) -> float:
    """'10gbit', '25Gbit', '100mbit', '1.5gbps', '800mbit/s' → bytes per second."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg])(?:bit|bps|b)?(?:/s)?\s*", text.lower())
    if not match:
        raise PlanError(f"link {text!r}: give a rate like 1gbit, 10gbit, 25gbit or 100mbit")
    value, unit = float(match.group(1)), match.group(2)
    return value * {"k": 1e3, "m": 1e6, "g": 1e9}[unit] / 8


def ring_allreduce_bytes(size: float, members: int) -> float:
    """Bytes each member sends in a ring allreduce of `size` bytes (reduce-scatter + all-gather)."""
    return 2 * (members - 1) / members * size if members > 1 else 0.0


def onebit_bytes_per_element(scale_block: int | None) -> float:
    """Bytes per element of one compressed exchange direction: a sign bit plus its share of a scale."""
    return 1 / 8 + (4 / scale_block if scale_block else 0.0)


def world_size(nodes: int, gpus_per_node: int | tuple[int, ...]) -> int:
    """The ranks of `nodes` nodes of `gpus_per_node` GPUs each, or of nodes as unequal as the
    tuple says (4, 4, 2: a 10-GPU cluster of three nodes)."""
    return sum(gpus_per_node) if isinstance(gpus_per_node, tuple) else nodes * gpus_per_node


def largest(gpus_per_node: int | tuple[int, ...]) -> int:
    """The GPUs of the fullest node: on unequal nodes it sets the time of what its ranks do at once
    (its intra-node ring; the share of its link each of its ranks gets)."""
    return max(gpus_per_node) if isinstance(gpus_per_node, tuple) else gpus_per_node


def slices(gpus_per_node: int | tuple[int, ...]) -> int:
    """The slices of the two-level exchange between nodes: as many as the smallest node has GPUs
    (comm/topology.py); each of them is one rank's share of the compression work."""
    return min(gpus_per_node) if isinstance(gpus_per_node, tuple) else gpus_per_node


@dataclass
class Network:
    """What the model needs of a cluster's links: the inter-node network as the rate each node's
    link sends (bytes/s; the node's ranks share it) and its latency per hop; the intra-node link alike."""
    link_bytes_per_s: float
    latency_s: float = 50e-6
    intra_bytes_per_s: float = 200 * GBIT  # PCIe 4.0 x16, when not measured
    intra_latency_s: float = 10e-6

    def allreduce_s(self, size: float, nodes: int, gpus_per_node: int | tuple[int, ...]) -> float:
        """A hierarchical ring allreduce of `size` bytes: within each node, then across nodes (on
        unequal nodes, the fullest node's ring inside)."""
        gpus_per_node = largest(gpus_per_node)
        seconds = 0.0
        if gpus_per_node > 1:
            seconds += (ring_allreduce_bytes(size, gpus_per_node) / self.intra_bytes_per_s
                        + 2 * (gpus_per_node - 1) * self.intra_latency_s)
        if nodes > 1:
            seconds += ring_allreduce_bytes(size, nodes) / self.link_bytes_per_s + 2 * (nodes - 1) * self.latency_s
        return seconds

    def exchange_s(self, size: float, collectives: int, nodes: int, gpus_per_node: int | tuple[int, ...],
                   two_levels: bool, fp32_size: float) -> float:
        """A compressed exchange of `size` bytes, flat over all ranks or in two levels (the node's
        fp32 buffer of `fp32_size` bytes reduced and gathered inside the node; between nodes, the
        node's slices together are `size`, whatever its GPUs)."""
        if not two_levels:
            return self.pairwise_exchange_s(size, collectives, nodes, gpus_per_node)
        gpus_per_node = largest(gpus_per_node)
        inside = ring_allreduce_bytes(fp32_size, gpus_per_node) / self.intra_bytes_per_s \
            + 2 * (gpus_per_node - 1) * self.intra_latency_s
        return inside + self.pairwise_exchange_s(size, collectives, nodes, 1)

    def allgather_exchange_s(self, payload: float, nodes: int, gpus_per_node: int | tuple[int, ...],
                             two_levels: bool, fp32_size: float) -> float:
        """DiLoCo's sparse exchange: an all-gather of every rank's `payload` bytes (a ring: each rank
        passes on W − 1 payloads), flat over all ranks or, in two levels, the node's fp32 buffer
        reduced and gathered inside and its G slices' all-gathers between nodes at once (together
        one whole-model payload per node on the link)."""
        world, largest_node = world_size(nodes, gpus_per_node), largest(gpus_per_node)
        if world == 1:
            return 0.0
        if two_levels:
            inside = ring_allreduce_bytes(fp32_size, largest_node) / self.intra_bytes_per_s \
                + 2 * (largest_node - 1) * self.intra_latency_s
            return inside + (nodes - 1) * (payload / self.link_bytes_per_s + self.latency_s)
        seconds = (world - 1) * payload / (self.link_bytes_per_s if nodes > 1 else self.intra_bytes_per_s)
        return seconds + (world - 1) * (self.latency_s if nodes > 1 else self.intra_latency_s)

    def pairwise_exchange_s(self, size: float, collectives: int, nodes: int,
                            gpus_per_node: int | tuple[int, ...]) -> float:
        """A reduce-scatter by all-to-all and an all-gather of `size` bytes (compressed) among all
        W ranks: each rank sends equal parts to its W−1 peers, (W−G)/(W−1) of them on other nodes;
        a node's G ranks share its link (on unequal nodes, the fullest node's: the slowest)."""
        world, gpus_per_node = world_size(nodes, gpus_per_node), largest(gpus_per_node)
        if world == 1:
            return 0.0
        per_rank = ring_allreduce_bytes(size, world)
        seconds = collectives * (world - 1) * (self.latency_s if nodes > 1 else self.intra_latency_s)
        if nodes > 1:
            seconds += gpus_per_node * per_rank * (world - gpus_per_node) / (world - 1) / self.link_bytes_per_s
        if gpus_per_node > 1:
            seconds += per_rank * (gpus_per_node - 1) / (world - 1) / self.intra_bytes_per_s
        return seconds


@dataclass
class Workload:
    """One training phase as a DeepSpeed config describes it."""
    name: str
    params: int                 # trainable parameters
    global_batch: int           # sequences per optimizer step
    micro_batch: int            # sequences per GPU per forward
    steps: int
    grad_bytes: int             # bytes per gradient element in DeepSpeed's allreduce
    fb_s: float                 # forward + backward of one micro-batch, one GPU
    optimizer_s: float          # the optimizer's step, one GPU
    compress_s: float = 0.0     # a 1-bit exchange's compression-stage work over LAMB's step
    lowbit_s: float = 0.0       # DiLoCo int4/int8: the average's quantize/pack/feedback passes, whole model
    sparse_encode_s: float = 0.0  # DiLoCo sparse: top-k, coding and feedback of the whole model's Δ (at 1%)
    sparse_decode_s: float = 0.0  # and the decoding of one payload (at 1%; its share grows with the density)
    grad_sync_local_s: float = 0.0  # the gradient allreduce's own memory passes (flatten, scale, copy back)
    scale_block: int | None = 256
    bucket_bytes: float = 25 * 2**20  # bucket-wise clipping's bucket (fp32)
    log_every: int = 0          # train.py's --log-every (0: not counted)
    wrapped: bool = False       # fp16/bf16 through DeepSpeed's wrapper (its overflow-flag round)
    loss_scaled: bool = False   # fp16 with a dynamic loss scale (0/1 Adam's syncs agree on it)
    schedule: dict = field(default_factory=dict)  # the optimizer's StepPlan.schedule: its freeze step, …
    inner_steps: int = 50       # DiLoCo's H
    outer_compression: str = "none"  # DiLoCo's pseudo-gradient on the wire: none | bf16 | int8 | int4 | int2 | sparse
    density: float = 0.01       # DiLoCo sparse: the share of each chunk sent
    value_bits: int = 2         # and the bits of each value sent
    fragments: int = 1          # Streaming DiLoCo: fragments synced at staggered steps
    overlap_steps: int = 0      # and the inner steps each fragment's exchange overlaps
    warmup_steps: int = 0       # DiLoCo's data-parallel steps before the first round
    hierarchy: str | bool = "auto"  # the config's commodity_bert.hierarchy.enabled (comm/topology.py)
    # each rank's speed against the fastest's (a card per rank); fb_s is then the slowest's, and
    # `balanced` deals the micro-batches by speed (train/balance.py) instead of equally
    speeds: tuple[float, ...] | None = None
    balanced: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass
class StepEstimate:
    compute_s: float
    comm_s: float               # exposed: not hidden behind compute
    comm_total_s: float         # all communication time, hidden or not
    bytes_per_rank: float       # bytes one rank sends per step for training (the metrics' bytes_sent)
    rounds: int                 # collectives per step
    metrics_bytes: float = 0.0  # and for the metrics' gradient norm: none since it is each rank's own

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s


def two_levels(work: Workload, nodes: int, gpus_per_node: int | tuple[int, ...]) -> bool:
    """Whether the compressed exchanges run in two levels, as comm/topology.py chooses."""
    gpus_per_node = largest(gpus_per_node)
    return gpus_per_node > 1 and (work.hierarchy is True or (work.hierarchy == "auto" and nodes > 1))


def compressed_bytes_per_rank(size: float, fp32_size: float, nodes: int, gpus_per_node: int | tuple[int, ...],
                              levels: bool) -> float:
    """What one rank sends for a compressed exchange of `size` bytes (the metrics' bytes_sent)."""
    if not levels:
        return ring_allreduce_bytes(size, world_size(nodes, gpus_per_node))
    return ring_allreduce_bytes(fp32_size, largest(gpus_per_node)) + ring_allreduce_bytes(size / slices(gpus_per_node), nodes)


def micro_batches_s(work: Workload, world: int) -> float:
    """The step's forward and backward passes: accumulation × the slowest card's micro-batch, or,
    balanced over cards of unequal speed, the slowest rank's share of the step (data/deal.py)."""
    accumulation = accumulation_steps(work, world)
    if not work.balanced or not work.speeds or len(work.speeds) != world:
        return accumulation * work.fb_s
    speeds = list(work.speeds)
    fastest_fb_s = work.fb_s * min(speeds)
    return Deal.from_speeds(speeds, accumulation).step_time(speeds) * fastest_fb_s


def accumulation_steps(work: Workload, world: int) -> int:
    per_gpu = work.global_batch / world
    return max(1, math.ceil(per_gpu / work.micro_batch))


def step_models() -> tuple[str, ...]:
    """bert-plan --optimizer's names: the registered optimizers' plans, then the modes'."""
    return (*planned(), *MODES)


def plan_of(optimizer: str) -> StepPlan | None:
    """A registered optimizer's plan, or None for a mode priced here."""
    if optimizer in MODES:
        return None
    plan = planned().get(optimizer)
    if plan is None:
        raise PlanError(f"optimizer {optimizer!r}: choose from {', '.join(step_models())}")
    return plan


def step_estimate(work: Workload, optimizer: str, stage: str, nodes: int, gpus_per_node: int | tuple[int, ...],
                  net: Network) -> StepEstimate:
    """One step of `optimizer` at `stage` (one of stage_steps' kinds: an optimizer's own, or
    DiLoCo's). The metrics' gradient norm sends nothing (grad_norm.py); the logged rows' own two
    small allreduces are left out."""
    plan = plan_of(optimizer)
    if plan is None:
        return mode_step(work, optimizer, stage, nodes, gpus_per_node, net)
    if stage not in plan.kinds:
        raise PlanError(f"{optimizer} has no {stage!r} steps: its kinds are {', '.join(plan.kinds)}")
    return planned_step(work, plan.kinds[stage], nodes, gpus_per_node, net)


def planned_step(work: Workload, kind: PlannedStep, nodes: int, gpus_per_node: int | tuple[int, ...], net: Network) -> StepEstimate:
    """One step of a kind an optimizer registered: compute, then what it sends, in order."""
    world = world_size(nodes, gpus_per_node)
    compute = micro_batches_s(work, world) + work.optimizer_s
    seconds = sent = 0.0
    rounds = 0
    if kind.gradient_allreduce:
        compute += work.grad_sync_local_s  # at every world size: DeepSpeed's path runs at 1 rank too
        size = float(work.grad_bytes * work.params)
        seconds, sent, rounds = net.allreduce_s(size, nodes, gpus_per_node), ring_allreduce_bytes(size, world), 1
    agreements = ((kind.overflow_flag and work.wrapped, 1.0), (kind.loss_scale_agreement and work.loss_scaled, 16.0))
    for size in (size for on, size in agreements if on and world > 1):
        seconds += net.allreduce_s(size, nodes, gpus_per_node)
        sent += ring_allreduce_bytes(size, world)
        rounds += 1
    if kind.onebit_exchange:
        compute += work.compress_s
        if world > 1:
            levels, fp32_size = two_levels(work, nodes, gpus_per_node), 4.0 * work.params
            size = work.params * onebit_bytes_per_element(work.scale_block)
            seconds += net.exchange_s(size, 4, nodes, gpus_per_node, levels, fp32_size)
            sent += compressed_bytes_per_rank(size, fp32_size, nodes, gpus_per_node, levels)
            rounds += 4
    return StepEstimate(compute, seconds, seconds, sent, rounds if world > 1 else 0)


def mode_step(work: Workload, mode: str, stage: str, nodes: int, gpus_per_node: int | tuple[int, ...], net: Network) -> StepEstimate:
    """A step of a communication mode that is not an optimizer: bucket-wise clipping's, DiLoCo's."""
    world = world_size(nodes, gpus_per_node)
    compute = micro_batches_s(work, world) + work.optimizer_s
    levels = two_levels(work, nodes, gpus_per_node)
    if mode == "diloco" and stage == "warmup":  # an ordinary data-parallel step
        return planned_step(work, PlannedStep(), nodes, gpus_per_node, net)
    if mode == "diloco" and stage == "inner":  # engine.no_sync(): not even the overflow flag
        return StepEstimate(compute, 0.0, 0.0, 0.0, 0)
    if mode == "diloco":
        # "outer": one fragment's round end (the whole model when fragments = 1), its exchange
        # overlapped with `overlap_steps` inner steps; "final": the last step, every fragment, blocking
        share = 1.0 if stage == "final" else 1.0 / work.fragments
        params = work.params * share
        compute += work.optimizer_s * share  # the outer update's passes over the fragment
        bits = LOW_BITS.get(work.outer_compression)
        exchange_world = nodes if levels else world  # the ranks among which the exchange runs
        sparse = work.outer_compression == "sparse" and exchange_world > 1 and \
            sparse_bytes(params, work.density, work.value_bits, exchange_world) <= \
            dense_bytes(params, work.value_bits, exchange_world)
        if work.outer_compression == "sparse" and not sparse:  # diloco.py's choice: the dense low-bit exchange
            bits = work.value_bits
        if sparse:  # an all-gather of fixed-size payloads: each goes to every other rank, none summed on the way
            share_of_slice = 1 / (slices(gpus_per_node) if levels else 1)
            compute += (work.sparse_encode_s + exchange_world * work.sparse_decode_s * work.density / 0.01) \
                * share * share_of_slice
            payload = payload_bytes(params, work.density, work.value_bits)
            seconds = net.allgather_exchange_s(payload, nodes, gpus_per_node, levels, 4.0 * params)
            sent = (exchange_world - 1) * payload * share_of_slice
            if levels:
                sent += ring_allreduce_bytes(4.0 * params, largest(gpus_per_node))
            rounds = 1 + (2 if levels else 0)
        elif bits:  # its passes run on the rank's own cores or stream: not hidden by the overlap
            compute += work.lowbit_s * share / (slices(gpus_per_node) if levels else 1)  # two levels: its slice
            size = params * (bits / 8 + 4 / LOWBIT_BLOCK)
            seconds = net.exchange_s(size, 2, nodes, gpus_per_node, levels, 4.0 * params)
            sent, rounds = compressed_bytes_per_rank(size, 4.0 * params, nodes, gpus_per_node, levels), 2
        else:
            size = params * (2.0 if work.outer_compression == "bf16" else 4.0)
            seconds, sent, rounds = net.allreduce_s(size, nodes, gpus_per_node), ring_allreduce_bytes(size, world), 1
        hidden = work.overlap_steps * compute if stage == "outer" else 0.0  # inner steps
        return StepEstimate(compute, max(seconds - hidden, 0.0), seconds, sent, rounds if world > 1 else 0)
    # bucketwise
    compute += work.grad_sync_local_s
    size = 4.0 * work.params  # comm/bucketwise.py communicates fp32
    buckets = max(1, math.ceil(size / work.bucket_bytes))
    total = sum(net.allreduce_s(min(work.bucket_bytes, size - b * work.bucket_bytes), nodes, gpus_per_node)
                for b in range(buckets))
    last = net.allreduce_s(size - (buckets - 1) * work.bucket_bytes, nodes, gpus_per_node)
    hidden_behind = BACKWARD_SHARE * work.fb_s * (buckets - 1) / buckets
    exposed = max(total - hidden_behind, last) if world > 1 else 0.0
    return StepEstimate(compute, exposed, total, ring_allreduce_bytes(size, world), buckets if world > 1 else 0)


def step_sequence(work: Workload, optimizer: str) -> list[str]:
    """The kind of each of the phase's steps 1 … steps, as train.py runs them (an fp16 step
    skipped for an overflow is not counted apart)."""
    plan = plan_of(optimizer)
    if plan is not None:
        return list(plan.sequence(work.steps, work.schedule))
    if optimizer == "diloco":  # a fragment's round end (comm/diloco.py), and every fragment's at the last step
        ends, warm = {p * work.inner_steps // work.fragments for p in range(work.fragments)}, work.warmup_steps
        return ["warmup" if t <= warm else "final" if t == work.steps else
                "outer" if (t - warm) % work.inner_steps in ends else "inner" for t in range(1, work.steps + 1)]
    return ["full"] * work.steps


def step_estimates(work: Workload, optimizer: str, nodes: int, gpus_per_node: int | tuple[int, ...],
                   net: Network) -> tuple[list[StepEstimate], dict[str, StepEstimate]]:
    """Each of the phase's steps priced in order (step_sequence), and the estimate per kind."""
    by_kind: dict[str, StepEstimate] = {}
    per_step = []
    for kind in step_sequence(work, optimizer):
        if kind not in by_kind:
            by_kind[kind] = step_estimate(work, optimizer, kind, nodes, gpus_per_node, net)
        per_step.append(by_kind[kind])
    return per_step, by_kind


def stage_steps(work: Workload, optimizer: str) -> list[tuple[str, int]]:
    """How many of the phase's steps are of each kind, in order of first appearance."""
    plan = plan_of(optimizer)
    if plan is not None:
        return plan.counts(work.steps, work.schedule)
    if optimizer == "diloco":  # by arithmetic: phases run to 10⁵ steps
        warm = min(work.warmup_steps, work.steps)
        if warm == work.steps:  # the run ends in its warm-up: no round, no final sync
            return [("warmup", warm)]
        before_last = work.steps - warm - 1
        outer = sum((before_last - p * work.inner_steps // work.fragments) // work.inner_steps + (p > 0)
                    for p in range(work.fragments)) if before_last > 0 else 0
        rounds = [("inner", work.steps - warm - 1 - outer), ("outer", outer), ("final", 1)]
        return ([("warmup", warm)] if warm else []) + rounds
    return list(Counter(step_sequence(work, optimizer)).items())


def phase_estimate(work: Workload, optimizer: str, nodes: int, gpus_per_node: int | tuple[int, ...], net: Network) -> dict:
    """A phase's totals over its kinds of steps (stage_steps)."""
    stages = stage_steps(work, optimizer)
    seconds = compute = comm = sent = 0.0
    detail = {}
    for stage, steps in stages:
        est = step_estimate(work, optimizer, stage, nodes, gpus_per_node, net)
        seconds += steps * est.step_s
        compute += steps * est.compute_s
        comm += steps * est.comm_s
        sent += steps * (est.bytes_per_rank + est.metrics_bytes)
        detail[stage] = {"steps": steps, "step_s": est.step_s, "compute_s": est.compute_s, "comm_s": est.comm_s,
                         "comm_total_s": est.comm_total_s, "bytes_per_step": est.bytes_per_rank,
                         "grad_norm_bytes_per_step": est.metrics_bytes,
                         "rounds_per_step": est.rounds}
    steps = max(work.steps, 1)
    return {"phase": work.name, "steps": work.steps, "seconds": seconds, "step_s": seconds / steps,
            "compute_s": compute / steps, "comm_s": comm / steps, "bytes_per_rank": sent,
            "accumulation": accumulation_steps(work, world_size(nodes, gpus_per_node)), "stages": detail}


def recipe_rows(phases: dict[str, list[Workload]], nodes_list: list[int], gpus_per_node: int | tuple[int, ...],
                net: Network,
                usd_per_gpu_hour: float | None) -> list[dict]:
    """One row per optimizer and node count over all phases of the recipe (phases[optimizer])."""
    rows = []
    for optimizer, works in phases.items():
        # the same samples on one GPU, no communication and no compression
        single = sum(phase_estimate(w, "lamb", 1, 1, net)["compute_s"] * w.steps for w in works)
        samples = sum(w.global_batch * w.steps for w in works)
        for nodes in nodes_list:
            gpus = world_size(nodes, gpus_per_node)
            per_phase = [phase_estimate(w, optimizer, nodes, gpus_per_node, net) for w in works]
            seconds = sum(p["seconds"] for p in per_phase)
            steps = sum(w.steps for w in works)
            days = seconds / 86400
            rows.append({
                "optimizer": optimizer, "nodes": nodes, "gpus": gpus,
                "step_s": seconds / steps,
                "compute_s": sum(p["compute_s"] * p["steps"] for p in per_phase) / steps,
                "comm_s": sum(p["comm_s"] * p["steps"] for p in per_phase) / steps,
                "seq_per_s": samples / seconds,
                "efficiency": single / (gpus * seconds),
                "days": days,
                "usd": None if usd_per_gpu_hour is None else days * 24 * gpus * usd_per_gpu_hour,
                "bytes_per_rank": sum(p["bytes_per_rank"] for p in per_phase),
                "phases": per_phase,
            })
    return rows
