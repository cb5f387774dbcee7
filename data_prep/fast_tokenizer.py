"""BERT's WordPiece tokenization of sentences, with a word cache in front of HF `tokenizers`.

Why not `tokenizers` alone: its BertWordPieceTokenizer normalizes, pre-tokenizes and looks up
every word of every sentence (~400k tokens/s on one core here, about 2 MB of text a second),
which made tokenization the largest stage of `bert-data-prep shards`. Text repeats its words,
so this class splits ASCII sentences into BERT's words itself (for ASCII text BERT's basic
tokenizer is: drop control characters, lower-case if asked, split on whitespace and on every
ASCII punctuation character) and asks the WordPiece model only for words it has not seen.
Sentences with any non-ASCII or control character go to `tokenizers` whole, so accents,
CJK characters and Unicode punctuation keep its exact handling. `tests/test_vocab_and_format.py`
checks that both paths give `tokenizers`' ids on the shared corpora.
"""
from __future__ import annotations

import re
from itertools import chain

import numpy as np

# BERT's punctuation in ASCII: every character in 33–47, 58–64, 91–96 and 123–126
ASCII_WORD = re.compile(r"[A-Za-z0-9]+|[!-/:-@\[-`{-~]")
ASCII_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
CACHE_WORDS = 1 << 20  # cleared when full: memory stays flat whatever the corpus


class _WordTable(dict):
    """word → its row in a table of WordPiece ids (rows `starts[k]:starts[k + 1]` of `ids`). A
    missing word is looked up once; lookups then run in C (`map` over `__getitem__`) and the
    ids of a batch's words are gathered in numpy."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.clear()

    def clear(self) -> None:
        super().clear()
        self.starts, self.ids = np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int32)
        self.new_ids: list[int] = []
        self.new_ends: list[int] = []

    def __missing__(self, word: str) -> int:
        row = self[word] = len(self)
        self.new_ids.extend(t.id for t in self.model.tokenize(word))
        self.new_ends.append(len(self.ids) + len(self.new_ids))
        return row

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self.new_ends:
            self.starts = np.concatenate((self.starts, np.array(self.new_ends, dtype=np.int64)))
            self.ids = np.concatenate((self.ids, np.array(self.new_ids, dtype=np.int32)))
            self.new_ids, self.new_ends = [], []
        return self.starts, self.ids


class CachedWordPiece:
    def __init__(self, tokenizer, lowercase: bool):
        """`tokenizer`: the `tokenizers.Tokenizer` of a BertWordPieceTokenizer (its `model`
        is the WordPiece model; the whole of it handles the sentences this class does not)."""
        self.tokenizer, self.lowercase = tokenizer, lowercase
        self.words = _WordTable(tokenizer.model)

    def _encode_ascii(self, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if len(self.words) >= CACHE_WORDS:  # between batches: rows index the table
            self.words.clear()
        split = ASCII_WORD.findall
        words = [split(s.lower() if self.lowercase else s) for s in sentences]
        flat = list(chain.from_iterable(words))
        rows = np.fromiter(map(self.words.__getitem__, flat), dtype=np.int64, count=len(flat))
        starts, table = self.words.arrays()
        pieces = starts[rows + 1] - starts[rows]
        ends = np.cumsum(pieces)
        # token t of word w is table[starts[w] + t]
        ids = table[np.repeat(starts[rows] - (ends - pieces), pieces) + np.arange(int(ends[-1]) if len(ends) else 0)]
        word_ends = np.cumsum(np.fromiter(map(len, words), dtype=np.int64, count=len(words)))
        token_ends = np.concatenate(([0], ends))[word_ends]
        return ids, np.diff(token_ends, prepend=0)

    def encode_flat(self, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of all sentences as one int32 array (without [CLS]/[SEP]), and each
        sentence's number of tokens."""
        fast = [i for i, s in enumerate(sentences) if s.isascii() and not ASCII_CONTROL.search(s)]
        if len(fast) == len(sentences):
            return self._encode_ascii(sentences)
        per_sentence: list = [None] * len(sentences)
        if fast:
            ids, lengths = self._encode_ascii([sentences[i] for i in fast])
            for i, part in zip(fast, np.split(ids, np.cumsum(lengths)[:-1])):
                per_sentence[i] = part
        slow = [i for i, part in enumerate(per_sentence) if part is None]
        encoded = self.tokenizer.encode_batch_fast([sentences[i] for i in slow], add_special_tokens=False)
        for i, e in zip(slow, encoded):
            per_sentence[i] = np.array(e.ids, dtype=np.int32)
        lengths = np.fromiter(map(len, per_sentence), dtype=np.int64, count=len(sentences))
        return np.concatenate(per_sentence).astype(np.int32, copy=False), lengths

    def encode(self, sentences: list[str]) -> list[np.ndarray]:
        """Token ids of each sentence, without [CLS]/[SEP]."""
        if not sentences:
            return []
        ids, lengths = self.encode_flat(sentences)
        return np.split(ids, np.cumsum(lengths)[:-1])
