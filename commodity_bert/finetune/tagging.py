"""Token tagging (named entities and other spans in BIO tags): a tag for each word of a sentence.

- **Input**: CoNLL's column layout (a word a line, its columns separated by whitespace, the word
  first and its tag last, a blank line between sentences, `-DOCSTART-` lines skipped; CoNLL-U's
  `# ` comment lines skipped and its index column passed over; where columns follow the tag, as
  Universal NER's annotator column does, the tag is the last column in BIO form), in a file
  ending .conll, .iob, .iob2, .bio, .txt or .tsv; or JSONL, an object a line with `tokens` and
  `tags` (or `ner_tags`), both lists of strings. Tags are BIO: `O`, `B-TYPE`, `I-TYPE` (IOB2, and
  IOB1, whose chunks may begin with I-, read the same way). Every file problem (a line with
  another number of columns than the file's first, a tag outside BIO, tokens and tags of
  different lengths) is one line naming the file and line.
- **Labels on sub-tokens**: a word's tag goes on its first WordPiece; its other pieces and the
  special tokens are not scored (label -100), as BERT's paper did for CoNLL-2003. Words past
  the sequence's end get no prediction and count as `O`.
- **Metric**: entity-level F1 over BIO spans, as seqeval computes it in its default,
  conlleval-compatible mode (an I- tag after O or after another type begins an entity).
- **The no-model baseline**: each word's most frequent tag in the training split (lower-cased),
  `O` for a word never seen there: what memorising words alone tags.
"""
from __future__ import annotations

import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from commodity_bert.finetune import trainer
from commodity_bert.finetune.families import Family, register_family
from commodity_bert.finetune.tasks import TaskError, first_row_keys, name_of, read_records, sampled_rows

CONLL_SUFFIXES = (".conll", ".conll03", ".conllu", ".iob", ".iob2", ".bio", ".txt", ".tsv")
BIO = re.compile(r"^(O|[BI]-\S+)$")
IGNORED = -100  # cross_entropy's ignore_index: pieces after a word's first, and special tokens


@dataclass
class Sentences:
    words: list[list[str]]
    tags: list[list[str]]

    def __len__(self) -> int:
        return len(self.words)


@dataclass
class TaggingTask:
    name: str
    train: Sentences
    dev: Sentences
    label_names: list[str]  # the tags, index = class id; "O" first
    source: dict = field(default_factory=dict)
    family = "tagging"
    metric = "f1"


# ---------------------------------------------------------------- reading

def _check_tag(tag, path: Path, role: str, line: int) -> str:
    if not isinstance(tag, str) or not BIO.match(tag):
        hint = " (BIOES/IOBES: convert E- to I- and S- to B-)" if isinstance(tag, str) and tag[:2] in ("E-", "S-") \
            else ""
        raise TaskError(f"--{role} {path}: line {line}: tag {tag!r} is not BIO (O, B-TYPE or I-TYPE){hint}")
    return tag


def _conll_columns(fields: list[str]) -> tuple[int, int]:
    """(word column, tag column) from the first word line: the tag is the last column in BIO's
    form (Universal NER's files put an annotator after it), the word the first column, or the
    second where the first is a running index (CoNLL-U's)."""
    tag = max((i for i, f in enumerate(fields) if BIO.match(f)), default=len(fields) - 1)
    word = 1 if fields[0].isdigit() and tag > 1 else 0
    return word, tag


