"""Masked-LM masking as in BERT: choose ~15% of a sequence's tokens (optionally whole words),
replace 80% of them with [MASK], 10% with a random token, keep 10%. Always a matrix of rows at
once (numpy, one generator): `bert-data-prep` masks its static shards so, and the training
loader a whole batch of dynamic shards, as fast as a GPU takes them (benchmarks/loader_speed.py)."""
from __future__ import annotations

import numpy as np

MASK_PROB = 0.15  # BERT's rate: bert-data-prep's default, and the rate of shards whose manifest does not say



def select_rows(tokens: np.ndarray, lengths: np.ndarray, *, rng: np.random.Generator, mask_prob: float,
                max_predictions: int, is_special: np.ndarray, continuation: np.ndarray | None = None) -> np.ndarray:
    """Which tokens of a padded [n, L] matrix to predict, all rows at once: a bool matrix with
    min(max_predictions, round(length * mask_prob) or 1, candidates) tokens a row, drawn at random
    among the candidates (`is_special[id]` marks tokens never masked: [CLS], [SEP], ...; padding
    is never one). With `continuation` (`continuation[id]` marks '##' pieces), whole words: a word
    (a piece and the '##' pieces after it; a special token also ends one) is taken whole, in a
    random order of the words, and a word that would overshoot the budget is skipped, as in
    BERT; the greedy pass runs over word ranks for all rows at once, not row by row."""
    n, width = tokens.shape
    real = np.arange(width)[None, :] < lengths[:, None]
    candidates = real & ~is_special[tokens]
    num_to_predict = np.minimum(np.minimum(max_predictions, np.maximum(1, np.round(lengths * mask_prob))),
                                candidates.sum(axis=1)).astype(np.int64)
    if continuation is None:
        keys = rng.random((n, width))
        keys[~candidates] = 2.0  # after every candidate: a random order of the candidates comes first
        # the max_predictions smallest keys of each row, then in key order (a partition, not a sort
        # of all `width`); a row takes the first num_to_predict of them
        take = min(max_predictions, width)
        first = (np.argpartition(keys, take - 1, axis=1)[:, :take] if take < width
                 else np.arange(width)[None, :].repeat(n, 0))
        first = np.take_along_axis(first, np.argsort(np.take_along_axis(keys, first, axis=1), axis=1), axis=1)
        chosen = np.arange(first.shape[1])[None, :] < num_to_predict[:, None]
        selected = np.zeros((n, width), dtype=bool)
        np.put_along_axis(selected, first, chosen, axis=1)
        return selected
    # a word starts at a candidate that is no '##' piece or follows a non-candidate
    after_gap = np.ones((n, width), dtype=bool)
    after_gap[:, 1:] = ~candidates[:, :-1]
    starts = candidates & (~continuation[tokens] | after_gap)
    word = np.cumsum(starts, axis=1) - 1  # word number of each candidate within its row
    rows = np.nonzero(candidates)[0]
    word_len = np.bincount(rows * width + word[candidates], minlength=n * width).reshape(n, width)
    keys = rng.random((n, width))
    keys[word_len == 0] = 2.0  # word numbers past a row's words come last
    order = np.argsort(keys, axis=1)
    ranked_len = np.take_along_axis(word_len, order, axis=1)
    taken = np.zeros((n, width), dtype=bool)
    have = np.zeros(n, dtype=np.int64)
    for rank in range(int(starts.sum(axis=1).max(initial=0))):
        size = ranked_len[:, rank]
        fits = (size > 0) & (have + size <= num_to_predict)
        taken[:, rank] = fits
        have += np.where(fits, size, 0)
        if rank % 8 == 7 and np.array_equal(have, num_to_predict):  # every row's budget spent
            break
    word_taken = np.zeros((n, width), dtype=bool)
    np.put_along_axis(word_taken, order, taken, axis=1)
    selected = np.zeros((n, width), dtype=bool)
    selected[candidates] = word_taken[rows, word[candidates]]
    return selected


def mask_selected(tokens: np.ndarray, selected: np.ndarray, *, rng: np.random.Generator, mask_id: int,
                  replacement_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """BERT's 80/10/10 on the `selected` tokens of [n, L]: [MASK], a random token, or kept.
    Returns (masked tokens, rows, columns) of the selected tokens in row-major order."""
    rows, cols = np.nonzero(selected)
    masked = tokens.copy()
    draw = rng.random(len(rows))
    masked[rows[draw < 0.8], cols[draw < 0.8]] = mask_id
    to_random = draw >= 0.9
    masked[rows[to_random], cols[to_random]] = replacement_ids[
        rng.integers(0, len(replacement_ids), int(to_random.sum()))]
    return masked, rows, cols


def mask_rows(tokens: np.ndarray, lengths: np.ndarray, *, rng: np.random.Generator, mask_prob: float,
              max_predictions: int, mask_id: int, is_special: np.ndarray, replacement_ids: np.ndarray,
              continuation: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Masked-LM masking of every row of a padded [n, L] matrix at once, in numpy: the tokens
    `select_rows` chooses (whole words with `continuation`), then `mask_selected`'s 80/10/10,
    drawn from one generator. Returns (masked tokens [n, L], positions [n, max_predictions],
    original ids [n, max_predictions]); positions are sorted per row and padded with 0, ids with 0."""
    selected = select_rows(tokens, lengths, rng=rng, mask_prob=mask_prob, max_predictions=max_predictions,
                           is_special=is_special, continuation=continuation)
    masked, rows, where = mask_selected(tokens, selected, rng=rng, mask_id=mask_id, replacement_ids=replacement_ids)
    cols = np.arange(len(rows)) - np.searchsorted(rows, rows)  # rank of each within its row
    out_positions = np.zeros((len(tokens), max_predictions), dtype=np.int64)
    out_ids = np.zeros((len(tokens), max_predictions), dtype=tokens.dtype)
    out_positions[rows, cols] = where
    out_ids[rows, cols] = tokens[rows, where]
    return masked, out_positions, out_ids
