"""The pretraining shard format: the one definition that the writer (`data_prep`) and every
reader (training, `bert-data-prep inspect`) import.

A dataset directory holds
    manifest.json                 the dataset description (see `build_manifest`)
    vocab.txt                     the WordPiece vocabulary the shards were tokenized with
    shard_00000.hdf5 ...          training shards
    validation/shard_00000.hdf5   held-out shards (always statically masked, so every
                                  evaluation sees the same masked tokens)

Each shard is an HDF5 file with NVIDIA's six keys, so NVIDIA's BERT readers can load ours and
we can load theirs:
    input_ids [n, L]  input_mask [n, L]  segment_ids [n, L]
    masked_lm_positions [n, P]  masked_lm_ids [n, P]   (static masking only; padded with 0)
    next_sentence_labels [n]                           (1 = B is a random segment)
plus `lengths` [n] (real tokens per sample) and attributes describing the shard. Dtypes are
compact (uint16 ids when the vocabulary fits); readers cast as they need.

Samples inside a shard are ordered by length stratum, then by length; every shard holds the
strata in the dataset's proportions (± 1 sample), so any rank reading any shard sees the same
length mix.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

FORMAT_NAME = "commodity-bert-shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
VOCAB_NAME = "vocab.txt"
VALIDATION_DIR = "validation"

NVIDIA_KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions",
               "masked_lm_ids", "next_sentence_labels")
MASKED_LM_KEYS = ("masked_lm_positions", "masked_lm_ids")
LENGTHS_KEY = "lengths"

# gzip (deflate) is the one HDF5 filter every HDF5 build has; shuffle makes the small ints
# of masks and segment ids compress to almost nothing. Level 1, not 4: a third less of data
# preparation's writing time for 1.5% more disk (measured on SOTU shards).
COMPRESSION = {"compression": "gzip", "compression_opts": 1, "shuffle": True}


class ShardFormatError(Exception):
    """A shard or manifest does not follow this format."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.hdf5"


def stratum_of(lengths: np.ndarray, seq_len: int, num_strata: int) -> np.ndarray:
    """Stratum s holds lengths in (s·L/S, (s+1)·L/S]."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.minimum((np.maximum(lengths, 1) - 1) * num_strata // seq_len, num_strata - 1)


def strata_bounds(seq_len: int, num_strata: int) -> list[list[int]]:
    """[low, high] (inclusive) of each stratum's lengths."""
    lengths = np.arange(1, seq_len + 1)
    strata = stratum_of(lengths, seq_len, num_strata)
    return [[int(lengths[strata == s].min()), int(lengths[strata == s].max())] for s in range(num_strata)]


def record_dtype(seq_len: int, max_predictions: int, vocab_size: int, static_masking: bool) -> np.dtype:
    """Compact fixed-width record of one sample, used between the data-prep passes."""
    tok = token_dtype(vocab_size)
    fields = [("tokens", tok, (seq_len,)), ("length", np.int16), ("segment_a", np.int16),
              ("random_next", np.int8)]
    if static_masking:
        fields += [("masked_positions", np.int16, (max_predictions,)),
                   ("masked_ids", tok, (max_predictions,))]
    return np.dtype(fields)


@dataclass
class ShardInfo:
    name: str
    samples: int
    tokens: int
    strata_counts: list[int]
    sha256: str
    bytes: int

    def to_json(self) -> dict:
        return dict(self.__dict__)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_shard(path: Path, records: np.ndarray, *, seq_len: int, num_strata: int,
                static_masking: bool, vocab_size: int, split: str, vocab_sha256: str) -> ShardInfo:
    """Write `records` (record_dtype rows) as one shard, atomically: a reader never sees a
    partial file under the final name."""
    strata = stratum_of(records["length"], seq_len, num_strata)
    order = np.lexsort((records["length"], strata))  # stratum first, then length
    records, strata = records[order], strata[order]
    n = len(records)
    positions = np.arange(seq_len, dtype=np.int32)
    lengths = records["length"].astype(np.int32)
    input_mask = (positions[None, :] < lengths[:, None]).astype(np.int8)
    segment_ids = ((positions[None, :] >= records["segment_a"].astype(np.int32)[:, None])
                   & input_mask.astype(bool)).astype(np.int8)
    arrays = {
        "input_ids": records["tokens"],
        "input_mask": input_mask,
        "segment_ids": segment_ids,
        "next_sentence_labels": records["random_next"].astype(np.int8),
        LENGTHS_KEY: records["length"].astype(np.int16),
    }
    if static_masking:
        arrays["masked_lm_positions"] = records["masked_positions"]
        arrays["masked_lm_ids"] = records["masked_ids"]
    strata_counts = np.bincount(strata, minlength=num_strata).astype(int).tolist()
    tmp = path.with_name(path.name + ".tmp")
    with h5py.File(tmp, "w") as f:
        for key in (*NVIDIA_KEYS, LENGTHS_KEY):
            if key in arrays:
                f.create_dataset(key, data=arrays[key], **(COMPRESSION if n else {}))
        f.attrs["format"] = FORMAT_NAME
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["split"] = split
        f.attrs["seq_len"] = seq_len
        f.attrs["num_samples"] = n
        f.attrs["num_strata"] = num_strata
        f.attrs["strata_counts"] = np.asarray(strata_counts, dtype=np.int64)
        f.attrs["masking"] = "static" if static_masking else "dynamic"
        f.attrs["vocab_size"] = vocab_size
        f.attrs["vocab_sha256"] = vocab_sha256
    digest = sha256_file(tmp)
    size = tmp.stat().st_size
    os.replace(tmp, path)
    return ShardInfo(path.name, n, int(lengths.sum()), strata_counts, digest, size)


