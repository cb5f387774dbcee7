"""Training instances from tokenized documents, as in Google's BERT
`create_pretraining_data.py`, with two changes: the short-sequence target length is drawn per
instance (not once per document, which on corpora of whole speeches made entire documents
short), and the random next segment comes from another document of the same batch (the corpus
is streamed, never held in memory).

Two layouts:
- NSP pairs: [CLS] A [SEP] B [SEP]; B is the true continuation or, with probability 1/2, a
  segment from another document (label 1).
- Full-sentence packing (no NSP): [CLS] sentences... [SEP], packed up to the target length.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class InstanceSpec:
    seq_len: int
    short_seq_prob: float
    cls_id: int
    sep_id: int


@dataclass
class Instance:
    tokens: np.ndarray     # real tokens only, specials included
    segment_a: int         # tokens before B starts ([CLS] A [SEP]); = length without NSP
    random_next: int


def _target_length(rng: np.random.Generator, max_tokens: int, short_seq_prob: float) -> int:
    if rng.random() < short_seq_prob:
        return int(rng.integers(2, max_tokens + 1))
    return max_tokens


def _truncate_pair(a: np.ndarray, b: np.ndarray, max_tokens: int, rng: np.random.Generator):
    """Trim the pair to max_tokens as BERT does token by token (always from the longer segment,
    B when equal; each token from the front or the back at random), in closed form."""
    excess = len(a) + len(b) - max_tokens
    if excess <= 0:
        return a, b
    first = min(excess, abs(len(a) - len(b)))  # the longer shrinks to the shorter's length
    rest = excess - first                      # then they shrink in turn, B first
    cut_a = (first if len(a) > len(b) else 0) + rest // 2
    cut_b = (first if len(b) >= len(a) else 0) + rest - rest // 2

    def trim(segment, cut):
        front = int(rng.binomial(cut, 0.5)) if cut else 0
        return segment[front:len(segment) - (cut - front)]
    return trim(a, cut_a), trim(b, cut_b)


@dataclass
class FlatDocument:
    """A tokenized document as one array and its sentence bounds: segments are slices of it, so
    building an instance copies tokens once instead of concatenating sentences."""
    tokens: np.ndarray
    bounds: list[int]  # sentence k is tokens[bounds[k]:bounds[k + 1]]

    @classmethod
    def of(cls, sentences: list[np.ndarray]) -> FlatDocument:
        lengths = [len(s) for s in sentences]
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        tokens = np.concatenate(sentences) if sentences else np.zeros(0, dtype=np.int32)
        return cls(tokens, bounds)

    def __len__(self) -> int:  # sentences
        return len(self.bounds) - 1


def _random_other(pool: list, own: int, rng: np.random.Generator):
    """A random document of `pool` other than pool[own] (the document itself if alone)."""
    if len(pool) < 2:
        return pool[own]
    pick = int(rng.integers(len(pool) - 1))
    return pool[pick + (pick >= own)]


def nsp_instances(pool: list[FlatDocument], own: int, spec: InstanceSpec,
                  rng: np.random.Generator) -> list[Instance]:
    """Pairs from document pool[own]; random next segments come from the pool's others."""
    document = pool[own]
    bounds, sentences = document.bounds, len(document)
    max_tokens = spec.seq_len - 3
    instances: list[Instance] = []
    first = 0  # the chunk is sentences first..i
    target = _target_length(rng, max_tokens, spec.short_seq_prob)
    i = 0
    while i < sentences:
        chunk_len = bounds[i + 1] - bounds[first]
        if i == sentences - 1 or chunk_len >= target:
            chunk = i + 1 - first
            a_end = int(rng.integers(1, chunk)) if chunk >= 2 else 1
            tokens_a = document.tokens[bounds[first]:bounds[first + a_end]]
            if chunk == 1 or rng.random() < 0.5:
                random_next = 1
                source = _random_other(pool, own, rng)
                start = int(rng.integers(len(source)))
                need, end = target - len(tokens_a), start + 1
                while end < len(source) and source.bounds[end] - source.bounds[start] < need:
                    end += 1
                tokens_b = source.tokens[source.bounds[start]:source.bounds[end]]
                i -= chunk - a_end  # the unused sentences start the next instance
            else:
                random_next = 0
                tokens_b = document.tokens[bounds[first + a_end]:bounds[i + 1]]
            tokens_a, tokens_b = _truncate_pair(tokens_a, tokens_b, max_tokens, rng)
            if len(tokens_a) and len(tokens_b):
                tokens = np.concatenate(([spec.cls_id], tokens_a, [spec.sep_id], tokens_b, [spec.sep_id]))
                instances.append(Instance(tokens, len(tokens_a) + 2, random_next))
            first = i + 1
            target = _target_length(rng, max_tokens, spec.short_seq_prob)
        i += 1
    return instances


def packed_instances(document: list[np.ndarray], spec: InstanceSpec,
                     rng: np.random.Generator) -> list[Instance]:
    max_tokens = spec.seq_len - 2
    instances: list[Instance] = []
    chunk: list[np.ndarray] = []
    chunk_len = 0
    target = _target_length(rng, max_tokens, spec.short_seq_prob)

    def emit():
        nonlocal chunk, chunk_len, target
        tokens = np.concatenate(([spec.cls_id], *chunk, [spec.sep_id]))
        instances.append(Instance(tokens, len(tokens), 0))
        chunk, chunk_len = [], 0
        target = _target_length(rng, max_tokens, spec.short_seq_prob)

    for sentence in document:
        while len(sentence):
            if chunk_len + len(sentence) <= target:
                chunk.append(sentence)
                chunk_len += len(sentence)
                sentence = sentence[:0]
            elif chunk:
                emit()
            else:  # one sentence longer than the target: split it
                chunk.append(sentence[:target])
                chunk_len = target
                sentence = sentence[target:]
                emit()
    if chunk:
        emit()
    return instances
