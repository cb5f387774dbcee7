"""Choosing the fine-tuning learning rate and length without looking at the dev set.

One lr does not fit every model: 5e-5, chosen for converged BERT-base, leaves a 2-layer model
that 20 CPU minutes pretrained where it started (a question-type task scored the majority
class in every seed), and the best rate of Google's small BERTs differs by size (Turc et al.
2019 pick from {3e-4, 1e-4, 5e-5, 3e-5}). Nor does one length: a pretrained model fine-tuned
to a training loss of 0.001 has lost what its frozen features knew, and early stopping is in
every peer's protocol (Dodge et al. 2020). So `--lr auto` tries a grid per arm (pretrained and
random init alike) and keeps the best:

- the grid spans 30x, shifted to larger rates for small models (`default_grid`), each rate at
  each length (`default_lengths`: a quarter, a half and all of the schedule), each pair a whole
  schedule;
- each pair fine-tunes once (the first seed) per split, for as many passes over the split's rows
  to fit as the pair's steps make over the whole training split (`fold_steps`), and is scored on
  the split's held rows:
  by default `folds` (K-fold cross-validation: every training row scored once, by a model that
  did not see it; stratified by label, the same rows for every arm and seed, drawn with a fixed
  generator), or one `held_out_slice`; ties go to the smaller rate, then the fewer steps;
- the chosen pair then fine-tunes every seed on the whole training split, scored on dev as a
  fixed --lr is. The dev set is read only there.

With 1,000 rows the slice is 100 rows, and one fine-tuning per rate scored on 100 rows ranked
the rates against the dev set's order often enough to move a result by 5 points (polarity,
random init: 0.71 held out at 1e-4 against 0.63 at 1e-3; on dev 66.8% against 72.4%;
benchmarks/RESULTS.md#recipe-mini-polarity): hence 3 folds by default. And a length is passes,
not steps: a fold fits on two thirds of the rows, so the same number of steps there is half as
many passes again as on the whole split, and a length chosen so and re-run as steps on all the
rows undertrains: random-init `mini` scored 65.9% on polarity's dev at the 100 steps its folds
chose against 68.9% at the 150 that make the folds' passes (benchmarks/RESULTS.md#domain-polarity).
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
    rates are larger, the same span shifted up (measured on the embedded tasks: RESULTS.md)."""
    if hidden_size >= 768:
        return [3e-5, 5e-5, 1e-4, 3e-4]
    return [3e-5, 1e-4, 3e-4, 1e-3]


def rows_by_label(labels: list[int]) -> dict[int, list[int]]:
    by_label: dict[int, list[int]] = defaultdict(list)
    for i, label in enumerate(labels):
        by_label[label].append(i)
    return by_label


def with_the_rest(n: int, held: list[int]) -> tuple[list[int], list[int]]:
    """(every row of range(n) not held, the held rows in order)."""
    held_set = set(held)
    return [i for i in range(n) if i not in held_set], sorted(held)


def held_out_slice(labels: list[int], fraction: float = SLICE_FRACTION) -> tuple[list[int], list[int]]:
    """(rows to fit, rows to score): about `fraction` of the training rows, at least SLICE_MIN
    and at most SLICE_MAX but never more than a quarter, taken from each label in proportion."""
    n = len(labels)
    size = min(max(round(fraction * n), SLICE_MIN), SLICE_MAX, n // 4)
    by_label = rows_by_label(labels)
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
    return with_the_rest(n, held)


def folds(labels: list[int], k: int) -> list[tuple[list[int], list[int]]]:
    """k (rows to fit, rows to score) pairs whose scored rows partition the training rows, each
    fold holding every label in proportion: each label's rows in one fixed shuffle, dealt to the
    folds in turn, the turn carried on from label to label so the folds' sizes differ by at most
    one."""
    by_label = rows_by_label(labels)
    rng = np.random.default_rng(SLICE_SEED)
    scored: list[list[int]] = [[] for _ in range(k)]
    turn = 0
    for label in sorted(by_label):
        for row in rng.permutation(by_label[label]).tolist():
            scored[turn % k].append(row)
            turn += 1
    return [with_the_rest(len(labels), held) for held in scored]


def choose(trials: dict):
    """The setting with the best held-out score; on a tie the smallest (the smaller rate; of
    (rate, steps) pairs the smaller rate, then the fewer steps)."""
    best = max(trials.values())
    return min(key for key, value in trials.items() if value == best)


def default_lengths(full: int) -> list[int]:
    """Early stopping's candidate lengths: a quarter, a half and all of the schedule's steps
    (`full`). A run of 1,000 rows at lr 1e-3 drives the training loss to 0.001 by its 200th step
    and a pretrained model's features with it (docs/evaluation.md); the shorter schedules keep a
    pretrained model nearer what it learnt, and the cross-validation says whether that pays."""
    return sorted({max(1, round(full / 4)), max(1, round(full / 2)), full})


def fold_steps(steps: int, fit_rows: int, train_rows: int) -> int:
    """The steps that take a split's `fit_rows` through as many passes as `steps` take the whole
    training split's `train_rows`."""
    return max(1, round(steps * fit_rows / train_rows))


def select(pretrained, task, train, hp, grid: list[float], lengths: list[int], seed: int, device,
           random_init: bool, progress: bool = True, name: str = "pretrained",
           splits: list[tuple[list[int], list[int]]] | None = None,
           finetune=None) -> tuple[float, int, dict[tuple[float, int], float]]:
    """(the chosen rate, the chosen steps, each pair's score): for each rate and each length
    (steps on the whole training split), one fine-tuning with `seed` per split on its rows to
    fit, a whole schedule (warm-up and linear decay to 0 at its end) of the same passes over
    them (`fold_steps`), scored on the split's held rows, the
    scores averaged over the splits. The chosen pair then fine-tunes every seed as exactly that
    schedule, so what is reported is what was scored. `train` is the task's encoded training
    split; nothing of the dev split is passed in. `splits`: the held-out slice alone
    (held_out_slice) or `folds`. `finetune`: the task family's (families.FAMILIES; default: the
    classifier's)."""
    from dataclasses import replace

    from commodity_bert.finetune import trainer
    finetune = finetune or trainer.finetune
    splits = splits or [held_out_slice(train.labels)]
    parts = [(train.subset(fit_rows), train.subset(held_rows)) for fit_rows, held_rows in splits]
    trials = {}
    for rate in grid:
        for steps in lengths:
            scores = [finetune(pretrained, task, fit, held, seed,
                               replace(hp, lr=rate, steps=fold_steps(steps, len(fit), len(train))), device,
                               random_init, progress,
                               label=f"{name} lr {rate:g}" + (f" {steps} steps" if len(lengths) > 1 else "") +
                               (f" fold {k + 1}" if len(parts) > 1 else ""))["value"]
                      for k, (fit, held) in enumerate(parts)]
            trials[(rate, steps)] = round(sum(scores) / len(scores), 6)
    rate, steps = choose(trials)
    return rate, steps, trials


def select_lr(pretrained, task, train, hp, grid: list[float], seed: int, device, random_init: bool,
              progress: bool = True, name: str = "pretrained",
              splits: list[tuple[list[int], list[int]]] | None = None,
              finetune=None) -> tuple[float, dict[float, float]]:
    """The rate alone, at the schedule's own length (`select` with one length)."""
    from commodity_bert.finetune import trainer
    full = trainer.total_steps(len(train.input_ids), hp)
    rate, _, trials = select(pretrained, task, train, hp, grid, [full], seed, device, random_init, progress, name,
                             splits, finetune)
    return rate, {lr: value for (lr, _), value in trials.items()}
