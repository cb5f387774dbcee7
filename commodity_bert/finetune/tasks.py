"""Downstream tasks as plain Python lists: text (and a pair's second text) and labels for a
training and a dev split, the label set and the task's metric.

Three sources: the user's files (CSV/TSV with a header, JSONL, a `datasets` dataset saved with
`save_to_disk`), GLUE's own TSV layout (`--glue TASK DIR`), and the embedded tasks (sentence
polarity of movie reviews; the party of a 2012 US convention speaker from one paragraph; whether
a Wikipedia sentence supports, refutes or does not settle a claim, a sentence pair).
Every problem with the input is a TaskError whose message is one line naming the problem and
the fix."""
from __future__ import annotations

import csv
import io
import json
import lzma
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

RESOURCES = Path(__file__).resolve().parent / "resources"
POLARITY_SOURCE = RESOURCES / "rotten_tomatoes_sentences.tsv.xz"
POLARITY_NEUTRAL_BAND = 0.8  # |mean score| below this is dropped; SST-2's neutral band, see resources/README.md
PARTY_SOURCE = RESOURCES / "convention_2012_speeches.csv.xz"
PARTY_MIN_WORDS = 5  # shorter paragraphs ("Thank you.") say nothing of a party
PARTY_DEV_EVERY = 5  # every 5th speaker of each party, in name order, is a dev speaker
VITAMINC_SOURCE = RESOURCES / "vitaminc_claims.jsonl.xz"
VITAMINC_DEV_EVERY = 20  # every 20th Wikipedia page, in name order, is a dev page

csv.field_size_limit(sys.maxsize)  # GLUE and user files hold long fields


class TaskError(Exception):
    """Bad task input; the message is one line for the user."""


@dataclass
class Split:
    texts: list[str]
    labels: list  # as read: str or int
    pairs: list[str] | None = None

    def __len__(self) -> int:
        return len(self.texts)


@dataclass
class Task:
    family = "classification"  # families.FAMILIES; qa.QATask and tagging.TaggingTask name theirs
    name: str
    metric: str  # accuracy | f1 | mcc
    train: Split
    dev: Split
    label_names: list = field(default_factory=list)  # index = class id
    positive_label: object = None  # F1's positive class
    source: dict = field(default_factory=dict)  # what the task was read from, for the report

    def label_ids(self, split: Split) -> list[int]:
        index = {name: i for i, name in enumerate(self.label_names)}
        return [index[label] for label in split.labels]


# ---------------------------------------------------------------- reading files

def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in
                                 ("dataset_info.json", "state.json", "dataset_dict.json"))


