"""Ranks of unequal speed: each trains a share of the step's micro-batches in proportion to its
speed (data/deal.py says which), so a 3090 beside a 2080 Ti does not wait a third of every step.

The config's section, `"commodity_bert": {"balance": {...}}`:

    split         "equal" (every rank a micro-batches a step) | "speed"
    speeds        one number per rank (relative, e.g. from bert-plan preflight or the cards'
                  throughput): the deal is fixed from them. Absent: measured, as below.
    measure_steps the ranks' speeds are each rank's forward micro-batches a second over this many
                  steps (the forward alone: it holds no collective, so a slow peer's wait never
                  reads as this rank's slowness); the first deal after the first such window
    redeal        keep measuring (a moving average) and re-deal at a step's boundary when the new
                  deal's predicted step time is shorter by `redeal_gain` or more, so a noisy
                  neighbour does not make the shares swing
    redeal_gain   0.1

The deal and the speeds it came from are kept in the checkpoint, and a re-deal happens only at
a step a launch reaches itself: a relaunch trains on the saved deal until its own measurements
decide otherwise, so it resumes bit for bit; a relaunch on another world size starts equal.

`COMMODITY_BERT_SLOW_RANKS="RANK:FACTOR[:FIRST-LAST],..."` (tests and benchmarks only) slows a
rank's compute and not its exchange, as a slower card would: after each forward it sleeps
(FACTOR − 1) × the forward's time, and after each backward (FACTOR − 1) × twice that (a
backward is about two forwards; the boundary's backward holds the allreduce, so its own time
would slow the exchange too), from step FIRST to LAST where given; `bert-plan preflight` multiplies
the forward + backward it times by FACTOR, as it would read a slower card.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist

from commodity_bert.data.deal import Deal, DealError, counts_for_speeds
from commodity_bert.run_config import RunConfig, register_section

DEFAULTS = {"split": "equal", "speeds": None, "measure_steps": 10, "redeal": True, "redeal_gain": 0.1}
SLOW_RANKS_ENV = "COMMODITY_BERT_SLOW_RANKS"


def check_settings(settings: dict, config: RunConfig) -> str | None:
    if settings["split"] not in ("equal", "speed"):
        return f'balance split {settings["split"]!r}: give "equal" or "speed"'
    speeds = settings.get("speeds")
    if speeds is not None and (not isinstance(speeds, list) or not speeds
                               or not all(isinstance(s, (int, float)) and s > 0 for s in speeds)):
        return f"balance speeds {speeds!r}: give one number above 0 per rank, e.g. [1, 1, 0.5]"
    if not isinstance(settings["measure_steps"], int) or settings["measure_steps"] < 1:
        return f"balance measure_steps {settings['measure_steps']!r}: give a whole number of steps, at least 1"
    gain = settings["redeal_gain"]
    if not isinstance(gain, (int, float)) or not 0 <= gain < 1:
        return f"balance redeal_gain {gain!r}: give a fraction of the step time in [0, 1), e.g. 0.1"
    if settings["split"] == "speed" and config.given.get("managed_gradient_accumulation") is False:
        return ('balance split "speed" needs DeepSpeed to count the micro-batches of a step (each rank sets '
                'its own boundary); drop "managed_gradient_accumulation": false from the config')
    if settings["split"] == "speed" and config.zero_stage >= 2:
        return (f"balance split \"speed\" cannot run under ZeRO stage {config.zero_stage}: it reduces the gradients in "
                f"every micro-batch's backward, so every rank must train as many a step; use stage 0 or 1")
    return None


def rehearsed_settings(settings: dict, steps: int) -> dict:
    """A rehearsal's measurement and deal within its first quarter (at a rehearsal's accumulation
    of 1 every rank keeps its one micro-batch: the measuring and its exchange are what run)."""
    return {**settings, "measure_steps": min(settings.get("measure_steps", DEFAULTS["measure_steps"]),
                                             max(1, steps // 4))}


register_section("balance", DEFAULTS, check_settings, rehearsed_settings)


def balance_settings(config: RunConfig | dict) -> dict:
    return RunConfig.of(config).section("balance")


def slow_ranks(text: str | None, rank: int) -> tuple[float, int, int | None]:
    """This rank's (factor, first step, last step or None) from COMMODITY_BERT_SLOW_RANKS."""
    for entry in filter(None, (text or "").split(",")):
        parts = entry.split(":")
        if int(parts[0]) == rank:
            first, last = (parts[2].split("-") + [""])[:2] if len(parts) > 2 else ("0", "")
            return float(parts[1]), int(first or 0), int(last) if last else None
    return 1.0, 0, None


