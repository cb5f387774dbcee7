"""Masked-LM masking as in BERT: choose ~15% of a sequence's tokens (optionally whole words),
replace 80% of them with [MASK], 10% with a random token, keep 10%."""
from __future__ import annotations

import numpy as np


def mask_sequence(tokens: np.ndarray, *, rng: np.random.Generator, mask_prob: float,
                  max_predictions: int, mask_id: int, is_special: np.ndarray,
                  replacement_ids: np.ndarray, continuation: np.ndarray | None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mask one sequence. Returns (masked tokens, positions, original ids); positions sorted.

    `is_special[id]` marks tokens never masked ([CLS], [SEP], ...). `continuation[id]` marks
    '##' pieces; when given, a word and its pieces are masked together (whole-word masking)
    and a word that would overshoot the budget is skipped, as in BERT.
    """
    n = len(tokens)
    candidates = np.flatnonzero(~is_special[tokens])
    num_to_predict = min(max_predictions, max(1, round(n * mask_prob)), len(candidates))
    if continuation is None:
        positions = np.sort(candidates[rng.permutation(len(candidates))[:num_to_predict]])
    else:
        starts = ~continuation[tokens[candidates]]
        if len(candidates):
            starts[0] = True
            # a word also restarts wherever a special token breaks the run of candidates
            starts[1:] |= np.diff(candidates) != 1
        groups = np.split(candidates, np.flatnonzero(starts)[1:]) if len(candidates) else []
        chosen: list[np.ndarray] = []
        have = 0
        for g in rng.permutation(len(groups)):
            if have >= num_to_predict:
                break
            if have + len(groups[g]) <= num_to_predict:
                chosen.append(groups[g])
                have += len(groups[g])
        positions = np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)
    originals = tokens[positions].copy()
    masked = tokens.copy()
    draw = rng.random(len(positions))
    masked[positions[draw < 0.8]] = mask_id
    to_random = positions[draw >= 0.9]
    masked[to_random] = replacement_ids[rng.integers(0, len(replacement_ids), len(to_random))]
    return masked, positions, originals


def mask_rows(tokens: np.ndarray, lengths: np.ndarray, *, rng: np.random.Generator, mask_prob: float,
              max_predictions: int, mask_id: int, is_special: np.ndarray, replacement_ids: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`mask_sequence` (without whole-word masking) for every row of a padded [n, L] matrix at
    once, in numpy: the same rule and the same 80/10/10 split, drawn from one generator.
    Returns (masked tokens [n, L], positions [n, max_predictions], original ids [n,
    max_predictions]); positions are sorted per row and padded with 0, ids with 0."""
    n, width = tokens.shape
    real = np.arange(width)[None, :] < lengths[:, None]
    candidates = real & ~is_special[tokens]
    num_to_predict = np.minimum(np.minimum(max_predictions, np.maximum(1, np.round(lengths * mask_prob))),
                                candidates.sum(axis=1)).astype(np.int64)
    keys = rng.random((n, width))
    keys[~candidates] = 2.0  # after every candidate: a random order of the candidates comes first
    # the max_predictions smallest keys of each row, then in key order (a partition, not a sort
    # of all `width`); a row takes the first num_to_predict of them
    take = min(max_predictions, width)
    first = np.argpartition(keys, take - 1, axis=1)[:, :take] if take < width else np.arange(width)[None, :].repeat(n, 0)
    first = np.take_along_axis(first, np.argsort(np.take_along_axis(keys, first, axis=1), axis=1), axis=1)
    chosen = np.arange(first.shape[1])[None, :] < num_to_predict[:, None]
    positions = np.sort(np.where(chosen, first, width), axis=1)
    taken = positions < width
    rows, cols = np.nonzero(taken)
    where = positions[taken]
    masked = tokens.copy()
    draw = rng.random(len(where))
    masked[rows[draw < 0.8], where[draw < 0.8]] = mask_id
    to_random = draw >= 0.9
    masked[rows[to_random], where[to_random]] = replacement_ids[
        rng.integers(0, len(replacement_ids), int(to_random.sum()))]
    out_positions = np.zeros((n, max_predictions), dtype=np.int64)
    out_ids = np.zeros((n, max_predictions), dtype=tokens.dtype)
    out_positions[rows, cols] = where
    out_ids[rows, cols] = tokens[rows, where]
    return masked, out_positions, out_ids
