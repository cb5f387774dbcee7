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

import numpy as np

# BERT's punctuation in ASCII: every character in 33–47, 58–64, 91–96 and 123–126
ASCII_WORD = re.compile(r"[A-Za-z0-9]+|[!-/:-@\[-`{-~]")
ASCII_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
CACHE_WORDS = 1 << 20  # cleared when full: memory stays flat whatever the corpus


class CachedWordPiece:
    def __init__(self, tokenizer, lowercase: bool):
        """`tokenizer`: the `tokenizers.Tokenizer` of a BertWordPieceTokenizer (its `model`
        is the WordPiece model; the whole of it handles the sentences this class does not)."""
        self.tokenizer, self.model, self.lowercase = tokenizer, tokenizer.model, lowercase
        self.cache: dict[str, list[int]] = {}

    def _word_ids(self, word: str) -> list[int]:
        ids = [t.id for t in self.model.tokenize(word)]
        if len(self.cache) >= CACHE_WORDS:
            self.cache.clear()
        self.cache[word] = ids
        return ids

    def encode(self, sentences: list[str]) -> list[np.ndarray]:
        """Token ids of each sentence, without [CLS]/[SEP]."""
        out: list[np.ndarray | None] = [None] * len(sentences)
        slow = []
        cache, word_ids = self.cache, self._word_ids
        for i, sentence in enumerate(sentences):
            if not sentence.isascii() or ASCII_CONTROL.search(sentence):
                slow.append(i)
                continue
            ids: list[int] = []
            for word in ASCII_WORD.findall(sentence.lower() if self.lowercase else sentence):
                cached = cache.get(word)
                ids += cached if cached is not None else word_ids(word)
            out[i] = np.array(ids, dtype=np.int32)
        if slow:
            encoded = self.tokenizer.encode_batch_fast([sentences[i] for i in slow], add_special_tokens=False)
            for i, e in zip(slow, encoded):
                out[i] = np.array(e.ids, dtype=np.int32)
        return out  # type: ignore[return-value]
