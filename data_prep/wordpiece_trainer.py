"""A WordPiece vocabulary trainer that gives the same vocab.txt for the same text, every run.

Why the project has its own: Hugging Face `tokenizers`' WordPiece trainer (a BPE trainer with a
"##" continuing-subword prefix) counts pairs in a hash map and breaks ties between merges of
equal count by token ids that depend on the map's iteration order, so the same text gives a
slightly different vocabulary each run, with any number of threads (tokenizers issue #1794). A
second preparation of the same corpus would then be other data: a resume onto it is refused and
two runs of the suite train on different tokens.

The algorithm is the one `BertWordPieceTokenizer.train` runs, with every order fixed:
- text → words by the library's own BERT normalizer and pre-tokenizer, counted;
- the alphabet: the `limit_alphabet` most frequent characters (ties: the lower code point),
  added in code-point order after the special tokens; characters outside it are dropped from
  their word, as the library does;
- each word's characters after the first get the "##" prefix; those tokens follow the alphabet,
  in code-point order;
- merges: the most frequent pair of adjacent tokens (ties: the pair of lower ids, as the
  library orders them, whose ids are fixed here) becomes one token (`a` + `b` without its
  "##"), until the vocabulary is full or no pair occurs `min_frequency` times.
Counting runs in one Python process, so the thread count cannot change the result.
"""
from __future__ import annotations

import heapq
import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable

PREFIX = "##"
CHUNK_CHARS = 1 << 20  # text is normalized and split a megabyte at a time: one library call each


def count_words(lines: Iterable[str], lowercase: bool) -> Counter[str]:
    """Words as BERT's normalizer and pre-tokenizer (the `tokenizers` library's) make them."""
    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer
    normalizer = BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=lowercase,
                                lowercase=lowercase)
    pre_tokenizer = BertPreTokenizer()
    counts: Counter[str] = Counter()
    chunk: list[str] = []
    size = 0

    def flush() -> None:
        text = normalizer.normalize_str("\n".join(chunk))
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(text))
        chunk.clear()

    for line in lines:
        chunk.append(line)
        size += len(line)
        if size >= CHUNK_CHARS:
            flush()
            size = 0
    if chunk:
        flush()
    return counts


def train_wordpiece(word_counts: Counter[str], vocab_size: int, special_tokens: Iterable[str],
                    min_frequency: int = 2, limit_alphabet: int = 1000) -> list[str]:
    """The vocabulary, in id order, for words counted by `count_words`."""
    vocab: list[str] = list(special_tokens)
    ids: dict[str, int] = {token: i for i, token in enumerate(vocab)}

    def add(token: str) -> int:
        if token not in ids:
            ids[token] = len(vocab)
            vocab.append(token)
        return ids[token]

    char_counts: Counter[str] = Counter()
    for word, count in word_counts.items():
        for char in word:
            char_counts[char] += count
    by_frequency = sorted(char_counts.items(), key=lambda item: (-item[1], ord(item[0])))
    alphabet = sorted((char for char, _ in by_frequency[:limit_alphabet]), key=ord)
    for char in alphabet:
        add(char)
    allowed = set(alphabet)
    continuing = sorted({char for word in word_counts for char in word[1:] if char in allowed}, key=ord)
    for char in continuing:
        add(PREFIX + char)

    # each distinct word as a list of token ids, with its count; sorted so the order is the text's
    words: list[list[int]] = []
    counts: list[int] = []
    for word, count in sorted(word_counts.items()):
        # a character outside the alphabet is dropped; the ones after the word's first keep "##"
        tokens = [ids[char if position == 0 else PREFIX + char]
                  for position, char in enumerate(word) if char in allowed]
        if tokens:
            words.append(tokens)
            counts.append(count)

    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)
    for index, (word, count) in enumerate(zip(words, counts)):
        for pair in itertools.pairwise(word):
            pair_counts[pair] += count
            where[pair].add(index)

    def entry(pair: tuple[int, int]) -> tuple[int, tuple[int, int]]:
        return (-pair_counts[pair], pair)

    queue = [entry(pair) for pair in pair_counts]
    heapq.heapify(queue)
    while len(vocab) < vocab_size and queue:
        negative_count, pair = heapq.heappop(queue)
        current = pair_counts.get(pair, 0)
        if current != -negative_count:  # stale: its count fell since it was queued
            if current > 0:
                heapq.heappush(queue, entry(pair))
            continue
        if current < min_frequency:
            break
        first, second = pair
        merged = add(vocab[first] + vocab[second][len(PREFIX):])
        # pairs that lose count keep their stale entry (re-queued when it comes up, above); the
        # pairs with the new token gain count and are queued
        grown: set[tuple[int, int]] = set()
        for index in sorted(where.pop(pair, ())):
            word, count = words[index], counts[index]
            i = 0
            while i < len(word) - 1:
                if word[i] == first and word[i + 1] == second:
                    if i > 0:
                        pair_counts[(word[i - 1], first)] -= count
                        pair_counts[(word[i - 1], merged)] += count
                        where[(word[i - 1], merged)].add(index)
                        grown.add((word[i - 1], merged))
                    if i + 2 < len(word):
                        pair_counts[(second, word[i + 2])] -= count
                        pair_counts[(merged, word[i + 2])] += count
                        where[(merged, word[i + 2])].add(index)
                        grown.add((merged, word[i + 2]))
                    word[i:i + 2] = [merged]
                i += 1
        pair_counts.pop(pair, None)
        for other in sorted(grown):
            if pair_counts.get(other, 0) > 0:
                heapq.heappush(queue, entry(other))
    return vocab
