"""Offline sentence splitting with Bling Fire, a finite-state splitter whose model ships
inside its wheel (no download), at tens of MB/s: lines here can be whole speeches."""
from __future__ import annotations

import blingfire


def split_sentences(line: str) -> list[str]:
    return [s for s in blingfire.text_to_sentences(line).split("\n") if s.strip()]


def document_sentences(document: list[str]) -> list[str]:
    """A document's lines (sentences, paragraphs or whole texts) as a list of sentences."""
    sentences: list[str] = []
    for line in document:
        sentences.extend(split_sentences(line))
    return sentences
