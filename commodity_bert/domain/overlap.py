"""Whether a task's dev texts appear whole in text meant for pretraining (`python -m
commodity_bert.domain check-text --text PATH... --task T`): a model pretrained on its own dev set would be judged on rows it has
read, and its gain over random init would not be a gain.

Texts are compared after lowercasing and collapsing runs of white space. A dev text of at least
MIN_WORDS words counts wherever it occurs, inside a longer document too; a shorter one only where
it is a whole line (a paragraph, or a document of its own): short stock phrases ("Horrible.",
"A must see.") occur inside many reviews that are not the dev row.

Written here rather than with an n-gram library because the question is exact containment of a
few thousand sentences in millions of words: each long dev text is indexed by its first
MIN_WORDS words, one pass over the pretraining text's word windows looks them up, and a hit is
confirmed by a substring test."""
from __future__ import annotations

from dataclasses import dataclass

MIN_WORDS = 8


def normalised(text: str) -> str:
    return " ".join(text.lower().split())


@dataclass
class Found:
    dev_text: str
    where: str  # the input file (or data set) holding it


def dev_texts(task) -> list[str]:
    """Every dev text of a classification task (and its pair), as written there."""
    return [t for t in list(task.dev.texts) + list(task.dev.pairs or []) if t and t.strip()]


def find(dev: list[str], documents, where=lambda: "") -> list[Found]:
    """The dev texts that occur in `documents` (an iterable of documents, each a list of
    paragraphs), by the rule above; `where()` names the document being read."""
    whole = {normalised(t): t for t in dev}
    long = {}
    for key, text in whole.items():
        words = key.split(" ")
        if len(words) >= MIN_WORDS:
            long.setdefault(tuple(words[:MIN_WORDS]), []).append(key)
    found: dict[str, Found] = {}
    for document in documents:
        lines = [normalised(p) for p in document]
        for line in lines:
            if line in whole and line not in found:
                found[line] = Found(whole[line], where())
        if not long:
            continue
        text = " ".join(lines)
        words = text.split(" ")
        for i in range(len(words) - MIN_WORDS + 1):
            for key in long.get(tuple(words[i:i + MIN_WORDS]), ()):
                if key not in found and key in text:
                    found[key] = Found(whole[key], where())
    return list(found.values())


def find_in_inputs(task, paths: list[str]) -> list[Found]:
    """`find` over bert-data-prep's inputs (files, directories, saved data sets, as it reads them)."""
    from data_prep.inputs import SkipCounter, iter_documents, resolve_inputs
    found = []
    for source in resolve_inputs(paths):
        found += find(dev_texts(task), iter_documents([source], SkipCounter()), lambda: str(source))
    return found
