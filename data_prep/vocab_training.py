"""`bert-data-prep vocab`: train a WordPiece vocabulary (the project's deterministic trainer,
data_prep/wordpiece_trainer.py, on the `tokenizers` library's BERT normalizer and pre-tokenizer)."""
from __future__ import annotations

import sys
from pathlib import Path

from commodity_bert.host import atomic_write_text
from commodity_bert.data.vocab import SPECIAL_TOKENS, Vocab
from data_prep.errors import PrepError
from data_prep.inputs import SkipCounter, iter_documents, resolve_inputs
from data_prep.wordpiece_trainer import count_words, train_wordpiece


def train_vocab(inputs: list[str], output: str, vocab_size: int, lowercase: bool,
                min_frequency: int = 2, text_field: str = "text", hf_split: str = "train",
                hf_data_files: list[str] | None = None) -> Vocab:
    sources = resolve_inputs(inputs, hf_data_files or ())
    out = Path(output)
    if out.is_dir():
        raise PrepError(f"--output {output} is a directory; give the vocab file's path, e.g. {out / 'vocab.txt'}")
    skipped = SkipCounter()
    lines_seen = 0

    def lines():
        nonlocal lines_seen
        for document in iter_documents(sources, skipped, text_field, hf_split):
            lines_seen += len(document)
            yield from document

    word_counts = count_words(lines(), lowercase)
    if lines_seen == 0:
        raise PrepError(f"no text found in {', '.join(inputs)}; pass files with text in them")
    tokens = train_wordpiece(word_counts, vocab_size, SPECIAL_TOKENS, min_frequency)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(token + "\n" for token in tokens))
    for line in skipped.summary():
        print(f"bert-data-prep: warning: {line}", file=sys.stderr)
    return Vocab.load(out)
