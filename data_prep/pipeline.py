"""`bert-data-prep shards`: raw text → presorted, length-stratified HDF5 shards.

Two passes, both bounded in memory whatever the corpus size:

1. Scatter. The main process streams documents, cuts them into batches of ~1 MiB of text and
   hands the batches to worker processes (at most 2 per worker in flight). A worker splits
   sentences, tokenizes, builds instances and masks them, seeding its random generator from
   (seed, document index, dupe) so the result does not depend on the number of workers. The
   main process takes results in batch order and appends each sample, by length stratum s and
   running index i within s, to the bucket file (s, i mod K) of K virtual shards.
2. Gather. Shard k takes, from every stratum s, the bucket (k − o_s) mod K with
   o_s = (samples in strata before s) mod K. Each stratum then gives each shard ⌊n_s/K⌋ or
   ⌈n_s/K⌉ samples, and the shards that get a stratum's extra sample follow on cyclically
   from the previous stratum's, so shard sizes differ by at most one. A worker sorts the
   shard by stratum and length and writes it to a temporary name, then renames it.

Restart: the pass-1 result is recorded only once complete (an interrupted pass 1 is redone);
pass 2 skips shards whose final file exists. The manifest is written last.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from tqdm import tqdm

from commodity_bert.data import shard_format
from commodity_bert.data.masking import mask_rows
from commodity_bert.data.vocab import Vocab
from commodity_bert.host import atomic_write_text
from data_prep.errors import PrepError
from data_prep.fast_tokenizer import CachedWordPiece
from data_prep.inputs import HF_PREFIX, SkipCounter, iter_documents, resolve_inputs
from data_prep.instances import (InstanceSpec, TokenPool, instance_rng, nsp_instances, packed_instances,
                                 token_rows)
from data_prep.sentences import document_sentences

BATCH_CHARS = 1 << 20
BATCH_MAX_DOCS = 4096
BUCKET_BUFFER_BYTES = 16 << 20
WORK_DIR = ".work"
MASKING_STREAM = 2**32 - 1  # in a batch's masking seed: a stream of its own
SPLITS = ("train", "validation")


@dataclass(frozen=True)
class PrepConfig:
    """Everything that determines the shards' content (and nothing that does not: the
    number of workers is absent on purpose)."""
    inputs: tuple[str, ...]
    vocab_sha256: str
    lowercase: bool
    seq_len: int
    masking: str
    nsp: bool
    dupe_factor: int
    max_predictions: int
    mask_prob: float
    whole_word: bool
    short_seq_prob: float
    seed: int
    num_shards: int
    num_val_shards: int
    val_fraction: float
    num_strata: int
    text_field: str
    hf_split: str
    hf_data_files: tuple[str, ...] = ()

    @property
    def static(self) -> bool:
        return self.masking == "static"

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["inputs"] = list(self.inputs)
        d["hf_data_files"] = list(self.hf_data_files)
        if not self.hf_data_files:  # so that data made before hf: inputs still compares equal
            del d["hf_data_files"]
        return d


def is_validation_document(seed: int, doc_index: int, fraction: float) -> bool:
    digest = hashlib.blake2b(f"{seed}:{doc_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


# ---------------------------------------------------------------------------- worker side

_worker: dict = {}


def _init_worker(config: PrepConfig, vocab_path: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    vocab = Vocab.load(vocab_path)
    ids = vocab.special_ids
    _worker.update(
        config=config,
        tokenizer=CachedWordPiece(vocab.tokenizer(config.lowercase)._tokenizer, config.lowercase),
        spec=InstanceSpec(config.seq_len, config.short_seq_prob, ids["[CLS]"], ids["[SEP]"]),
        mask_id=ids["[MASK]"],
        is_special=vocab.special_mask(),
        replacement_ids=vocab.random_replacement_ids(),
        continuation=vocab.continuation_mask() if config.whole_word else None,
        dtype_static=shard_format.record_dtype(config.seq_len, config.max_predictions, len(vocab), True),
        dtype_dynamic=shard_format.record_dtype(config.seq_len, config.max_predictions, len(vocab), False),
    )


def _tokenize(documents: list[list[str]]) -> TokenPool:
    """A batch's documents as one pool of token ids; empty sentences are dropped."""
    sentences_per_doc = [document_sentences(doc) for doc in documents]
    ids, lengths = _worker["tokenizer"].encode_flat([s for sents in sentences_per_doc for s in sents])
    ends = np.cumsum(lengths).tolist()
    bounds, sentence = [], 0
    for sents in sentences_per_doc:
        doc = [ends[sentence - 1] if sentence else 0]
        for end in ends[sentence:sentence + len(sents)]:
            if end > doc[-1]:
                doc.append(end)
        sentence += len(sents)
        bounds.append(doc)
    return TokenPool(ids, bounds)


