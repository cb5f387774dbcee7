"""DiLoCo (Douillard et al., arXiv 2311.08105) and Streaming DiLoCo (arXiv 2501.18512;
docs/ALGORITHMS.md, "DiLoCo"): ranks train alone for H inner steps, then average how far they
moved and take one outer step; streamed, the model is split into fragments synced at staggered
steps, each exchange overlapped with the next inner steps.

Each round starts from parameters θ that every rank holds alike. A rank takes `inner_steps`
steps with the inner optimizer (the config's own: LAMB, AdamW; its state stays local) on its own
gradients: the engine's gradient allreduce is off (`engine.no_sync()` around forward and
backward, which also keeps DeepSpeed's fp16/bf16 wrapper from allreducing its overflow flag every
step). At the round's end the ranks average the pseudo-gradient Δ = θ − θ_local with one
collective, and an outer SGD step with Nesterov momentum moves θ:

    b ← μ·b + Δ;   d = Δ + μ·b (Nesterov) or b;   θ ← θ − outer_lr·d

Every rank computes the same θ from the same averaged Δ, writes it into the fp32 parameters the
inner optimizer updates (DeepSpeed's master copies under fp16/bf16) and into the model, and
starts the next round. One parameter-sized exchange per H steps instead of one per step.

Streaming (`fragments` P > 1): the parameters are split into P fragments by transformer layer,
strided (layer l in fragment l mod P; embeddings and heads each to the smallest fragment), and
fragment p has its round end at the steps t with t mod H = ⌊p·H/P⌋: the same bytes per H steps,
a P-th of them at a time. With `overlap_steps` τ > 0 the fragment's Δ is computed at its round
end and averaged in the background (a thread of its own, on process groups of its own) while the
next τ inner steps run; at step t + τ the outer step is taken and the rank's fragment becomes
α·θ_local + (1 − α)·θ (α = `merge`, the paper's mixing factor), so the τ steps taken meanwhile
are kept in part. With τ = 0 the rank takes θ (α is not used). Each update is applied exactly once;
a checkpoint taken while one is in flight waits for it and saves the averaged Δ with the step it
is due, so a resumed run applies it where the uninterrupted one would. The last step of a run
ends every fragment's round, without overlap: what the run evaluates and exports is one model.

Warm-up (`warmup_steps` W > 0): the first W steps are ordinary data-parallel steps (the engine
allreduces every gradient, so the ranks stay identical), and the rounds start from the model they
reach: θ is taken after step W and round ends fall at t − W ≡ offset (mod H). The original DiLoCo
starts its rounds from a model trained synchronously first; each warm-up step costs a whole
gradient allreduce, about the bytes of 4 int4 rounds.

Written here because neither DeepSpeed nor torch has it. Selected by the project block of the
DeepSpeed config:
    "commodity_bert": {"diloco": {"inner_steps": 50, "outer_lr": 0.7, "outer_momentum": 0.9,
                                  "nesterov": true, "compression": "none", "warmup_steps": 0}}
`compression` is how Δ travels: "none" (fp32 allreduce, 4 bytes a parameter), "bf16" (bf16
allreduce, 2), "int8", "int4" or "int2" (8-, 4- or 2-bit values with one fp32 scale per 256,
reduced through an all-to-all and an all-gather as the 1-bit allreduce is: about 1, 0.5 or 0.25
byte a parameter each way; lowbit.py), or "sparse" (the top `density` of each chunk of 4,096 values
in `value_bits` 2 or 4 bits with 12-bit offsets, the rest kept for the next round: `error_feedback`
must be true; all-gathered, so a rank receives W − 1 payloads, or sent as dense int2/int4 where
that costs fewer bytes, said at the start and in the metrics' `sparse_exchange`; sparse.py).
`rounding` "nearest" or "stochastic" and `error_feedback` (low-bit, sparse) say how.
`outer_state_device`: where θ and b live (2 × 4 bytes a parameter): "auto" (the accelerator if
it has room for them with a quarter to spare, else host memory), "cpu" or "accelerator".
"""
from __future__ import annotations

import contextlib
import re
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from commodity_bert.collectives.lowbit import ROUNDINGS, LowBitAverage, dense_bytes
from commodity_bert.collectives.sparse import CHUNK, VALUE_BITS, SparseAverage, sparse_bytes
from commodity_bert.comm import bytes_counter
from commodity_bert.comm.topology import world_timeout
from commodity_bert.optim.precision import MasterParams
from commodity_bert.run_config import RunConfig, register_section

