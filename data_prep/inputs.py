"""Streaming readers: every supported input becomes an iterator of documents, a document
being a list of text lines (each a sentence, a paragraph or a whole speech). Nothing holds
more than one document in memory.

Supported: .txt (blank line = document boundary), .jsonl (one document per line, `text`
field), .parquet, either of the first two compressed as .gz/.bz2/.xz, directories of those
(sorted, recursive), Hugging Face datasets saved with `save_to_disk`, and `hf:NAME[:CONFIG]`:
anything `datasets.load_dataset` takes by name, streamed (a 20 GB dump is read once, never held
or copied whole), its builders for local files (`hf:json`, `hf:parquet`, `hf:text`, `hf:csv`)
with `--hf-data-files`.
"""
from __future__ import annotations

import bz2
import glob
import gzip
import json
import lzma
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from data_prep.errors import PrepError

COMPRESSORS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
TEXT_KINDS = (".txt", ".jsonl")
TEXT_KIND_NAMES = ("txt", "jsonl")
HF_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
HF_PREFIX = "hf:"
# load_dataset's builders for local files: without data files they would read the working directory
HF_FILE_BUILDERS = ("json", "parquet", "text", "csv", "arrow")
BINARY_SNIFF_BYTES = 8192


@dataclass
class Source:
    path: Path | None  # None for a data set named hf:NAME
    kind: str          # "txt", "jsonl", "parquet", "hf_dataset" (save_to_disk), "hf_name" (load_dataset)
    opener: object = None
    hf_name: str = ""
    hf_config: str | None = None
    data_files: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.identity

    @property
    def identity(self) -> str:
        """What the manifest records and a rerun compares: the resolved path, or hf:NAME[:CONFIG]."""
        if self.kind != "hf_name":
            return str(self.path.resolve())
        return HF_PREFIX + self.hf_name + (f":{self.hf_config}" if self.hf_config else "")


@dataclass
class SkipCounter:
    """Lines that could not be used but do not stop the run: counted, reported once."""
    counts: Counter = field(default_factory=Counter)
    first: dict = field(default_factory=dict)

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        self.first.setdefault(reason, where)

    def summary(self) -> list[str]:
        return [f"skipped {n} line(s): {reason} (first at {self.first[reason]})"
                for reason, n in sorted(self.counts.items())]


def _classify(path: Path) -> Source | None:
    suffixes = path.suffixes
    opener = None
    if suffixes and suffixes[-1] in COMPRESSORS:
        opener = COMPRESSORS[suffixes[-1]]
        suffixes = suffixes[:-1]
    ext = suffixes[-1] if suffixes else ""
    if ext in TEXT_KINDS:
        return Source(path, ext[1:], opener or open)
    if ext == ".parquet" and opener is None:
        return Source(path, "parquet")
    return None


def _expand_data_files(patterns: list[str]) -> tuple[str, ...]:
    """--hf-data-files as absolute paths, each pattern's matches sorted, so that the manifest
    records (and a rerun compares) the very files read."""
    files: list[str] = []
    for pattern in patterns:
        matches = sorted(Path(m) for m in glob.glob(pattern, recursive=True) if Path(m).is_file())
        if not matches:
            raise PrepError(f"--hf-data-files {pattern}: no such file; give existing files or a glob that "
                            f"matches some")
        files += [str(p.resolve()) for p in matches]
    return tuple(files)


def _hf_source(raw: str, data_files: tuple[str, ...]) -> Source:
    name, _, config = raw[len(HF_PREFIX):].partition(":")
    if not name:
        raise PrepError(f"--input {raw}: name a data set, e.g. hf:wikimedia/wikipedia:20231101.en or "
                        f"hf:json with --hf-data-files FILE")
    if name in HF_FILE_BUILDERS and not data_files:
        raise PrepError(f"--input {raw} reads local files: pass them with --hf-data-files FILE [FILE ...]")
    return Source(None, "hf_name", hf_name=name, hf_config=config or None, data_files=data_files)