def _to_records(pool: TokenPool, rows: list, static: bool, masking_rng: np.random.Generator) -> np.ndarray:
    """Instances → records, all rows at once; static masking (whole words too) in one numpy pass
    (`mask_rows`), drawn from `masking_rng`."""
    cfg: PrepConfig = _worker["config"]
    records = np.zeros(len(rows), dtype=_worker["dtype_static"] if static else _worker["dtype_dynamic"])
    if not rows:
        return records
    tokens, lengths, segment_a, random_next = token_rows(pool, rows, _worker["spec"], cfg.nsp)
    masking = dict(mask_prob=cfg.mask_prob, max_predictions=cfg.max_predictions, mask_id=_worker["mask_id"],
                   is_special=_worker["is_special"], replacement_ids=_worker["replacement_ids"])
    if static:
        tokens, records["masked_positions"], records["masked_ids"] = mask_rows(
            tokens, lengths, rng=masking_rng, continuation=_worker["continuation"], **masking)
    records["tokens"] = tokens
    records["length"] = lengths
    records["segment_a"] = segment_a
    records["random_next"] = random_next
    return records


def process_batch(first_doc_index: int, documents: list[list[str]]) -> dict:
    """One batch of documents → masked (or unmasked) records for each split."""
    cfg: PrepConfig = _worker["config"]
    pool = _tokenize(documents)
    split_of = ["validation" if is_validation_document(cfg.seed, first_doc_index + i, cfg.val_fraction)
                else "train" for i in range(len(documents))]
    result = {"documents": {s: 0 for s in SPLITS}, "tokens_in": 0}
    build = nsp_instances if cfg.nsp else packed_instances
    for number, split in enumerate(SPLITS):
        # random next segments come from other documents of the same split and batch
        indices = [i for i, doc in enumerate(pool.bounds) if len(doc) > 1 and split_of[i] == split]
        split_pool = pool.subset(indices)
        result["documents"][split] = len(indices)
        result["tokens_in"] += sum(doc[-1] - doc[0] for doc in split_pool.bounds)
        # held-out documents are masked once, statically, so evaluation is repeatable
        dupes = cfg.dupe_factor if split == "train" else 1
        rows: list = []
        for own, i in enumerate(indices):
            for dupe in range(dupes):
                build(split_pool, own, _worker["spec"], instance_rng(cfg.seed, first_doc_index + i, dupe), rows)
        # one generator per batch and split: batches are cut by the main process, whatever the workers
        masking_rng = np.random.default_rng([cfg.seed, first_doc_index, MASKING_STREAM, number])
        result[split] = _to_records(split_pool, rows, cfg.static or split == "validation", masking_rng)
    return result


# ------------------------------------------------------------------------------ main side

class StratifiedBuckets:
    """Appends samples to bucket files (stratum s, running index i mod K), buffered."""

    def __init__(self, directory: Path, cfg: PrepConfig, num_shards: int, dtype: np.dtype):
        self.directory, self.cfg, self.num_shards, self.dtype = directory, cfg, num_shards, dtype
        directory.mkdir(parents=True, exist_ok=True)
        self.counts = np.zeros(cfg.num_strata, dtype=np.int64)
        self.length_histogram = np.zeros(cfg.seq_len + 1, dtype=np.int64)
        self.buffers: dict[tuple[int, int], list[np.ndarray]] = {}
        self.buffered = 0

    def path(self, stratum: int, virtual_shard: int) -> Path:
        return self.directory / f"s{stratum}_v{virtual_shard:05d}.rec"

    def add(self, records: np.ndarray) -> None:
        if not len(records):
            return
        self.length_histogram += np.bincount(records["length"], minlength=self.cfg.seq_len + 1)
        strata = shard_format.stratum_of(records["length"], self.cfg.seq_len, self.cfg.num_strata)
        for s in np.unique(strata):
            rows = records[strata == s]
            virtual = (self.counts[s] + np.arange(len(rows))) % self.num_shards
            self.counts[s] += len(rows)
            for v in np.unique(virtual):
                self.buffers.setdefault((int(s), int(v)), []).append(rows[virtual == v])
            self.buffered += rows.nbytes
        if self.buffered > BUCKET_BUFFER_BYTES:
            self.flush()

    def flush(self) -> None:
        for (s, v), parts in self.buffers.items():
            with open(self.path(s, v), "ab") as fh:
                np.concatenate(parts).tofile(fh)
        self.buffers.clear()
        self.buffered = 0

    def shard_records(self, shard: int, counts: list[int]) -> np.ndarray:
        """Gather shard `shard` from the buckets (see the module docstring)."""
        parts, before = [], 0
        for s, n in enumerate(counts):
            path = self.path(s, (shard - before) % self.num_shards)
            if path.exists():
                parts.append(np.fromfile(path, dtype=self.dtype))
            before += n
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)


