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