def resolve_inputs(paths: list[str], hf_data_files: list[str] | tuple[str, ...] = ()) -> list[Source]:
    """Expand the given paths into sources, failing at once on anything unusable."""
    sources: list[Source] = []
    if hf_data_files and not any(raw.startswith(HF_PREFIX) for raw in paths):
        raise PrepError("--hf-data-files is for an hf:NAME input (e.g. --input hf:json --hf-data-files "
                        "a.jsonl); give plain files to --input directly")
    data_files = _expand_data_files(list(hf_data_files)) if hf_data_files else ()
    for raw in paths:
        if raw.startswith(HF_PREFIX):
            sources.append(_hf_source(raw, data_files))
            continue
        path = Path(raw)
        if not path.exists():
            raise PrepError(f"input not found: {raw} (check the path)")
        if path.is_dir():
            if any((path / m).is_file() for m in HF_DATASET_MARKERS):
                sources.append(Source(path, "hf_dataset"))
                continue
            found = [s for p in sorted(path.rglob("*")) if p.is_file() and (s := _classify(p))]
            if not found:
                raise PrepError(f"input directory {raw} holds no .txt, .jsonl or .parquet files "
                                f"(compressed .gz/.bz2/.xz allowed) and is not a saved HF dataset")
            sources.extend(found)
        else:
            source = _classify(path)
            if source is None:
                # a file named by the user is taken as text whatever its name, decompressed where
                # its last suffix names a compressor (corpus.gz)
                source = Source(path, "txt", COMPRESSORS.get(path.suffix, open))
            sources.append(source)
    for source in sources:
        if source.kind in TEXT_KIND_NAMES:
            _check_text(source)
    return sources



def _open_binary(source: Source):
    opener = source.opener
    return opener(source.path, "rb")


def _check_text(source: Source) -> None:
    """Refuse binary files up front: a NUL byte in the first 8 KiB means it is not text."""
    try:
        with _open_binary(source) as fh:
            head = fh.read(BINARY_SNIFF_BYTES)
    except (OSError, EOFError, lzma.LZMAError, zlib.error) as exc:
        raise PrepError(f"{source.path}: cannot read ({exc}); the file is corrupt or not "
                        f"compressed as its name says") from exc
    if b"\x00" in head:
        raise PrepError(f"{source.path} looks like a binary file (NUL bytes), not text; pass "
                        f".txt/.jsonl files or a directory of them")


def iter_documents(sources: list[Source], skipped: SkipCounter, text_field: str = "text",
                   hf_split: str = "train") -> Iterator[list[str]]:
    for source in sources:
        if source.kind == "txt":
            yield from _txt_documents(source, skipped)
        elif source.kind == "jsonl":
            yield from _jsonl_documents(source, skipped, text_field)
        elif source.kind == "parquet":
            yield from _parquet_documents(source, text_field)
        elif source.kind == "hf_name":
            yield from _hf_streamed_documents(source, skipped, text_field, hf_split)
        else:
            yield from _hf_documents(source, text_field, hf_split)


def _decoded_lines(source: Source, skipped: SkipCounter) -> Iterator[str]:
    try:
        with _open_binary(source) as fh:
            for number, raw in enumerate(fh, 1):
                try:
                    yield raw.decode("utf-8")
                except UnicodeDecodeError:
                    skipped.add("not valid UTF-8", f"{source.path}:{number}")
    except (EOFError, lzma.LZMAError, zlib.error, gzip.BadGzipFile, OSError) as exc:
        raise PrepError(f"{source.path}: corrupt or truncated data ({exc}); re-create or "
                        f"re-download the file") from exc


def _txt_documents(source: Source, skipped: SkipCounter) -> Iterator[list[str]]:
    document: list[str] = []
    for line in _decoded_lines(source, skipped):
        line = line.strip()
        if line:
            document.append(line)
        elif document:
            yield document
            document = []
    if document:
        yield document