def _record_dtypes(cfg: PrepConfig, vocab_size: int) -> dict[str, np.dtype]:
    return {"train": shard_format.record_dtype(cfg.seq_len, cfg.max_predictions, vocab_size, cfg.static),
            "validation": shard_format.record_dtype(cfg.seq_len, cfg.max_predictions, vocab_size, True)}


def _split_dir(out: Path, split: str) -> Path:
    return out if split == "train" else out / shard_format.VALIDATION_DIR


def _shard_counts(cfg: PrepConfig) -> dict[str, int]:
    return {"train": cfg.num_shards, "validation": cfg.num_val_shards}


def _batches(documents):
    batch, chars, first = [], 0, 0
    for index, doc in enumerate(documents):
        batch.append(doc)
        chars += sum(len(line) for line in doc)
        if chars >= BATCH_CHARS or len(batch) >= BATCH_MAX_DOCS:
            yield first, batch
            first, batch, chars = index + 1, [], 0
    if batch:
        yield first, batch


def _scatter(cfg: PrepConfig, vocab: Vocab, sources, work: Path, pool: ProcessPoolExecutor | None,
             workers: int) -> dict:
    dtypes = _record_dtypes(cfg, len(vocab))
    shutil.rmtree(work / "buckets", ignore_errors=True)  # an interrupted pass 1 starts over
    buckets = {split: StratifiedBuckets(work / "buckets" / split, cfg, n, dtypes[split])
               for split, n in _shard_counts(cfg).items()}
    skipped = SkipCounter()
    documents = {s: 0 for s in SPLITS}
    tokens_in = 0
    started = time.time()
    progress = tqdm(unit=" doc", desc="shards: scatter", mininterval=1.0, file=sys.stderr,
                    disable=None)

    def take(result):
        nonlocal tokens_in
        for split in SPLITS:
            buckets[split].add(result[split])
            documents[split] += result["documents"][split]
        tokens_in += result["tokens_in"]
        progress.update(sum(result["documents"].values()))
        elapsed = max(time.time() - started, 1e-9)
        progress.set_postfix_str(f"{tokens_in / elapsed:,.0f} tok/s", refresh=False)

    batches = _batches(iter_documents(sources, skipped, cfg.text_field, cfg.hf_split))
    if pool is None:
        _init_worker(cfg, str(vocab.path))
        for first, batch in batches:
            take(process_batch(first, batch))
    else:
        in_flight: deque = deque()
        for first, batch in batches:
            in_flight.append(pool.submit(process_batch, first, batch))
            if len(in_flight) >= 2 * workers:
                take(in_flight.popleft().result())
        while in_flight:
            take(in_flight.popleft().result())
    progress.close()
    for b in buckets.values():
        b.flush()
    return {
        "documents": documents,
        "tokens_in": tokens_in,
        "skipped": skipped.summary(),
        "strata_counts": {s: buckets[s].counts.tolist() for s in SPLITS},
        "length_histogram": {s: buckets[s].length_histogram.tolist() for s in SPLITS},
        "seconds": time.time() - started,
    }


