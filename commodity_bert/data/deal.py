"""Who trains which micro-batch of a step, so that ranks of unequal speed finish together.

A step is W·a micro-batches: the first a micro-batches of each rank's stream of the equal split
(`loader.StreamPlan`; call rank u's stream "unit u"). A `Deal` says which rank trains each of
them. The equal split trains unit u on rank u. A balanced deal keeps every micro-batch, its
samples, its masks and its place in the step, and moves only who trains it: a rank owns a
number of micro-batches in proportion to its speed, so the step's gradient is the equal
split's (each micro-batch's loss is still divided by a, and the allreduce still averages over
W: Σ over the step's W·a micro-batches / (W·a), whoever computed them), and the data order,
the checkpoints' loader position and the epoch are the equal split's, whatever the deal.

Why micro-batches and not per-rank batch sizes (the way HetSeq, LB-BSP and users' own loops
do it, with the loss weighted by each rank's share): a micro-batch of one size keeps the
memory model (`bert-plan fit`), the length-stratified batches and DeepSpeed's own averaging
exact, and a re-deal at any step boundary is a new owner map, with nothing to re-shuffle.
The price: a share is a whole number of micro-batches (the finer, the larger a), and a rank
that trains another's micro-batches also reads that rank's shards.

Each rank keeps the last micro-batches of its own unit and gives the first ones away: every
rank's last micro-batch of a step is then the step's last of its own unit, so its loader
stands at the step's end when the step ends (where checkpoints are written).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


class DealError(ValueError):
    """Shares that cannot be dealt; the message is the one line to print."""


def counts_for_speeds(speeds: list[float], accumulation: int, caps: list[int] | None = None) -> list[int]:
    """Micro-batches a step per rank, W·a in all, at least one each (every rank takes part in the
    step's exchange) and at most `caps[r]` (what fits its card), that minimise the slowest rank's
    time, max(n_r / speed_r): one at a time to the rank that would finish soonest with it."""
    world, total = len(speeds), len(speeds) * accumulation
    if any(not s > 0 for s in speeds):
        raise DealError(f"speeds {speeds}: each must be above 0")
    caps = list(caps) if caps is not None else [total] * world
    if sum(caps) < total or min(caps) < 1:
        raise DealError(f"the ranks fit {caps} micro-batches a step, {sum(caps)} in all, below the step's "
                        f"{total}; use a smaller micro-batch or more accumulation")
    counts = [1] * world
    for _ in range(total - world):
        open_ranks = [r for r in range(world) if counts[r] < caps[r]]
        chosen = min(open_ranks, key=lambda r: ((counts[r] + 1) / speeds[r], r))
        counts[chosen] += 1
    return counts


@dataclass(frozen=True)
class Deal:
    """`owners[u][i]`: the rank that trains micro-batch i (< a) of unit u in every step."""
    owners: tuple[tuple[int, ...], ...]

    @classmethod
    def equal(cls, world: int, accumulation: int) -> Deal:
        return cls(tuple((u,) * accumulation for u in range(world)))

    @classmethod
    def from_counts(cls, counts: list[int], accumulation: int) -> Deal:
        """Rank r trains counts[r] micro-batches a step: the last min(n_r, a) of its own unit, and
        the rest from the first micro-batches of the units whose ranks train fewer than a."""
        world = len(counts)
        if sum(counts) != world * accumulation or min(counts) < 1:
            raise DealError(f"micro-batch counts {counts} must be at least 1 each and add up to "
                            f"{world} ranks × accumulation {accumulation}")
        owners = [[u] * accumulation for u in range(world)]
        given = [(u, i) for u in range(world) for i in range(accumulation - counts[u])]
        takers = [r for r in range(world) for _ in range(counts[r] - accumulation)]
        for (u, i), r in zip(given, takers):
            owners[u][i] = r
        return cls(tuple(tuple(row) for row in owners))

    @classmethod
    def from_speeds(cls, speeds: list[float], accumulation: int, caps: list[int] | None = None) -> Deal:
        return cls.from_counts(counts_for_speeds(speeds, accumulation, caps), accumulation)

    @property
    def world(self) -> int:
        return len(self.owners)

    @property
    def accumulation(self) -> int:
        return len(self.owners[0])

    @cached_property
    def _counts(self) -> tuple[int, ...]:  # read every step (the loop's share, the metrics)
        flat = [r for row in self.owners for r in row]
        return tuple(flat.count(r) for r in range(self.world))

    def counts(self) -> list[int]:
        """Micro-batches a step each rank trains."""
        return list(self._counts)

    def shares(self) -> list[float]:
        """Each rank's part of the global batch."""
        total = self.world * self.accumulation
        return [n / total for n in self.counts()]

    def is_equal(self) -> bool:
        return all(r == u for u, row in enumerate(self.owners) for r in row)

    def taken(self, rank: int) -> list[tuple[int, int, int]]:
        """(unit, first, end) for each unit of which `rank` trains micro-batches first..end-1 (one
        run per unit), its own unit last."""
        runs = []
        for unit, row in enumerate(self.owners):
            mine = [i for i, r in enumerate(row) if r == rank]
            if mine:
                if mine != list(range(mine[0], mine[-1] + 1)):
                    raise DealError(f"rank {rank} trains micro-batches {mine} of rank {unit}'s: not one run")
                runs.append((unit, mine[0], mine[-1] + 1))
        return sorted(runs, key=lambda run: run[0] == rank)

    def step_time(self, speeds: list[float]) -> float:
        """The step's compute time in units of one micro-batch on a speed-1 rank: the slowest rank's."""
        return max(n / s for n, s in zip(self.counts(), speeds))

    def as_list(self) -> list[list[int]]:
        return [list(row) for row in self.owners]

    @classmethod
    def of_list(cls, owners: list[list[int]]) -> Deal:
        return cls(tuple(tuple(int(r) for r in row) for row in owners))