class Balancer:
    """The run's deal: chosen at launch (equal, the config's speeds or the checkpoint's), then from
    the ranks' measured speeds (one allgather of a float per rank each `measure_steps` steps)."""

    def __init__(self, config: RunConfig, world: int, rank: int, accumulation: int, device: torch.device):
        self.settings = balance_settings(config)
        self.world, self.rank, self.accumulation, self.device = world, rank, accumulation, device
        self.enabled = self.settings["split"] == "speed" and world > 1
        self.measuring = self.enabled and self.settings.get("speeds") is None  # else the config's speeds rule
        self.speeds: list[float] | None = None
        self.deal = Deal.equal(world, accumulation)
        self.redeals = 0
        self._forward_s, self._micro_batches, self._steps = 0.0, 0, 0
        self._average: list[float] | None = None
        self._slow = slow_ranks(os.environ.get(SLOW_RANKS_ENV), rank)
        self._step, self._last_forward = 0, 0.0
        self._pending: list[tuple] = []  # a GPU's forwards as event pairs, read once a measurement
        given = self.settings.get("speeds")
        if self.enabled and given is not None:
            if len(given) != world:
                raise DealError(f"balance speeds has {len(given)} entries for {world} ranks; give one per rank, "
                                f"or leave it out to measure them")
            self.speeds = [float(s) for s in given]
            self.deal = Deal.from_speeds(self.speeds, accumulation)

    def describe(self) -> str | None:
        """The launch line (None for the equal split)."""
        if not self.enabled:
            return None
        if self.speeds is None:
            return (f"balance: equal split for the first {self.settings['measure_steps']} steps, then micro-batches "
                    f"dealt by the ranks' measured speeds"
                    + (", re-dealt when that shortens the step by "
                       f"{self.settings['redeal_gain']:.0%}" if self.settings["redeal"] else ""))
        return f"balance: {self.counts_line()}"

    def counts_line(self) -> str:
        counts = self.deal.counts()
        speeds = ", ".join(f"{s:.3g}" for s in self.speeds) if self.speeds else "equal"
        return (f"micro-batches a step per rank {counts} of {self.world * self.accumulation} (speeds {speeds}; "
                f"predicted step {self._gain():.2f}x the equal split's speed)")

    def _gain(self) -> float:
        if not self.speeds:
            return 1.0
        return Deal.equal(self.world, self.accumulation).step_time(self.speeds) / self.deal.step_time(self.speeds)

    # ---- the loop
    def start_step(self, step: int) -> None:
        self._step = step

    @property
    def rank_weight(self) -> float:
        """This rank's micro-batches a step against the equal split's (comm/mode.py's `balance`)."""
        return self.deal.counts()[self.rank] / self.accumulation

    @contextlib.contextmanager
    def forward(self):
        """Times the forward (this rank's compute, no collective), slowed where asked; untimed where
        nothing reads the time. On a GPU the time is a pair of CUDA events, read when a
        measurement sums them: no wait for the queue in the loop (the slow-down, a test's, waits)."""
        factor = self._slowdown()
        if not self.measuring and factor == 1.0:
            yield
            return
        if self.device.type == "cuda" and factor == 1.0:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((start, end))
            self._micro_batches += 1
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        if factor > 1:
            time.sleep((factor - 1) * seconds)
            seconds *= factor
        self._last_forward = seconds
        self._forward_s += seconds
        self._micro_batches += 1

    def after_backward(self) -> None:
        factor = self._slowdown()
        if factor > 1:
            time.sleep((factor - 1) * 2 * self._last_forward / factor)

    def _slowdown(self) -> float:
        factor, first, last = self._slow
        return factor if first <= self._step and (last is None or self._step <= last) else 1.0

    def after_step(self, step: int, unlogged) -> Deal | None:
        """At a step's end: a new deal when one is due (the same on every rank), else None."""
        if not self.measuring:
            return None
        self._steps += 1
        if self._steps < self.settings["measure_steps"]:
            return None
        if self._pending:
            self._pending[-1][1].synchronize()
            self._forward_s += sum(start.elapsed_time(end) for start, end in self._pending) / 1000
            self._pending = []
        rate = torch.tensor([self._micro_batches / max(self._forward_s, 1e-9)], dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(rate) for _ in range(self.world)]
        with unlogged():
            dist.all_gather(every, rate)
        measured = [float(r) for r in every]
        self._forward_s, self._micro_batches, self._steps = 0.0, 0, 0
        self._average = measured if self._average is None else [
            0.5 * old + 0.5 * new for old, new in zip(self._average, measured)]
        first = self.speeds is None
        if not first and not self.settings["redeal"]:
            return None
        speeds = [s / max(self._average) for s in self._average]
        candidate = Deal.from_counts(counts_for_speeds(speeds, self.accumulation), self.accumulation)
        if not first and candidate.step_time(speeds) > (1 - self.settings["redeal_gain"]) * self.deal.step_time(speeds):
            self.speeds = speeds  # what the current deal is judged by, kept
            return None
        if candidate == self.deal:
            self.speeds = speeds
            return None
        self.speeds, self.deal = speeds, candidate
        self.redeals += 1
        return candidate

    def metric_fields(self) -> dict:
        if not self.enabled:
            return {}
        return {"rank_share": self.deal.shares(), "balance_redeals": self.redeals}

    # ---- checkpoints
    def state_dict(self) -> dict:
        return {"owners": self.deal.as_list(), "speeds": self.speeds, "average": self._average,
                "redeals": self.redeals}

    def load_state_dict(self, state: dict | None) -> str | None:
        """The saved deal where this launch deals the same micro-batches (world size and
        accumulation) with the same setting; a line where it starts over instead."""
        if not self.enabled or not state:
            return None
        deal = Deal.of_list(state["owners"])
        if (deal.world, deal.accumulation) != (self.world, self.accumulation):
            return (f"balance: the checkpoint's deal was for {deal.world} ranks × {deal.accumulation} micro-batches; "
                    f"this launch starts from {self.describe_start()}")
        if self.settings.get("speeds") is not None:
            return None  # the config's speeds rule
        self.deal, self.speeds, self._average = deal, state["speeds"], state["average"]
        self.redeals = state.get("redeals", 0)
        return None

    def describe_start(self) -> str:
        return "the config's speeds" if self.settings.get("speeds") is not None else "the equal split, measuring"
