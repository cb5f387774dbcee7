"""Training instances from tokenized documents, as in Google's BERT
`create_pretraining_data.py`, with two changes: the short-sequence target length is drawn per
instance (not once per document, which on corpora of whole speeches made entire documents
short), and the random next segment comes from another document of the same batch (the corpus
is streamed, never held in memory).

Two layouts:
- NSP pairs: [CLS] A [SEP] B [SEP]; B is the true continuation or, with probability 1/2, a
  segment from another document (label 1).
- Full-sentence packing (no NSP): [CLS] sentences... [SEP], packed up to the target length.

Why ranges: a batch's tokens are one array (`TokenPool`), and every segment an instance takes
(A, B, or a packed chunk) is a contiguous run of it. Building an instance is therefore a few
integer draws and one row of (A start, A length, B start, B length, label); `token_rows` turns
all of a batch's rows into the padded token matrix in one numpy gather. The draws come from
Python's `random.Random` (Mersenne Twister, as Google's script uses), whose scalar calls cost
a tenth of numpy's: instance building was the largest stage of data preparation.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class InstanceSpec:
    seq_len: int
    short_seq_prob: float
    cls_id: int
    sep_id: int


@dataclass
class TokenPool:
    """Token ids of many documents as one array, and each document's sentence bounds in it:
    sentence k of document d is tokens[bounds[d][k]:bounds[d][k + 1]]."""
    tokens: np.ndarray
    bounds: list[list[int]]

    @classmethod
    def of(cls, documents: list[list[np.ndarray]]) -> TokenPool:
        """From documents given as lists of sentence arrays (tests, small inputs)."""
        bounds, offset = [], 0
        for sentences in documents:
            doc = [offset]
            for s in sentences:
                offset += len(s)
                doc.append(offset)
            bounds.append(doc)
        parts = [s for sentences in documents for s in sentences]
        tokens = np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, dtype=np.int32)
        return cls(tokens, bounds)

    def subset(self, documents: list[int]) -> TokenPool:
        """The same tokens; only the documents listed (no copy)."""
        return TokenPool(self.tokens, [self.bounds[d] for d in documents])


# one row per instance: A's start and length, B's start and length (0 without NSP), the label
Row = tuple[int, int, int, int, int]


def instance_rng(seed: int, document: int, dupe: int) -> random.Random:
    """The generator of one (document, dupe): the same whichever worker builds it."""
    return random.Random(f"{seed}:{document}:{dupe}")


def _target_length(rng: random.Random, max_tokens: int, short_seq_prob: float) -> int:
    if rng.random() < short_seq_prob:
        return 2 + int(rng.random() * (max_tokens - 1))
    return max_tokens


def _truncate_pair(a_start: int, a_len: int, b_start: int, b_len: int, max_tokens: int,
                   rng: random.Random) -> tuple[int, int, int, int]:
    """Trim the pair to max_tokens as BERT does token by token (always from the longer segment,
    B when equal; each token from the front or the back at random), in closed form."""
    excess = a_len + b_len - max_tokens
    if excess <= 0:
        return a_start, a_len, b_start, b_len
    first = min(excess, abs(a_len - b_len))  # the longer shrinks to the shorter's length
    rest = excess - first                    # then they shrink in turn, B first
    cut_a = (first if a_len > b_len else 0) + rest // 2
    cut_b = (first if b_len >= a_len else 0) + rest - rest // 2
    if cut_a:  # tokens cut from the front: Binomial(cut, 1/2), as BERT's coin per token
        a_start += rng.getrandbits(cut_a).bit_count()
        a_len -= cut_a
    if cut_b:
        b_start += rng.getrandbits(cut_b).bit_count()
        b_len -= cut_b
    return a_start, a_len, b_start, b_len


def nsp_instances(pool: TokenPool, own: int, spec: InstanceSpec, rng: random.Random,
                  out: list[Row]) -> None:
    """Appends to `out` the pairs of document `own`; random next segments come from the pool's
    other documents (from `own` itself if it is alone)."""
    bounds = pool.bounds[own]
    sentences = len(bounds) - 1
    others = len(pool.bounds) - 1
    max_tokens = spec.seq_len - 3
    uniform = rng.random  # int(uniform() * n), not randrange(n): 3x cheaper, bias below 2^-30
    first = 0  # the chunk is sentences first..i
    target = _target_length(rng, max_tokens, spec.short_seq_prob)
    i = 0
    while i < sentences:
        if i == sentences - 1 or bounds[i + 1] - bounds[first] >= target:
            chunk = i + 1 - first
            a_end = 1 + int(uniform() * (chunk - 1)) if chunk >= 2 else 1
            a_start, a_len = bounds[first], bounds[first + a_end] - bounds[first]
            if chunk == 1 or uniform() < 0.5:
                random_next = 1
                if others:
                    pick = int(uniform() * others)
                    source = pool.bounds[pick + (pick >= own)]
                else:
                    source = bounds
                start = int(uniform() * (len(source) - 1))
                need, end = target - a_len, start + 1
                while end < len(source) - 1 and source[end] - source[start] < need:
                    end += 1
                b_start, b_len = source[start], source[end] - source[start]
                i -= chunk - a_end  # the unused sentences start the next instance
            else:
                random_next = 0
                b_start, b_len = bounds[first + a_end], bounds[i + 1] - bounds[first + a_end]
            a_start, a_len, b_start, b_len = _truncate_pair(a_start, a_len, b_start, b_len, max_tokens, rng)
            if a_len and b_len:
                out.append((a_start, a_len, b_start, b_len, random_next))
            first = i + 1
            target = _target_length(rng, max_tokens, spec.short_seq_prob)
        i += 1


def packed_instances(pool: TokenPool, own: int, spec: InstanceSpec, rng: random.Random,
                     out: list[Row]) -> None:
    """Appends to `out` document `own` packed in chunks of whole sentences up to the target
    length; a sentence longer than the target is split. Chunks are contiguous: A is the chunk."""
    bounds = pool.bounds[own]
    max_tokens = spec.seq_len - 2
    target = _target_length(rng, max_tokens, spec.short_seq_prob)
    position = chunk_start = bounds[0]
    for end in bounds[1:]:
        while position < end:  # the rest of this sentence is position..end
            if position - chunk_start + end - position <= target:
                position = end
                continue
            if position == chunk_start:  # one sentence longer than the target: split it
                position += target
            out.append((chunk_start, position - chunk_start, 0, 0, 0))
            chunk_start = position
            target = _target_length(rng, max_tokens, spec.short_seq_prob)
    if position > chunk_start:
        out.append((chunk_start, position - chunk_start, 0, 0, 0))


def _copy_ranges(source: np.ndarray, starts: np.ndarray, lengths: np.ndarray, destination: np.ndarray,
                 at: np.ndarray) -> None:
    """destination[at[k]:at[k] + lengths[k]] = source[starts[k]:starts[k] + lengths[k]] for every k."""
    before = np.cumsum(lengths) - lengths
    offsets = np.arange(int(lengths.sum()), dtype=np.int64)
    destination[np.repeat(at - before, lengths) + offsets] = source[np.repeat(starts - before, lengths) + offsets]


def token_rows(pool: TokenPool, rows: list[Row], spec: InstanceSpec, nsp: bool
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """All instances at once: (tokens [n, seq_len] zero-padded, lengths, segment A's length with
    its [CLS] and [SEP] (the whole length without NSP), random-next labels)."""
    table = np.array(rows, dtype=np.int64).reshape(-1, 5)
    a_start, a_len, b_start, b_len, random_next = table.T
    lengths = a_len + b_len + (3 if nsp else 2)
    row_at = np.arange(len(table), dtype=np.int64) * spec.seq_len
    tokens = np.zeros((len(table), spec.seq_len), dtype=np.int64)
    flat = tokens.reshape(-1)
    flat[row_at] = spec.cls_id
    _copy_ranges(pool.tokens, a_start, a_len, flat, row_at + 1)
    flat[row_at + a_len + 1] = spec.sep_id
    if nsp:
        _copy_ranges(pool.tokens, b_start, b_len, flat, row_at + a_len + 2)
        flat[row_at + lengths - 1] = spec.sep_id
    segment_a = a_len + 2 if nsp else lengths
    return tokens, lengths, segment_a, random_next
