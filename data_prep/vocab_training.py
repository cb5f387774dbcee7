"""`bert-data-prep vocab`: train a WordPiece vocabulary with HF `tokenizers`."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from commodity_bert.data.vocab import SPECIAL_TOKENS, Vocab
from data_prep.errors import PrepError
from data_prep.inputs import SkipCounter, iter_documents, resolve_inputs


def train_vocab(inputs: list[str], output: str, vocab_size: int, lowercase: bool,
                min_frequency: int = 2, text_field: str = "text", hf_split: str = "train") -> Vocab:
    from tokenizers import BertWordPieceTokenizer
    sources = resolve_inputs(inputs)
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

    tokenizer = BertWordPieceTokenizer(lowercase=lowercase, strip_accents=lowercase)
    tokenizer.train_from_iterator(lines(), vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=sys.stderr.isatty())
    if lines_seen == 0:
        raise PrepError(f"no text found in {', '.join(inputs)}; pass files with text in them")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        written = tokenizer.save_model(tmp)[0]
        os.replace(written, out)
    for line in skipped.summary():
        print(f"bert-data-prep: warning: {line}", file=sys.stderr)
    return Vocab.load(out)