def _from_conll(path: Path, role: str, text: str | None = None) -> Sentences:
    if text is None:
        try:
            text = path.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as exc:
            raise TaskError(f"--{role} {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    out, words, tags, columns, where = Sentences([], []), [], [], None, None
    for number, line in enumerate(text.split("\n"), 1):
        if line.startswith("# "):  # CoNLL-U's comment lines (# sent_id = ..., # text = ...)
            continue
        fields = line.split()
        if not fields or fields[0] == "-DOCSTART-":
            if words:
                out.words.append(words)
                out.tags.append(tags)
            words, tags = [], []
            continue
        if columns is None:
            columns = len(fields)
            if columns < 2:
                raise TaskError(f"--{role} {path}: line {number} has one column; CoNLL's layout needs the word "
                                f"and its tag")
            where = _conll_columns(fields)
        elif len(fields) != columns:
            raise TaskError(f"--{role} {path}: line {number} has {len(fields)} columns, the file's first line "
                            f"{columns}; ragged columns (a space inside a word?)")
        words.append(fields[where[0]])
        tags.append(_check_tag(fields[where[1]], path, role, number))
    if words:
        out.words.append(words)
        out.tags.append(tags)
    return out


def _from_rows(rows: list[dict], path: Path, role: str) -> Sentences:
    out = Sentences([], [])
    for number, row in enumerate(rows, 1):
        key = "tags" if "tags" in row else "ner_tags"
        if "tokens" not in row or key not in row:
            raise TaskError(f"--{role} {path}: line {number} has no 'tokens' and 'tags' (JSONL tagging needs both)")
        words, tags = row["tokens"], row[key]
        if not isinstance(words, list) or not isinstance(tags, list) or len(words) != len(tags):
            raise TaskError(f"--{role} {path}: line {number}: 'tokens' and '{key}' must be lists of one length")
        if any(isinstance(t, int) for t in tags):
            raise TaskError(f"--{role} {path}: line {number}: tags are numbers; write their names (B-PER, O, ...)")
        if not words:
            continue
        out.words.append([str(w) for w in words])
        out.tags.append([_check_tag(t, path, role, number) for t in tags])
    return out


def read_sentences(path: Path, role: str) -> Sentences:
    if not path.exists():
        raise TaskError(f"--{role} {path}: no such file")
    if path.is_file() and path.suffix.lower() in CONLL_SUFFIXES:
        sentences = _from_conll(path, role)
    else:
        sentences = _from_rows(read_records(path, role), path, role)
    if not sentences.words:
        raise TaskError(f"--{role} {path}: no sentences")
    return sentences


def is_tagging(path: Path) -> bool:
    """Whether a --train file is in one of the layouts above (the CLI picks the family so)."""
    if path.is_file() and path.suffix.lower() in (".conll", ".conll03", ".conllu", ".iob", ".iob2", ".bio"):
        return True
    keys = first_row_keys(path) if path.suffix.lower() == ".jsonl" else set()
    return "tokens" in keys and bool({"tags", "ner_tags"} & keys)


def task_of(name: str, train: Sentences, dev: Sentences, train_path, dev_path, source: dict) -> TaggingTask:
    seen = {t for tags in train.tags for t in tags}
    unseen = sorted({t for tags in dev.tags for t in tags} - seen)
    if unseen:
        raise TaskError(f"--validation {dev_path}: tag(s) {', '.join(unseen[:5])} never occur in --train {train_path}")
    if not seen - {"O"}:
        raise TaskError(f"--train {train_path}: every tag is O; nothing to tag")
    return TaggingTask(name, train, dev, ["O"] + sorted(seen - {"O"}), source)


def from_files(train_path: Path, dev_path: Path) -> TaggingTask:
    train, dev = read_sentences(train_path, "train"), read_sentences(dev_path, "validation")
    return task_of(name_of(train_path), train, dev, train_path, dev_path, {"train": str(train_path), "validation": str(dev_path)})


def sample_train(task: TaggingTask, n: int) -> TaggingTask:
    """`n` training sentences (tasks.sampled_rows)."""
    rows, record = sampled_rows(len(task.train), n, "sentences")
    train = Sentences([task.train.words[i] for i in rows], [task.train.tags[i] for i in rows])
    return task_of(task.name, train, task.dev, "(the sampled rows)", "(the dev split)",
                   {**task.source, "train_examples": record})


# ---------------------------------------------------------------- entity F1

def entity_f1(gold: list[list[str]], predicted: list[list[str]]) -> float:
    """seqeval's f1_score in its default (conlleval-compatible) mode."""
    from seqeval.metrics import f1_score
    return float(f1_score(gold, predicted))


# ---------------------------------------------------------------- encoding and the model

@dataclass
class Encoded:
    sentences: Sentences
    input_ids: list[list[int]]
    token_type_ids: list[list[int]]
    labels_per_token: list[list[int]]  # IGNORED where not a word's first piece
    word_of_token: list[list[int | None]]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def labels(self) -> list[int]:  # one stratum for selection's held-out slice
        return [0] * len(self.input_ids)

    def subset(self, rows: list[int]) -> Encoded:
        return Encoded(Sentences([self.sentences.words[i] for i in rows], [self.sentences.tags[i] for i in rows]),
                       *([getattr(self, name)[i] for i in rows] for name in
                         ("input_ids", "token_type_ids", "labels_per_token", "word_of_token")))


def encode_sentences(sentences: Sentences, tokenizer, label_names: list[str], max_seq_len: int) -> Encoded:
    if not getattr(tokenizer, "is_fast", False):
        raise TaskError("token tagging needs a fast tokenizer (word_ids); save the model's tokenizer.json")
    enc = tokenizer(sentences.words, is_split_into_words=True, truncation=True, max_length=max_seq_len,
                    return_token_type_ids=True)
    index = {tag: i for i, tag in enumerate(label_names)}
    out = Encoded(sentences, enc["input_ids"], enc["token_type_ids"], [], [])
    for i, tags in enumerate(sentences.tags):
        word_ids = enc.word_ids(i)
        labels, previous = [], None
        for word in word_ids:
            labels.append(index[tags[word]] if word is not None and word != previous else IGNORED)
            previous = word
        out.labels_per_token.append(labels)
        out.word_of_token.append(word_ids)
    return out


def encode(task: TaggingTask, tokenizer, hp, cache_dir=None) -> tuple[Encoded, Encoded, bool]:
    return (encode_sentences(task.train, tokenizer, task.label_names, hp.max_seq_len),
            encode_sentences(task.dev, tokenizer, task.label_names, hp.max_seq_len), False)


def tagger(pretrained, num_tags: int, random_init: bool, hp):
    """Hugging Face's BertForTokenClassification (dropout and a linear layer on each token's
    state) over the pretrained encoder."""
    from transformers import BertForTokenClassification

    from commodity_bert.finetune import models
    model = BertForTokenClassification(models.task_config(pretrained, num_tags, hp.dropout))
    return models.with_encoder(model, pretrained, random_init, hp.reinit_layers)


def _collate(data: Encoded, rows: list[int], pad_id: int, device) -> dict:
    batch = trainer.padded(data, rows, pad_id, device)
    labels = torch.full(batch["input_ids"].shape, IGNORED, dtype=torch.long)
    for r, i in enumerate(rows):
        labels[r, :len(data.labels_per_token[i])] = torch.tensor(data.labels_per_token[i])
    return {**batch, "labels": labels.to(device)}


def predict(model, data: Encoded, label_names: list[str], hp, pad_id: int, device) -> list[list[str]]:
    """Each sentence's tags, a word's from its first piece; words cut off by the sequence: O."""
    tagged = [["O"] * len(words) for words in data.sentences.words]
    order = sorted(range(len(data)), key=lambda i: -len(data.input_ids[i]))
    model.eval()
    with torch.no_grad(), trainer.autocast(device, hp.precision):
        for at in range(0, len(order), hp.batch_size * 2):
            rows = order[at:at + hp.batch_size * 2]
            batch = _collate(data, rows, pad_id, device)
            batch.pop("labels")
            best = model(**batch).logits.argmax(-1).cpu().tolist()
            for r, i in enumerate(rows):
                for t, label in enumerate(data.labels_per_token[i]):
                    if label != IGNORED:
                        tagged[i][data.word_of_token[i][t]] = label_names[best[r][t]]
    return tagged


def finetune(pretrained, task: TaggingTask, train: Encoded, dev: Encoded, seed: int, hp, device,
             random_init: bool = False, progress: bool = True, label: str | None = None) -> dict:
    started = time.perf_counter()
    trainer.seed_everything(seed)
    model = tagger(pretrained, len(task.label_names), random_init, hp).to(device)
    pad_id = pretrained.tokenizer.pad_token_id or 0
    total = trainer.total_steps(len(train), hp)

    def loss_of(rows):
        batch = _collate(train, rows, pad_id, device)
        labels = batch.pop("labels")
        with trainer.autocast(device, hp.precision):
            logits = model(**batch).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORED)
    losses = trainer.fit(model, [len(ids) for ids in train.input_ids], loss_of, total, seed, hp, progress,
                         label or f"seed {seed}")
    value = entity_f1(dev.sentences.tags, predict(model, dev, task.label_names, hp, pad_id, device))
    return {"seed": seed, "value": value, "seconds": round(time.perf_counter() - started, 2), "steps": total,
            "lr": hp.lr, "final_train_loss": float(np.mean(losses[-20:])) if losses else None}