def _text_to_document(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _jsonl_documents(source: Source, skipped: SkipCounter, text_field: str) -> Iterator[list[str]]:
    for number, line in enumerate(_decoded_lines(source, skipped), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            skipped.add("not valid JSON", f"{source.path}:{number}")
            continue
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            skipped.add(f"no string field {text_field!r}", f"{source.path}:{number}")
            continue
        document = _text_to_document(text)
        if document:
            yield document


def _parquet_documents(source: Source, text_field: str) -> Iterator[list[str]]:
    import pyarrow.parquet as pq
    try:
        table = pq.ParquetFile(source.path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise PrepError(f"{source.path}: not a readable parquet file ({exc})") from exc
    if text_field not in table.schema_arrow.names:
        raise PrepError(f"{source.path}: no column {text_field!r} (columns: "
                        f"{table.schema_arrow.names}); pass --text-field NAME")
    for batch in table.iter_batches(batch_size=1024, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if text and (document := _text_to_document(text)):
                yield document


def _hf_documents(source: Source, text_field: str, hf_split: str) -> Iterator[list[str]]:
    import datasets
    try:
        dataset = datasets.load_from_disk(str(source.path))
    except Exception as exc:  # datasets raises several types for a bad directory
        raise PrepError(f"{source.path}: not a dataset saved with save_to_disk ({exc})") from exc
    if isinstance(dataset, datasets.DatasetDict):
        if hf_split not in dataset:
            raise PrepError(f"{source.path}: no split {hf_split!r} (splits: {list(dataset)}); "
                            f"pass --hf-split NAME")
        dataset = dataset[hf_split]
    if text_field not in dataset.column_names:
        raise PrepError(f"{source.path}: no column {text_field!r} (columns: "
                        f"{dataset.column_names}); pass --text-field NAME")
    # the arrow files are memory-mapped; iterating in batches keeps memory flat
    for batch in dataset.select_columns([text_field]).iter(batch_size=1024):
        for text in batch[text_field]:
            if text and (document := _text_to_document(text)):
                yield document


def _hf_streamed_documents(source: Source, skipped: SkipCounter, text_field: str,
                           hf_split: str) -> Iterator[list[str]]:
    import datasets
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors come back as our one line
    kwargs: dict = {"data_files": list(source.data_files)} if source.data_files else {}
    if source.hf_name == "text":
        kwargs["sample_by"] = "paragraph"  # a blank line ends a document, as in a .txt input
    try:
        dataset = datasets.load_dataset(source.hf_name, source.hf_config, split=hf_split, streaming=True,
                                        **kwargs)
    except ConnectionError as exc:
        raise PrepError(f"{source}: cannot reach the Hugging Face Hub ({exc}); without a network, give "
                        f"local files: --input hf:json|hf:parquet|hf:text --hf-data-files FILE, or a "
                        f"folder saved with save_to_disk") from exc
    except Exception as exc:  # datasets raises many types: unknown name, config or split, bad files
        raise PrepError(f"{source}: load_dataset failed ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}); check the name, :CONFIG, "
                        f"--hf-split and --hf-data-files") from exc
    columns = dataset.column_names
    if columns is not None and text_field not in columns:
        raise PrepError(f"{source}: no column {text_field!r} (columns: {columns}); pass --text-field NAME")
    read = 0
    try:
        for read, record in enumerate(dataset, 1):
            text = record.get(text_field)
            if not isinstance(text, str):
                skipped.add(f"no string field {text_field!r}", f"{source} record {read}")
            elif document := _text_to_document(text):
                yield document
    except ConnectionError as exc:
        raise PrepError(f"{source}: the connection failed after {read:,} records ({exc}); run the same "
                        f"command again (the first pass starts over)") from exc
    except (ValueError, OSError) as exc:  # a malformed data file
        raise PrepError(f"{source}: reading failed after {read:,} records ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}); fix or remove the file") from exc