def _write_one_shard(args) -> dict:
    _worker.clear()  # the scatter's tokenizer and word cache: the shard needs the memory
    split, index, cfg, vocab_size, vocab_sha, work, out, counts = args
    dtype = _record_dtypes(cfg, vocab_size)[split]
    buckets = StratifiedBuckets(work / "buckets" / split, cfg, _shard_counts(cfg)[split], dtype)
    records = buckets.shard_records(index, counts)
    info = shard_format.write_shard(_split_dir(out, split) / shard_format.shard_name(index), records,
                           seq_len=cfg.seq_len, num_strata=cfg.num_strata,
                           static_masking=cfg.static or split == "validation",
                           vocab_size=vocab_size, split=split, vocab_sha256=vocab_sha)
    return info.to_json()


def _gather(cfg: PrepConfig, vocab: Vocab, work: Path, out: Path, scatter: dict,
            pool: ProcessPoolExecutor | None) -> dict[str, list[dict]]:
    jobs, infos = [], {s: {} for s in SPLITS}
    for split, num in _shard_counts(cfg).items():
        _split_dir(out, split).mkdir(parents=True, exist_ok=True)
        for index in range(num):
            path = _split_dir(out, split) / shard_format.shard_name(index)
            if path.exists():  # finished by an earlier, interrupted run
                infos[split][index] = shard_format.shard_info_from_file(path, cfg.num_strata, cfg.seq_len).to_json()
            else:
                jobs.append((split, index, cfg, len(vocab), vocab.sha256, work, out,
                             scatter["strata_counts"][split]))
    progress = tqdm(total=len(jobs), unit=" shard", desc="shards: write", file=sys.stderr, disable=None)
    for job, info in zip(jobs, map(_write_one_shard, jobs) if pool is None else pool.map(_write_one_shard, jobs)):
        infos[job[0]][job[1]] = info
        progress.update()
    progress.close()
    return {s: [infos[s][i] for i in sorted(infos[s])] for s in SPLITS}


def _split_summary(cfg: PrepConfig, split: str, scatter: dict, shards: list[dict]) -> dict:
    counts = scatter["strata_counts"][split]
    total = sum(counts)
    histogram = scatter["length_histogram"][split]
    tokens = int(np.dot(np.arange(len(histogram)), histogram))
    return {
        "documents": scatter["documents"][split],
        "samples": total,
        "tokens": tokens,
        "padding_fraction": 1 - tokens / (total * cfg.seq_len) if total else 0.0,
        "masking": "static" if (cfg.static or split == "validation") else "dynamic",
        "strata_counts": counts,
        "strata_shares": [c / total if total else 0.0 for c in counts],
        "length_histogram": histogram,
        "shards": shards,
    }


def describe_sources(cfg: PrepConfig) -> list[dict]:
    """What the inputs were, for the record (a model card names its data by these): a file's size
    and sha256; a directory's (a `save_to_disk` data set) sha256 of its files' names and sha256s;
    an hf:NAME input's data files each, or, for a data set on the Hub, its name and split alone."""
    described = []
    for source in cfg.inputs:
        if not source.startswith(HF_PREFIX):
            described.append(describe_source(source))
        elif cfg.hf_data_files:
            described += [dict(describe_source(f), dataset=source) for f in cfg.hf_data_files]
        else:
            described.append({"path": source, "split": cfg.hf_split, "bytes": None, "sha256": None})
    return described


def describe_source(path: str) -> dict:
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        listing = "".join(f"{f.relative_to(p)}\0{shard_format.sha256_file(f)}\n" for f in files)
        return {"path": str(p.resolve()), "bytes": sum(f.stat().st_size for f in files), "files": len(files),
                "sha256": hashlib.sha256(listing.encode()).hexdigest()}
    return {"path": str(p.resolve()), "bytes": p.stat().st_size, "sha256": shard_format.sha256_file(p)}


def build_manifest(cfg: PrepConfig, vocab: Vocab, scatter: dict, shards: dict) -> dict:
    from data_prep import __version__
    return {
        "format": shard_format.FORMAT_NAME,
        "format_version": shard_format.FORMAT_VERSION,
        "created_by": {"tool": "bert-data-prep", "version": __version__},
        "args": cfg.to_json(),
        "vocab": {"file": shard_format.VOCAB_NAME, "size": len(vocab), "sha256": vocab.sha256,
                  "lowercase": cfg.lowercase},
        "seq_len": cfg.seq_len,
        "nsp": cfg.nsp,
        "masking": cfg.masking,
        "max_predictions": cfg.max_predictions,
        "num_strata": cfg.num_strata,
        "strata_bounds": shard_format.strata_bounds(cfg.seq_len, cfg.num_strata),
        "input": {"documents": sum(scatter["documents"].values()), "tokens": scatter["tokens_in"]},
        "sources": describe_sources(cfg),
        "skipped_lines": scatter["skipped"],
        "splits": {s: _split_summary(cfg, s, scatter, shards[s]) for s in SPLITS},
    }