def shard_info_from_file(path: Path, num_strata: int, seq_len: int) -> ShardInfo:
    """Describe a finished shard (used when a re-run skips shards written before)."""
    with h5py.File(path, "r") as f:
        lengths = f[LENGTHS_KEY][:]
    strata = stratum_of(lengths, seq_len, num_strata)
    return ShardInfo(path.name, len(lengths), int(lengths.astype(np.int64).sum()),
                     np.bincount(strata, minlength=num_strata).astype(int).tolist(),
                     sha256_file(path), path.stat().st_size)


def read_shard(path: str | os.PathLike, keys: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """The arrays of a shard, ours or NVIDIA's: all of them, or `keys` (and `lengths` always).
    NVIDIA's shards have no `lengths`: it is derived from `input_mask`."""
    try:
        with h5py.File(path, "r") as f:
            missing = [k for k in NVIDIA_KEYS if k not in f and k not in MASKED_LM_KEYS]
            if missing:
                raise ShardFormatError(f"{path}: not a BERT pretraining shard, keys {missing} missing")
            wanted = (*NVIDIA_KEYS, LENGTHS_KEY) if keys is None else (*keys, LENGTHS_KEY)
            arrays = {k: f[k][:] for k in wanted if k in f}
            if LENGTHS_KEY not in arrays:
                arrays[LENGTHS_KEY] = f["input_mask"][:].sum(axis=1).astype(np.int16)
    except OSError as exc:
        raise ShardFormatError(f"{path}: cannot be read as HDF5 ({exc}); re-create it with "
                               f"bert-data-prep shards") from exc
    return arrays


def check_shard_arrays(arrays: dict[str, np.ndarray], *, where: str, seq_len: int,
                       static_masking: bool, vocab_size: int) -> list[str]:
    """Schema problems of one shard's arrays (empty list = valid)."""
    problems = []
    expected = [k for k in NVIDIA_KEYS if static_masking or k not in MASKED_LM_KEYS]
    for key in expected:
        if key not in arrays:
            problems.append(f"{where}: key {key} missing")
    if problems:
        return problems
    n = len(arrays["input_ids"])
    for key in ("input_ids", "input_mask", "segment_ids"):
        if arrays[key].shape != (n, seq_len):
            problems.append(f"{where}: {key} has shape {arrays[key].shape}, expected ({n}, {seq_len})")
    if arrays["next_sentence_labels"].shape != (n,):
        problems.append(f"{where}: next_sentence_labels has shape {arrays['next_sentence_labels'].shape}")
    if problems or n == 0:
        return problems
    lengths = arrays[LENGTHS_KEY].astype(np.int64)
    if not np.array_equal(arrays["input_mask"].sum(axis=1), lengths):
        problems.append(f"{where}: lengths disagree with input_mask")
    if int(arrays["input_ids"].max()) >= vocab_size or int(arrays["input_ids"].min()) < 0:
        problems.append(f"{where}: input_ids outside the vocabulary [0, {vocab_size})")
    padding = arrays["input_ids"][arrays["input_mask"] == 0]
    if padding.size and padding.any():
        problems.append(f"{where}: padding positions hold non-zero ids")
    if static_masking:
        pos = arrays["masked_lm_positions"].astype(np.int64)
        if pos.shape[0] != n or arrays["masked_lm_ids"].shape != pos.shape:
            problems.append(f"{where}: masked_lm arrays have inconsistent shapes")
        elif (pos >= lengths[:, None]).any():
            problems.append(f"{where}: masked_lm_positions point past a sample's length")
    return problems


# ---------------------------------------------------------------------------------- manifest

def load_manifest(data_dir: str | os.PathLike) -> dict:
    path = Path(data_dir) / MANIFEST_NAME
    if not path.is_file():
        raise ShardFormatError(f"{path} not found: {data_dir} is not a dataset made by "
                               f"bert-data-prep shards (or its run has not finished)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ShardFormatError(f"{path} is corrupt ({exc}); re-run bert-data-prep shards") from exc
    if manifest.get("format") != FORMAT_NAME:
        raise ShardFormatError(f"{path}: format is {manifest.get('format')!r}, expected {FORMAT_NAME!r}")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise ShardFormatError(f"{path}: format version {manifest['format_version']} is newer than "
                               f"this code reads ({FORMAT_VERSION}); upgrade commodity-bert")
    return manifest


def shard_paths(data_dir: str | os.PathLike, manifest: dict, split: str = "train") -> list[Path]:
    base = Path(data_dir) if split == "train" else Path(data_dir) / VALIDATION_DIR
    return [base / s["name"] for s in manifest["splits"][split]["shards"]]
