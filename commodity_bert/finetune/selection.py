"""Choosing the fine-tuning learning rate without looking at the dev set.

One lr does not fit every model: 5e-5, chosen for converged BERT-base, leaves a 2-layer model
that 20 CPU minutes pretrained where it started (a question-type task scored the majority
class in every seed), and the best rate of Google's small BERTs differs by size (Turc et al.
2019 pick from {3e-4, 1e-4, 5e-5, 3e-5}). So `--lr auto` tries a grid per arm (pretrained and
random init alike) and keeps the best:

- the grid spans 30x, shifted to larger rates for small models (`default_grid`);
- each rate fine-tunes once (the first seed) on the training split less a held-out slice, and
  is scored on that slice (`held_out_slice`: stratified by label, the same rows for every arm
  and seed, drawn with a fixed generator); ties go to the smaller rate;
- the chosen rate then fine-tunes every seed on the whole training split, scored on dev as a
  fixed --lr is. The dev set is read only there.
"""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

SLICE_FRACTION = 0.1
SLICE_MIN, SLICE_MAX = 50, 2000  # examples: a slice below ~50 cannot tell rates apart; 2,000 is plenty
SLICE_SEED = 20201  # not a fine-tuning seed: the slice is the same whatever --seeds says


def default_grid(hidden_size: int) -> list[float]:
    """Turc et al.'s grid for BERT-base and larger; for small models (hidden < 768), whose best
    rates are larger, the same span shifted up (issue 30's measurements: RESULTS.md)."""
    if hidden_size >= 768:
        return [3e-5, 5e-5, 1e-4, 3e-4]
    return [3e-5, 1e-4, 3e-4, 1e-3]


def held_out_slice(labels: list[int], fraction: float = SLICE_FRACTION) -> tuple[list[int], list[int]]:
    """(rows to fit, rows to score): about `fraction` of the training rows, at least SLICE_MIN
    and at most SLICE_MAX but never more than a quarter, taken from each label in proportion."""
    n = len(labels)
    size = min(max(round(fraction * n), SLICE_MIN), SLICE_MAX, n // 4)
    by_label: dict[int, list[int]] = defaultdict(list)
    for i, label in enumerate(labels):
        by_label[label].append(i)
    order = sorted(by_label)
    # largest remainders: the label counts add up to `size`, each in proportion to its share
    shares = [size * len(by_label[label]) / n for label in order]
    takes = [math.floor(share) for share in shares]
    for k in sorted(range(len(order)), key=lambda k: takes[k] - shares[k])[:size - sum(takes)]:
        takes[k] += 1
    rng = np.random.default_rng(SLICE_SEED)
    held: list[int] = []
    for label, take in zip(order, takes):
        rows = by_label[label]
        take = min(len(rows) - 1, take)  # each label keeps a training row
        held += rng.choice(rows, size=max(take, 0), replace=False).tolist()
    held_set = set(held)
    return [i for i in range(n) if i not in held_set], sorted(held)


def choose(trials: dict[float, float]) -> float:
    """The rate with the best held-out score; on a tie the smaller rate."""
    best = max(trials.values())
    return min(lr for lr, value in trials.items() if value == best)


def select_lr(pretrained, task, train, hp, grid: list[float], seed: int, device, random_init: bool,
              progress: bool = True, name: str = "pretrained",
              split: tuple[list[int], list[int]] | None = None) -> tuple[float, dict[float, float]]:
    """(the chosen rate, each rate's score on the held-out slice): one fine-tuning per rate,
    with `seed`, on the training rows outside the slice. `train` is the task's encoded
    training split; nothing of the dev split is passed in. `split`: held_out_slice's result,
    where the caller has it already."""
    from dataclasses import replace

    from commodity_bert.finetune import trainer
    fit_rows, held_rows = split or held_out_slice(train.labels)
    fit, held = train.subset(fit_rows), train.subset(held_rows)
    trials = {rate: trainer.finetune(pretrained, task, fit, held, seed, replace(hp, lr=rate), device, random_init,
                                     progress, label=f"{name} lr {rate:g}")["value"] for rate in grid}
    return choose(trials), trials
