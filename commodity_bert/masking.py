"""Masked-LM masking as in BERT: choose ~15% of a sequence's tokens (optionally whole words),
replace 80% of them with [MASK], 10% with a random token, keep 10%."""
from __future__ import annotations

import numpy as np


def mask_sequence(tokens: np.ndarray, *, rng: np.random.Generator, mask_prob: float,
                  max_predictions: int, mask_id: int, special_ids: np.ndarray,
                  replacement_ids: np.ndarray, continuation: np.ndarray | None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mask one sequence. Returns (masked tokens, positions, original ids); positions sorted.

    `continuation[id]` marks '##' pieces; when given, a word and its pieces are masked together
    (whole-word masking) and a word that would overshoot the budget is skipped, as in BERT.
    """
    n = len(tokens)
    candidates = np.flatnonzero(~np.isin(tokens, special_ids))
    num_to_predict = min(max_predictions, max(1, int(round(n * mask_prob))))
    if continuation is not None and len(candidates):
        starts = ~continuation[tokens[candidates]]
        starts[0] = True
        # a group restarts wherever the candidate run is broken by a special token
        starts[1:] |= np.diff(candidates) != 1
        groups = np.split(candidates, np.flatnonzero(starts)[1:])
    else:
        groups = [candidates[i:i + 1] for i in range(len(candidates))]
    chosen: list[int] = []
    for g in rng.permutation(len(groups)):
        if len(chosen) >= num_to_predict:
            break
        group = groups[g]
        if len(chosen) + len(group) > num_to_predict:
            continue
        chosen.extend(group.tolist())
    positions = np.sort(np.asarray(chosen, dtype=np.int64))
    originals = tokens[positions].copy()
    masked = tokens.copy()
    draw = rng.random(len(positions))
    to_mask = draw < 0.8
    to_random = draw >= 0.9
    masked[positions[to_mask]] = mask_id
    masked[positions[to_random]] = replacement_ids[rng.integers(0, len(replacement_ids), int(to_random.sum()))]
    return masked, positions, originals