def read_records(path: Path, role: str) -> list[dict]:
    """Rows of a CSV/TSV (header row), JSONL file or saved dataset, as dicts. `role` ('train' or
    'validation') picks the split of a saved DatasetDict."""
    if not path.exists():
        raise TaskError(f"--{role} {path}: no such file")
    if path.is_dir():
        if not _is_saved_dataset(path):
            raise TaskError(f"--{role} {path}: a directory, but not a dataset saved with save_to_disk "
                            f"(no dataset_info.json / dataset_dict.json); give a CSV, TSV or JSONL file")
        from datasets import DatasetDict, load_from_disk
        try:
            loaded = load_from_disk(str(path))
        except Exception as exc:  # noqa: BLE001 - datasets raises many kinds for a damaged directory
            raise TaskError(f"--{role} {path}: cannot load the saved dataset ({str(exc).splitlines()[0]})") from exc
        if isinstance(loaded, DatasetDict):
            names = [role] + (["dev", "valid", "test"] if role == "validation" else [])
            name = next((n for n in names if n in loaded), None)
            if name is None:
                raise TaskError(f"--{role} {path}: a DatasetDict without a '{role}' split (it has "
                                f"{', '.join(loaded)}); give the split's own directory")
            loaded = loaded[name]
        return list(loaded)
    suffix = "".join(path.suffixes[-1:]).lower()
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TaskError(f"--{role} {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if suffix in (".jsonl", ".json"):
        rows = []
        # "\n" only: str.splitlines would also split at U+2028 and other separators inside JSON strings
        for number, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskError(f"--{role} {path}: line {number} is not JSON ({exc.msg}); JSONL needs one "
                                f"object per line") from exc
            if not isinstance(row, dict):
                raise TaskError(f"--{role} {path}: line {number} is not a JSON object")
            rows.append(row)
        return rows
    if suffix in (".csv", ".tsv"):
        # TSV files quote nothing (GLUE's sentences hold bare quotes); CSV files quote as Excel does
        dialect = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if suffix == ".tsv" else {}
        reader = csv.DictReader(io.StringIO(text, newline=""), **dialect)  # quoted fields may span lines
        rows = list(reader)
        if reader.fieldnames is None:
            raise TaskError(f"--{role} {path}: empty file (no header row)")
        return rows
    raise TaskError(f"--{role} {path}: unknown format '{suffix or path.name}'; use .csv, .tsv, .jsonl or a "
                    f"save_to_disk directory")


def _column(rows: list[dict], name: str, path: Path, role: str, flag: str) -> list:
    if not rows:
        raise TaskError(f"--{role} {path}: no rows (an empty file)")
    missing = [i for i, row in enumerate(rows) if name not in row]
    if missing:
        columns = ", ".join(str(c) for c in rows[missing[0]])
        where = "" if len(missing) == len(rows) else f" in row {missing[0] + 1}"
        raise TaskError(f"--{role} {path}: no column '{name}'{where} (columns: {columns}); name it with {flag}")
    values = [row[name] for row in rows]
    empty = next((i for i, v in enumerate(values) if v is None or v == ""), None)
    if empty is not None:
        raise TaskError(f"--{role} {path}: row {empty + 1} has no value in column '{name}'")
    return values


def _labels(values: list, path: Path, role: str) -> list:
    """Labels as read; integer-valued floats from JSON become ints, strings stay strings."""
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or isinstance(v, (int, str)):
            out.append(v)
        elif isinstance(v, float) and v.is_integer():
            out.append(int(v))
        else:
            raise TaskError(f"--{role} {path}: row {i + 1} has label {v!r}; labels must be strings or integers "
                            f"(regression tasks such as STS-B are not supported)")
    return out


def split_from_records(rows: list[dict], path: Path, role: str, text_field: str, pair_field: str | None,
                       label_field: str) -> Split:
    texts = [str(t) for t in _column(rows, text_field, path, role, "--text-field")]
    pairs = [str(t) for t in _column(rows, pair_field, path, role, "--text-pair-field")] if pair_field else None
    labels = _labels(_column(rows, label_field, path, role, "--label-field"), path, role)
    return Split(texts, labels, pairs)


def _sorted_labels(labels) -> list:
    kinds = {type(label) for label in labels}
    if len(kinds) > 1:  # 1 and "1" in one file
        return sorted(labels, key=str)
    return sorted(labels)


def finish(task_name: str, metric: str, train: Split, dev: Split, train_path, dev_path,
           positive_label=None, source: dict | None = None) -> Task:
    """Label set from the training split, checked against the dev split."""
    if len(train) == 0:
        raise TaskError(f"--train {train_path}: no rows (an empty file)")
    if len(dev) == 0:
        raise TaskError(f"--validation {dev_path}: no rows (an empty file)")
    names = _sorted_labels(set(train.labels))
    if len(names) < 2:
        raise TaskError(f"--train {train_path}: every row has label {names[0]!r}; a classifier needs at least "
                        f"two labels (check --label-field)")
    unseen = sorted({repr(label) for label in dev.labels if label not in set(names)})
    if unseen:  # also "1" in the dev file against 1 in the training file
        raise TaskError(f"--validation {dev_path}: label(s) {', '.join(unseen[:5])} never occur in "
                        f"--train {train_path} (its labels: {', '.join(map(repr, names[:10]))})")
    if metric != "f1":
        positive_label = None  # only F1 has a positive class
    else:
        if positive_label is None:
            positive_label = names[-1]  # 1 over 0, "positive" over "negative", "yes" over "no"
        elif positive_label not in names:
            match = [n for n in names if str(n) == str(positive_label)]
            if not match:
                raise TaskError(f"--positive-label {positive_label}: not a training label "
                                f"({', '.join(map(str, names))})")
            positive_label = match[0]
        if len(names) != 2:
            raise TaskError(f"--metric f1 needs two labels; --train {train_path} has {len(names)}")
    return Task(task_name, metric, train, dev, names, positive_label, source or {})


def name_of(train_path: Path) -> str:
    """The task's name from its training file: data/sst2/train.csv is "sst2", reviews_train.csv
    is "reviews_train" (every family names its files so)."""
    generic = train_path.stem.lower() in ("train", "training", "data")
    return train_path.parent.name if generic and train_path.parent.name else train_path.stem


def first_row_keys(path: Path) -> set[str]:
    """The keys of a JSONL file's first object, or a saved dataset's features: what the CLI
    tells the families apart by; empty for anything else or anything unreadable."""
    try:
        if path.is_file() and path.suffix.lower() == ".jsonl":
            with open(path, encoding="utf-8-sig") as fh:
                line = next((line for line in fh if line.strip()), "")
            row = json.loads(line) if line else {}
            return set(row) if isinstance(row, dict) else set()
        if path.is_dir() and (path / "dataset_info.json").is_file():
            return set(json.loads((path / "dataset_info.json").read_text()).get("features", {}))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        pass
    return set()


def from_files(train_path: Path, dev_path: Path, text_field: str, pair_field: str | None, label_field: str,
               metric: str, positive_label=None) -> Task:
    train = split_from_records(read_records(train_path, "train"), train_path, "train", text_field, pair_field,
                               label_field)
    dev = split_from_records(read_records(dev_path, "validation"), dev_path, "validation", text_field,
                             pair_field, label_field)
    return finish(name_of(train_path), metric, train, dev, train_path, dev_path, positive_label,
                  {"train": str(train_path), "validation": str(dev_path)})


# ---------------------------------------------------------------- GLUE's own layout

@dataclass(frozen=True)
class GlueLayout:
    text: str | int  # a header name, or a column index for header-less files (CoLA)
    pair: str | int | None
    label: str | int
    metric: str
    dev_file: str = "dev.tsv"
    header: bool = True


GLUE = {
    "sst2": GlueLayout("sentence", None, "label", "accuracy"),
    "cola": GlueLayout(3, None, 1, "mcc", header=False),
    "mrpc": GlueLayout("#1 String", "#2 String", "Quality", "f1"),
    "qqp": GlueLayout("question1", "question2", "is_duplicate", "f1"),
    "qnli": GlueLayout("question", "sentence", "label", "accuracy"),
    "rte": GlueLayout("sentence1", "sentence2", "label", "accuracy"),
    "mnli": GlueLayout("sentence1", "sentence2", "gold_label", "accuracy", dev_file="dev_matched.tsv"),
}
GLUE_NAMES = {"sst-2": "sst2", "sst2": "sst2", "cola": "cola", "mrpc": "mrpc", "qqp": "qqp", "qnli": "qnli",
              "rte": "rte", "mnli": "mnli"}


def _glue_split(path: Path, layout: GlueLayout, role: str) -> tuple[Split, int]:
    """GLUE's TSVs, read as GLUE's own processors read them: tab-separated, no quoting; rows
    with too few fields (a handful in QQP's train.tsv) are skipped and counted."""
    if not path.is_file():
        raise TaskError(f"--glue: {path} not found; DIR must hold GLUE's train.tsv and {layout.dev_file}")
    lines = [line for line in path.read_text(encoding="utf-8-sig").split("\n") if line]  # not splitlines: see above
    if not lines:
        raise TaskError(f"--glue: {path} is empty")
    rows = [line.split("\t") for line in lines]
    if layout.header:
        header, rows = rows[0], rows[1:]
        where = {}
        for name in (layout.text, layout.pair, layout.label):
            if name is None:
                continue
            if name not in header:
                raise TaskError(f"--glue: {path} has no column '{name}' (header: {', '.join(header[:12])}); "
                                f"is this the right task's directory?")
            where[name] = header.index(name)
        text_at, label_at = where[layout.text], where[layout.label]
        pair_at = where.get(layout.pair)
        if layout.label == "gold_label":  # MNLI's gold label is the last column (1 to 5 annotator labels precede)
            label_at = -1
    else:
        text_at, pair_at, label_at = layout.text, layout.pair, layout.label
    needed = max(i for i in (text_at, pair_at, label_at) if i is not None and i >= 0) + 1
    texts, pairs, labels, skipped = [], [], [], 0
    for row in rows:
        if len(row) < needed or not row[label_at] or row[label_at] == "-":
            skipped += 1
            continue
        texts.append(row[text_at])
        if pair_at is not None:
            pairs.append(row[pair_at])
        labels.append(row[label_at])
    return Split(texts, labels, pairs if pair_at is not None else None), skipped


def from_glue(task: str, directory: Path, positive_label=None, metric: str | None = None) -> Task:
    key = GLUE_NAMES.get(task.lower())
    if key is None:
        raise TaskError(f"--glue {task}: unknown task; one of SST-2, CoLA, MRPC, QQP, QNLI, RTE, MNLI "
                        f"(STS-B, a regression task, is not supported)")
    layout = GLUE[key]
    if not directory.is_dir():
        raise TaskError(f"--glue {task} {directory}: no such directory")
    train, skipped_train = _glue_split(directory / "train.tsv", layout, "train")
    dev, skipped_dev = _glue_split(directory / layout.dev_file, layout, "validation")
    metric = metric or layout.metric
    positive = positive_label if positive_label is not None else ("1" if metric == "f1" else None)
    return finish(f"glue:{key}", metric, train, dev, directory / "train.tsv", directory / layout.dev_file,
                  positive, {"glue": str(directory), "skipped_rows": skipped_train + skipped_dev})


# ---------------------------------------------------------------- the embedded task

def _read_embedded(path: Path, name: str) -> str:
    try:
        with lzma.open(path, "rt", encoding="utf-8", newline="") as fh:
            return fh.read()
    except (OSError, EOFError, lzma.LZMAError, UnicodeDecodeError) as exc:
        raise TaskError(f"--task {name}: its data {path} is missing or damaged ({exc}); reinstall the "
                        f"commodity-bert package (pip install -e .)") from exc


def embedded_polarity() -> Task:
    """Sentence polarity from the Rotten Tomatoes sentences (resources/README.md says how)."""
    lines = _read_embedded(POLARITY_SOURCE, "embedded:polarity").splitlines()
    seen: set[str] = set()
    train, dev = Split([], []), Split([], [])
    for line in lines:
        number, score, sentence = line.split("\t", 2)
        score_value = float(score)
        if abs(score_value) < POLARITY_NEUTRAL_BAND or sentence in seen:
            continue
        seen.add(sentence)
        split = dev if int(number) % 10 == 0 else train
        split.texts.append(sentence)
        split.labels.append("positive" if score_value > 0 else "negative")
    return finish("embedded:polarity", "accuracy", train, dev, "embedded:polarity", "embedded:polarity",
                  source={"embedded": POLARITY_SOURCE.name, "neutral_band": POLARITY_NEUTRAL_BAND})


def embedded_party() -> Task:
    """Democrat or Republican, from one paragraph of a 2012 US national convention speech
    (resources/README.md says where from). Split by speaker, so no speaker's style is in both
    splits: every PARTY_DEV_EVERY-th speaker of each party, in name order, is a dev speaker."""
    rows = list(csv.DictReader(io.StringIO(_read_embedded(PARTY_SOURCE, "embedded:party"), newline="")))
    speaker = [row["speaker"] or f"unnamed speech {i}" for i, row in enumerate(rows)]
    dev_speakers = set()
    for party in sorted({row["party"] for row in rows}):
        names = sorted({speaker[i] for i, row in enumerate(rows) if row["party"] == party})
        dev_speakers.update(names[::PARTY_DEV_EVERY])
    seen: set[str] = set()
    train, dev = Split([], []), Split([], [])
    for i, row in enumerate(rows):
        for paragraph in row["text"].split("\n"):
            paragraph = " ".join(paragraph.split())
            if len(paragraph.split()) < PARTY_MIN_WORDS or paragraph in seen:
                continue  # a paragraph said twice counts once, in the split of its first speaker
            seen.add(paragraph)
            split = dev if speaker[i] in dev_speakers else train
            split.texts.append(paragraph)
            split.labels.append(row["party"])
    return finish("embedded:party", "accuracy", train, dev, "embedded:party", "embedded:party",
                  source={"embedded": PARTY_SOURCE.name, "min_words": PARTY_MIN_WORDS,
                          "dev_speakers": len(dev_speakers)})


def embedded_vitaminc() -> Task:
    """A sentence pair: does a Wikipedia sentence (its page's title first, as the source gives it)
    make a claim True, False, or leave it open (Neither)? VitaminC's contrastive pairs (Schuster et
    al. 2021), from BIG-bench's copy (resources/README.md): most claims come twice, with two
    revisions of one sentence that differ by a few words and give the claim different labels, so
    neither text alone decides the label. Split by page: every VITAMINC_DEV_EVERY-th page, in
    name order, is a dev page, so no claim and no sentence is on both sides."""
    lines = _read_embedded(VITAMINC_SOURCE, "embedded:vitaminc").splitlines()
    rows = []
    for line in lines[1:]:  # the first line is BIG-bench's canary and where the file came from
        example = json.loads(line)
        context, claim = example["input"].split("\nClaim: ", 1)
        rows.append((context.split(": ", 1)[0], context, claim, example["label"]))
    dev_pages = set(sorted({page for page, *_ in rows})[::VITAMINC_DEV_EVERY])
    train, dev = Split([], [], []), Split([], [], [])
    for page, context, claim, label in rows:
        split = dev if page in dev_pages else train
        split.texts.append(context)
        split.pairs.append(claim)
        split.labels.append(label)
    return finish("embedded:vitaminc", "accuracy", train, dev, "embedded:vitaminc", "embedded:vitaminc",
                  source={"embedded": VITAMINC_SOURCE.name, "dev_pages": len(dev_pages)})


EMBEDDED = {"embedded:polarity": embedded_polarity, "embedded:party": embedded_party,
            "embedded:vitaminc": embedded_vitaminc}


def embedded(name: str) -> Task:
    if name not in EMBEDDED:
        raise TaskError(f"--task {name}: unknown; embedded tasks: {', '.join(EMBEDDED)}")
    return EMBEDDED[name]()


def majority_label(task: Task):
    """The training split's most frequent label (ties: the first in label order)."""
    counts = Counter(task.train.labels)
    return max(task.label_names, key=lambda name: counts[name])


TRAIN_SAMPLE_SEED = 4848  # not a fine-tuning seed: the rows are the same whatever --seeds says


def sampled_rows(size: int, n: int, unit: str) -> tuple[list[int], dict]:
    """(`n` of `size` training rows, the first of one fixed shuffle, in order; the record the
    JSON keeps) for --train-examples in the families without labels to stratify by (QA,
    tagging): the same rows for every arm and seed, and a smaller `n`'s a subset of a larger's."""
    if not 0 < n <= size:
        raise TaskError(f"--train-examples {n}: give a count from 1 to the training split's {size} {unit}")
    import numpy as np
    rows = sorted(np.random.default_rng(TRAIN_SAMPLE_SEED).permutation(size)[:n].tolist())
    return rows, {"rows": n, "of": size, "sample_seed": TRAIN_SAMPLE_SEED}


def sample_train(task: Task, n: int) -> Task:
    """The task with `n` rows of its training split (--train-examples), stratified by label: each
    label gets its share by largest remainder and at least one row. The rows are the first of
    one fixed shuffle per label, so every arm and seed sees the same rows and a smaller `n`
    takes (nearly) a subset of a larger one's rows: a gain curve over label counts compares
    like with like."""
    size = len(task.train)
    if n <= 0 or n > size:
        raise TaskError(f"--train-examples {n}: give a count from {len(task.label_names)} to the training "
                        f"split's {size} rows")
    if n < len(task.label_names):
        raise TaskError(f"--train-examples {n}: {task.name} has {len(task.label_names)} labels and each needs a "
                        f"row; give at least {len(task.label_names)}")
    if n == size:
        return task
    import numpy as np
    rows_of: dict = {label: [] for label in task.label_names}
    for i, label in enumerate(task.train.labels):
        rows_of[label].append(i)
    rng = np.random.default_rng(TRAIN_SAMPLE_SEED)
    shuffled = {label: rng.permutation(rows).tolist() for label, rows in rows_of.items()}
    shares = {label: n * len(rows) / size for label, rows in rows_of.items()}
    takes = {label: max(1, int(share)) for label, share in shares.items()}
    # largest remainders fill what the floors left (or the minimum of one took too much: the largest give back)
    order = sorted(task.label_names, key=lambda label: takes[label] - shares[label])
    while sum(takes.values()) < n:
        label = next(lb for lb in order if takes[lb] < len(rows_of[lb]))
        takes[label] += 1
        order.remove(label)
        order.append(label)
    while sum(takes.values()) > n:
        label = max((lb for lb in task.label_names if takes[lb] > 1), key=lambda lb: takes[lb] - shares[lb])
        takes[label] -= 1
    rows = sorted(i for label in task.label_names for i in shuffled[label][:takes[label]])
    train = Split([task.train.texts[i] for i in rows], [task.train.labels[i] for i in rows],
                  None if task.train.pairs is None else [task.train.pairs[i] for i in rows])
    source = {**task.source, "train_examples": {"rows": n, "of": size, "stratified_by_label": True,
                                                "sample_seed": TRAIN_SAMPLE_SEED}}
    return Task(task.name, task.metric, train, task.dev, task.label_names, task.positive_label, source)