DEFAULTS = {"enabled": True, "inner_steps": 50, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True,
            "compression": "none", "outer_state_device": "auto", "rounding": "nearest", "error_feedback": False,
            "fragments": 1, "overlap_steps": 0, "merge": 0.5, "warmup_steps": 0, "density": 0.01, "value_bits": 2}
COMPRESSIONS = ("none", "bf16", "int8", "int4", "int2", "sparse")
LOW_BITS = {"int8": 8, "int4": 4, "int2": 2}
STATE_DEVICES = ("auto", "cpu", "accelerator")
LAYER = re.compile(r"\.layer\.(\d+)\.")


def diloco_settings(config: RunConfig | dict) -> dict | None:
    """The DiLoCo settings with defaults filled in, or None when the config does not enable it
    (`"diloco": {}` enables it with the defaults)."""
    config = RunConfig.of(config)
    if config.given_section("diloco") is None:
        return None
    settings = config.section("diloco")
    return settings if settings["enabled"] else None


def check_settings(settings: dict) -> str | None:
    """The problem with a diloco block, as one line, or None."""
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    def count(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    steps = settings["inner_steps"]
    if not count(steps) or steps < 1:
        return f"diloco inner_steps {steps!r}: give a positive number of steps, e.g. 50"
    if not number(settings["outer_lr"]) or settings["outer_lr"] <= 0:
        return f"diloco outer_lr {settings['outer_lr']!r}: give a positive number (the paper's: 0.7)"
    if not number(settings["outer_momentum"]) or not 0 <= settings["outer_momentum"] < 1:
        return f"diloco outer_momentum {settings['outer_momentum']!r}: give a number in [0, 1) (the paper's: 0.9)"
    if not isinstance(settings["nesterov"], bool):
        return f"diloco nesterov {settings['nesterov']!r}: give true or false"
    if settings["compression"] not in COMPRESSIONS:
        return f"diloco compression {settings['compression']!r}: give one of {', '.join(COMPRESSIONS)}"
    if settings["outer_state_device"] not in STATE_DEVICES:
        return f"diloco outer_state_device {settings['outer_state_device']!r}: give one of {', '.join(STATE_DEVICES)}"
    if settings["rounding"] not in ROUNDINGS:
        return f"diloco rounding {settings['rounding']!r}: give one of {', '.join(ROUNDINGS)}"
    if not isinstance(settings["error_feedback"], bool):
        return f"diloco error_feedback {settings['error_feedback']!r}: give true or false"
    if not count(settings["fragments"]) or not 1 <= settings["fragments"] <= steps:
        return (f"diloco fragments {settings['fragments']!r}: give a number of fragments from 1 to inner_steps "
                f"({steps}), e.g. 4")
    if not count(settings["overlap_steps"]) or not 0 <= settings["overlap_steps"] < steps:
        return (f"diloco overlap_steps {settings['overlap_steps']!r}: give 0 to {steps - 1} (fewer than inner_steps, "
                f"so a fragment's update lands before its next round ends)")
    if not number(settings["merge"]) or not 0 <= settings["merge"] <= 1:
        return f"diloco merge {settings['merge']!r}: give a number in [0, 1] (the paper's: 0.5)"
    if settings["compression"] == "sparse":
        if not number(settings["density"]) or not 0 < settings["density"] <= 0.5:
            return (f"diloco density {settings['density']!r}: give the share of each chunk's values sent, in (0, 0.5], "
                    f"e.g. 0.01")
        if settings["value_bits"] not in VALUE_BITS:
            return f"diloco value_bits {settings['value_bits']!r}: give one of {', '.join(map(str, VALUE_BITS))}"
        if settings["error_feedback"] is not True:
            return ("diloco compression sparse keeps what it does not send for the next round: set "
                    "\"error_feedback\": true")
    if not count(settings["warmup_steps"]) or settings["warmup_steps"] < 0:
        return (f"diloco warmup_steps {settings['warmup_steps']!r}: give 0 or more steps of ordinary data-parallel "
                f"training before the first round, e.g. 0")
    return None


def rehearsed_settings(settings: dict, steps: int) -> dict:
    """A rehearsal's rounds: a few inner steps each, no warm-up, so that several rounds run."""
    inner = max(2, steps // 4)
    return {**settings, "inner_steps": inner, "warmup_steps": 0,
            "fragments": min(settings.get("fragments", 1), inner),
            "overlap_steps": min(settings.get("overlap_steps", 0), inner - 1)}


register_section("diloco", DEFAULTS, lambda settings, config: check_settings(settings) if settings["enabled"] else None,
                 rehearsed_settings)


def _state_device(choice: str, master_device: torch.device, numel: int) -> torch.device:
    if choice == "cpu" or master_device.type == "cpu":
        return torch.device("cpu")
    if choice == "accelerator":
        return master_device
    free, _ = torch.cuda.mem_get_info(master_device)
    return master_device if free > 1.25 * 2 * 4 * numel else torch.device("cpu")


def split_into_fragments(masters: MasterParams, names: dict, count: int) -> list[list[tuple[int, int, int]]]:
    """Each fragment as pieces (master tensor, start, end) of the flat master tensors: transformer
    layer l in fragment l mod `count` (strided, as the paper's best pattern), every other
    parameter (embeddings, pooler, heads) in the smallest fragment so far. `names`: model
    parameter → its name."""
    units = []  # (layer or None, piece)
    for index, covered in enumerate(masters.model_params()):
        offset = 0
        for param in covered:
            match = LAYER.search(names.get(param, ""))
            units.append((int(match.group(1)) if match else None, (index, offset, offset + param.numel())))
            offset += param.numel()
    fragments, sizes = [[] for _ in range(count)], [0] * count
    for layer, piece in sorted(units, key=lambda u: u[0] is None):  # the layers first, then the rest
        f = layer % count if layer is not None else sizes.index(min(sizes))
        fragments[f].append(piece)
        sizes[f] += piece[2] - piece[1]
    return fragments


class Fragment:
    """One fragment: where its values lie in the masters and in the flat θ, and how it travels."""

    def __init__(self, pieces, bases: list[int]):
        self.pieces = pieces
        self.flat = [(bases[i] + a, bases[i] + b) for i, a, b in pieces]  # ranges in the flat θ
        self.numel = sum(b - a for a, b in self.flat)
        self.offset = 0  # its round ends at steps t with t mod H = offset
        self.average = None  # callable: the mean of a flat fp32 tensor over the ranks
        self.sent_share = None  # sparse: of the update last applied, the share its exchange sent

    def take(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.cat([flat[a:b] for a, b in self.flat])

    def put(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        offset = 0
        for a, b in self.flat:
            flat[a:b].copy_(values[offset: offset + b - a])
            offset += b - a

    def local(self, tensors) -> torch.Tensor:
        return torch.cat([tensors[i].detach().reshape(-1)[a:b].float() for i, a, b in self.pieces])

    def write_local(self, tensors, values: torch.Tensor) -> None:
        offset = 0
        for i, a, b in self.pieces:
            tensors[i].data.view(-1)[a:b].copy_(values[offset: offset + b - a])
            offset += b - a


class DiLoCo:
    def __init__(self, masters: MasterParams, settings: dict, hierarchy=None, names: dict | None = None):
        self.masters = masters
        self.hierarchy = hierarchy  # two levels: comm/topology.py
        self.inner_steps = settings["inner_steps"]
        self.outer_lr = settings["outer_lr"]
        self.momentum = settings["outer_momentum"]
        self.nesterov = settings["nesterov"]
        self.compression = settings["compression"]
        self.settings = settings
        self.overlap = settings["overlap_steps"]
        self.merge = settings["merge"] if self.overlap else 0.0
        self.warmup = settings["warmup_steps"]
        self.warming_up = self.warmup > 0  # until step W: the engine allreduces, no rounds
        tensors = masters.tensors
        self.numel = sum(t.numel() for t in tensors)
        self.device = tensors[0].device
        self.state_device = _state_device(settings["outer_state_device"], self.device, self.numel)
        # θ (the last synced parameters) and b, flat fp32
        self.start = self._flat_masters().to(self.state_device)
        self.velocity = torch.zeros_like(self.start)
        self.rounds = 0  # outer steps of the whole model (a fragment's counts 1/P)
        self.weight = 1.0  # this rank's share of the samples × W (train/balance.py)
        bases, total = [], 0
        for t in tensors:
            bases.append(total)
            total += t.numel()
        pieces = split_into_fragments(masters, names or {}, settings["fragments"]) if settings["fragments"] > 1 \
            else [[(i, 0, t.numel()) for i, t in enumerate(tensors)]]
        self.fragments = [Fragment(p, bases) for p in pieces if p]
        for p, fragment in enumerate(self.fragments):
            fragment.offset = p * self.inner_steps // len(self.fragments)
        # the exchanges run on groups of their own where they run beside the loop's collectives
        own_groups = self.overlap > 0
        self.groups = self._groups() if own_groups else (None, hierarchy)
        self.sparse_exchange = False  # sparse: whether its all-gather of top-k payloads costs fewer bytes
        for p, fragment in enumerate(self.fragments):
            fragment.average = self._exchange(fragment.numel, p)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="diloco-outer") if own_groups else None
        # fragment → (step due, averaged Δ, its exchange's bytes not yet counted: _held_back)
        self.pending: dict[int, tuple[int, Future | torch.Tensor, dict]] = {}

    def _flat_masters(self) -> torch.Tensor:
        """The rank's parameters as one flat fp32 tensor, laid out as θ."""
        return torch.cat([t.detach().reshape(-1).float() for t in self.masters.tensors])

    def _groups(self):
        """The process group of the background exchanges (collective: every rank, the same order):
        gloo and NCCL keep a group's collectives in the order they were issued, so the thread's may
        not share one with the loop's. In two levels the hierarchy's groups are the exchanges' alone."""
        return (dist.new_group(timeout=world_timeout()), None) if self.hierarchy is None else (None, self.hierarchy)

    def _exchange(self, numel: int, seed: int):
        """The averaging of one fragment's Δ, as `compression` says, flat or in two levels."""
        group, hierarchy = self.groups
        settings = self.settings
        bits = LOW_BITS.get(self.compression, settings["value_bits"] if self.compression == "sparse" else None)
        # sparse: the all-gather of top-k payloads, or the dense low-bit exchange where it sends fewer bytes
        # (the same choice on every rank: the payloads' count is the exchange's group size)
        world = dist.get_world_size(group) if hierarchy is None else hierarchy.nodes
        size = numel if hierarchy is None else hierarchy.slice_numel(numel)
        if self.compression == "sparse":
            self.sparse_exchange = sparse_bytes(size, settings["density"], bits, world) <= dense_bytes(size, bits, world)

        def between(size, on_group):
            if bits is None:
                return lambda x: average(x, self.compression, on_group)
            if self.compression == "sparse" and self.sparse_exchange:
                return SparseAverage(size, settings["density"], bits, self.device, on_group, settings["rounding"], seed)
            return LowBitAverage(size, bits, self.device, on_group, settings["rounding"], settings["error_feedback"],
                                 seed)

        if hierarchy is None:
            return between(numel, group)
        exchanges = hierarchy.nodes > 1 and hierarchy.holds_slice  # else: inside the node only
        part = between(hierarchy.slice_numel(numel), hierarchy.cross) if exchanges else None
        return _TwoLevels(hierarchy, part)

    def sent_share(self) -> float | None:
        """Sparse: the share of the pending update (Δ plus the residual, squared norm) this rank's
        last exchange of each fragment sent, averaged over the fragments; None before one ran."""
        shares = [f.sent_share for f in self.fragments if f.sent_share is not None]
        return sum(shares) / len(shares) if shares else None

    def describe(self) -> str:
        masters = {"plain": "the model's own parameters", "unfused": "DeepSpeed's fp32 copies (per tensor)",
                   "flat": "DeepSpeed's fp32 copies (flat)"}[self.masters.kind]
        sent = "fp32" if self.compression == "none" else self.compression
        if self.compression == "sparse":
            sent = (f"the top {self.settings['density']:.2%} of each {CHUNK:,} values in {self.settings['value_bits']} "
                    f"bits ({self.settings['rounding']} rounding, error feedback), "
                    + ("all-gathered" if self.sparse_exchange else
                       f"as dense int{self.settings['value_bits']} (fewer bytes at this many workers)"))
        elif self.compression in LOW_BITS:
            sent += f" ({self.settings['rounding']} rounding{', error feedback' if self.settings['error_feedback'] else ''})"
        streamed = ""
        if len(self.fragments) > 1 or self.overlap:
            streamed = (f"; {len(self.fragments)} fragment{'s' if len(self.fragments) > 1 else ''} at offsets "
                        f"{[f.offset for f in self.fragments]}, each overlapped with {self.overlap} inner steps"
                        f"{f' (merge {self.merge})' if self.overlap else ''}")
        warmup = f"{self.warmup} data-parallel steps first{' (in progress)' if self.warming_up else ''}, then " \
            if self.warmup else ""
        return (f"{warmup}an outer step every {self.inner_steps} steps (lr {self.outer_lr}, momentum {self.momentum}"
                f"{', Nesterov' if self.nesterov and self.momentum else ''}), pseudo-gradient sent as {sent}{streamed}; "
                f"{self.numel:,} parameters, updated through {masters}; outer state on {self.state_device.type}, "
                f"round {self.rounds:g}")

    # ---- the steps
    @torch.no_grad()
    def after_step(self, step: int, last: bool) -> None:
        """After the inner step `step`: updates due now applied, rounds ending now started."""
        if self.warming_up:
            if step >= self.warmup or last:  # the ranks are alike: every one takes θ from its own copy
                self.start.copy_(self._flat_masters())
                self.warming_up = False
            return
        for p in sorted(self.pending):
            if self.pending[p][0] <= step or last:
                self._apply(p, self._result(p))
        if last:  # every fragment ends its round, and the run one model
            for p in range(len(self.fragments)):
                self._apply(p, self.fragments[p].average(self._delta(p)), merge=0.0)
            self.masters.push_to_model()
            return
        for p, fragment in enumerate(self.fragments):
            if (step - self.warmup) % self.inner_steps != fragment.offset:
                continue
            if self.overlap:
                delta = self._delta(p)
                in_flight = self.executor.submit(_held_back, fragment.average, delta)
                self.pending[p] = (step + self.overlap, in_flight, {})
            else:
                self._apply(p, fragment.average(self._delta(p)))
        self.masters.push_to_model()

    @torch.no_grad()
    def outer_step(self) -> None:
        """Every fragment's round ends now, nothing overlapped (the last step of a run)."""
        self.after_step(0, last=True)

    def _delta(self, p: int) -> torch.Tensor:
        """This rank's pseudo-gradient, times its `weight`: its share of the step's samples × W
        (train/balance.py), so that the mean over the ranks weighs each by the samples it trained."""
        fragment = self.fragments[p]
        delta = fragment.take(self.start).to(self.device) - fragment.local(self.masters.tensors)
        return delta if self.weight == 1.0 else delta.mul_(self.weight)

    def _result(self, p: int) -> torch.Tensor:
        """The averaged Δ of fragment p's update in flight, no longer pending; the exchange's bytes
        count now, in the step that uses it (`_held_back`)."""
        result = self._wait(p)
        _, _, tally = self.pending.pop(p)
        counter = bytes_counter.installed()
        if counter is not None:
            counter.credit(tally)
        return result

    def _apply(self, p: int, delta: torch.Tensor, merge: float | None = None) -> None:
        """The outer step on fragment p's averaged Δ; the rank's fragment moves to the new θ (or to
        α·local + (1 − α)·θ where the inner steps went on meanwhile)."""
        fragment = self.fragments[p]
        delta = delta.to(self.state_device, copy=True)  # the averaged Δ may be kept (a checkpoint's)
        velocity = fragment.take(self.velocity).mul_(self.momentum).add_(delta)
        fragment.put(self.velocity, velocity)
        direction = delta.add_(velocity, alpha=self.momentum) if self.nesterov else velocity
        theta = fragment.take(self.start).add_(direction, alpha=-self.outer_lr)
        fragment.put(self.start, theta)
        merge = self.merge if merge is None else merge
        theta = theta.to(self.device)
        if merge:
            theta = torch.lerp(theta, fragment.local(self.masters.tensors), merge)
        fragment.write_local(self.masters.tensors, theta)
        # read when the update is applied, not when a background exchange ends: the logged value is
        # the same in every run
        exchange = fragment.average.part if isinstance(fragment.average, _TwoLevels) else fragment.average
        fragment.sent_share = getattr(exchange, "sent_share", None)
        self.rounds += 1 / len(self.fragments)

    def _write_masters(self, flat: torch.Tensor) -> None:
        offset = 0
        for t in self.masters.tensors:
            t.data.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()
        self.masters.push_to_model()

    @contextlib.contextmanager
    def global_model(self):
        """The model as all ranks share it (θ, each fragment's last result) inside; the rank's own
        parameters back afterwards. For evaluation and export in the middle of a round."""
        if self.warming_up:  # the ranks' own parameters are the shared ones
            yield
            return
        kept = [t.detach().clone() for t in self.masters.tensors]
        self._write_masters(self.start.to(self.device))
        try:
            yield
        finally:
            for t, k in zip(self.masters.tensors, kept):
                t.data.copy_(k)
            self.masters.push_to_model()  # the model's parameters are the masters, cast

    # θ, b and the updates in flight are the same on every rank: they travel in DeepSpeed's
    # checkpoint (client state); the exchanges' error feedback, and the bytes of an update in
    # flight not yet counted, are each rank's own
    def state_dict(self) -> dict:
        pending = {p: (due, self._wait(p).cpu()) for p, (due, *_) in list(self.pending.items())}
        return {"start": self.start.cpu(), "velocity": self.velocity.cpu(), "rounds": self.rounds,
                "inner_steps": self.inner_steps, "fragments": len(self.fragments), "pending": pending,
                "warming_up": self.warming_up}

    def _wait(self, p: int) -> torch.Tensor:
        due, result, tally = self.pending[p]
        if isinstance(result, Future):
            result, tally = result.result()
            self.pending[p] = (due, result, tally)
        return result

    def load_state_dict(self, state: dict) -> None:
        if state["start"].numel() != self.numel:
            raise ValueError(f"the checkpoint's DiLoCo state has {state['start'].numel()} parameters, "
                             f"the model {self.numel}")
        self.start.copy_(state["start"])
        self.velocity.copy_(state["velocity"])
        self.rounds = state["rounds"]
        self.warming_up = state.get("warming_up", False)  # saved before warm-up existed: in its rounds
        if state.get("fragments", 1) == len(self.fragments):
            self.pending = {int(p): (due, delta.to(self.device), {})
                            for p, (due, delta) in state.get("pending", {}).items()}

    def rank_state_dict(self) -> list[dict]:
        """Per fragment: its exchange's state (error feedback) and the uncounted bytes of its update
        in flight (`held_bytes`)."""
        held = {}
        for p in self.pending:
            self._wait(p)  # its bytes are known once it has ended
            held[p] = self.pending[p][2]
        return [{**(f.average.state_dict() if hasattr(f.average, "state_dict") else {}),
                 "held_bytes": held.get(p, {}), "applied_sent_share": f.sent_share} for p, f in enumerate(self.fragments)]

    def load_rank_state_dict(self, states: list[dict]) -> None:
        if len(states) != len(self.fragments):
            return  # saved with another split: the error feedback starts from zero
        for p, (fragment, state) in enumerate(zip(self.fragments, states)):
            state = dict(state)
            held = state.pop("held_bytes", {})
            fragment.sent_share = state.pop("applied_sent_share", None)
            if p in self.pending:
                self.pending[p] = (*self.pending[p][:2], held)
            if hasattr(fragment.average, "load_state_dict"):
                fragment.average.load_state_dict(state)


def _held_back(average, delta: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """An overlapped exchange, run on the background thread, and its bytes and calls held back
    from the counter (bytes_counter.BytesCounter.held) until `_result` credits them at the step
    that applies the average: the step is the same in every run, where the moment the thread ends
    is not (it decided which logged step carried the bytes, so a resumed run's metrics differed)."""
    counter = bytes_counter.installed()
    with (counter.held() if counter is not None else contextlib.nullcontext({})) as tally:
        return average(delta), tally


class _TwoLevels:
    """A fragment's average in two levels (topology.py), its exchange between nodes `part`."""

    def __init__(self, hierarchy, part):
        self.hierarchy, self.part = hierarchy, part

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.hierarchy.average(x, self.part)

    def state_dict(self) -> dict:
        return self.part.state_dict() if hasattr(self.part, "state_dict") else {}

    def load_state_dict(self, state: dict) -> None:
        if hasattr(self.part, "load_state_dict"):
            self.part.load_state_dict(state)


def average(delta: torch.Tensor, compression: str, group=None) -> torch.Tensor:
    """The mean of `delta` (flat fp32) over the group's ranks, fp32 or bf16 on the wire."""
    world = dist.get_world_size(group)
    if compression == "none":
        dist.all_reduce(delta, group=group)
        return delta.div_(world)
    low = delta.to(torch.bfloat16).div_(world)
    dist.all_reduce(low, group=group)
    return low.float()