# ---------------------------------------------------------------- the no-model baseline

def majority_tags(task: TaggingTask) -> dict:
    """Each word's most frequent training tag (lower-cased; ties: the tag first in label order),
    O for a word the training split never has; entity F1 on dev."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for words, tags in zip(task.train.words, task.train.tags):
        for word, tag in zip(words, tags):
            counts[word.lower()][tag] += 1
    order = {tag: i for i, tag in enumerate(task.label_names)}
    best = {w: min(c, key=lambda t: (-c[t], order[t])) for w, c in counts.items()}
    predicted = [[best.get(w.lower(), "O") for w in words] for words in task.dev.words]
    return {"value": entity_f1(task.dev.tags, predicted)}


def baselines(task: TaggingTask, train: Encoded, dev: Encoded) -> dict:
    return {"majority_tag": majority_tags(task)}


# ---------------------------------------------------------------- the embedded task

UNER_SOURCES = {split: Path(__file__).resolve().parent / "resources" / f"uner_en_ewt_{split}.iob2.xz"
                for split in ("dev", "test")}
UNER_TRAIN_SENTENCES = 2000  # of UNER's dev split's 2,001: the embedded tasks train on at most 2,000


def embedded_entities() -> TaggingTask:
    """Named entities (PER, ORG, LOC) in English web text: Universal NER's English-EWT
    (resources/README.md). Its dev split's first 2,000 sentences train, its test split (2,077
    sentences) is dev: no sentence on both sides."""
    import lzma
    splits = {}
    for split, path in UNER_SOURCES.items():
        try:
            with lzma.open(path, "rt", encoding="utf-8") as fh:
                splits[split] = _from_conll(path, "task", fh.read())
        except (OSError, EOFError, lzma.LZMAError, UnicodeDecodeError) as exc:
            raise TaskError(f"--task embedded:entities: its data {path} is missing or damaged ({exc}); reinstall "
                            f"the commodity-bert package (pip install -e .)") from exc
    train = Sentences(splits["dev"].words[:UNER_TRAIN_SENTENCES], splits["dev"].tags[:UNER_TRAIN_SENTENCES])
    return task_of("embedded:entities", train, splits["test"], UNER_SOURCES["dev"].name, UNER_SOURCES["test"].name,
                   {"embedded": [p.name for p in UNER_SOURCES.values()], "train_sentences": UNER_TRAIN_SENTENCES})


EMBEDDED = {"embedded:entities": embedded_entities}


register_family(Family(
    "tagging", "tagging", encode, finetune, lambda pretrained, task, train, dev, *rest: baselines(task, train, dev),
    from_files=lambda args: from_files(args.train, args.validation), sample_train=sample_train, embedded=EMBEDDED,
    detects=is_tagging, min_steps=600, units="sentences", head=lambda hp: "a word's tag on its first piece",
    train_texts=lambda task: [[" ".join(words)] for words in task.train.words],
    report_lines=lambda result: [f"{'majority tag':<24}{100 * result['majority_tag']['value']:>7.1f}%   (each "
                                 f"word's most frequent training tag, O for words never seen)"],
    no_model_baseline=lambda r: (r["majority_tag"]["value"], "majority tag") if r.get("majority_tag") else None,
    task_type="token-classification"))