def _previous_args(out: Path) -> dict | None:
    for path in (out / shard_format.MANIFEST_NAME, out / WORK_DIR / "state.json"):
        if path.is_file():
            try:
                return json.loads(path.read_text())["args"]
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
                raise PrepError(f"{path} is corrupt; remove {out} (or choose another --output) "
                                f"and run again") from None
    return None


def _check_output_dir(out: Path, cfg: PrepConfig) -> None:
    """Refuse a directory made differently; never touch one that is not ours."""
    previous = _previous_args(out)
    if previous is None:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise PrepError(f"output {out} exists and was not made by bert-data-prep shards; "
                            f"choose a new --output directory")
        return
    if previous.get("vocab_sha256") != cfg.vocab_sha256:
        raise PrepError(f"{out} holds shards made with another vocabulary (sha256 "
                        f"{str(previous.get('vocab_sha256'))[:12]}…, this one {cfg.vocab_sha256[:12]}…); "
                        f"pass the same --vocab or choose a new --output directory")
    now = cfg.to_json()
    differ = [f"{k}={previous.get(k)!r} (now {now[k]!r})" for k in now if previous.get(k) != now[k]]
    if differ:
        raise PrepError(f"{out} was made with other arguments: {', '.join(differ)}; "
                        f"repeat them or choose a new --output directory")


def run_shards(cfg_kwargs: dict, vocab_path: str, output: str, workers: int) -> dict:
    vocab = Vocab.load(vocab_path)
    sources = resolve_inputs(cfg_kwargs.pop("inputs"), cfg_kwargs.pop("hf_data_files", ()))
    cfg = PrepConfig(inputs=tuple(s.identity for s in sources), vocab_sha256=vocab.sha256,
                     hf_data_files=next((s.data_files for s in sources if s.data_files), ()), **cfg_kwargs)
    out = Path(output)
    _check_output_dir(out, cfg)
    manifest_path = out / shard_format.MANIFEST_NAME
    if manifest_path.is_file():
        manifest = shard_format.load_manifest(out)
        if all(p.is_file() for s in SPLITS for p in shard_format.shard_paths(out, manifest, s)):
            print(f"{out}: complete, nothing to do", file=sys.stderr)
            return manifest
    created = not out.exists()
    work = out / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    # one pool for both passes: each spawned worker costs ~0.3 s of imports and vocabulary
    pool = (ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker,
                                initargs=(cfg, str(vocab.path))) if workers > 1 else None)
    try:
        atomic_write_text(work / "state.json", json.dumps({"args": cfg.to_json()}, indent=1))
        scatter_path = work / "scatter.json"
        if scatter_path.is_file():
            scatter = json.loads(scatter_path.read_text())
        else:
            scatter = _scatter(cfg, vocab, sources, work, pool, workers)
            if sum(scatter["strata_counts"]["train"]) == 0:
                raise PrepError(f"no usable text in {', '.join(cfg.inputs)} (0 training samples); "
                                f"pass files with text in them")
            atomic_write_text(scatter_path, json.dumps(scatter))
        shards = _gather(cfg, vocab, work, out, scatter, pool)
        shutil.copyfile(vocab.path, out / (shard_format.VOCAB_NAME + ".tmp"))
        os.replace(out / (shard_format.VOCAB_NAME + ".tmp"), out / shard_format.VOCAB_NAME)
        manifest = build_manifest(cfg, vocab, scatter, shards)
        atomic_write_text(manifest_path, json.dumps(manifest, indent=1))
    except PrepError:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    shutil.rmtree(work, ignore_errors=True)
    for line in scatter["skipped"]:
        print(f"bert-data-prep: warning: {line}", file=sys.stderr)
    if scatter["documents"]["validation"] == 0 and cfg.val_fraction > 0:
        print("bert-data-prep: warning: no document was held out for validation; raise "
              "--val-fraction or add documents", file=sys.stderr)
    return manifest
