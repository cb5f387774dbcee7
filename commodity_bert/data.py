"""Training data: the shards of `bert-data-prep`, split across ranks, batched by strata.

Every micro-batch on every rank takes the same number of samples from each length stratum, as
MLPerf's BERT does: one schedule, computed by every rank from the manifest, spreads each
stratum's samples evenly over the epoch's batches (a stratum smaller than one sample per batch
appears in every k-th batch), and each rank fills it with its own shuffled samples. Work per
rank is then balanced without any communication. Each batch is trimmed to its
longest sample (rounded up to a multiple of 8). Unmasked (dynamic) shards are masked here,
with a generator seeded by (seed, epoch, rank, batch) so a resumed run masks exactly as an
uninterrupted one.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from commodity_bert import shard_format as fmt
from commodity_bert.masking import mask_sequence
from commodity_bert.vocab import Vocab

PAD_MULTIPLE = 8
ARRAY_KEYS = ("input_ids", "segment_ids", "next_sentence_labels", "lengths",
              "masked_lm_positions", "masked_lm_ids")


class DataError(Exception):
    pass


def load_arrays(paths: list[Path], sha256s: list[str] | None = None) -> dict[str, np.ndarray]:
    """The arrays of several shards, concatenated (input_mask is rebuilt from lengths). With
    `sha256s` (the manifest's), a shard whose bytes differ from what was written is refused: it
    may read fine and still hold other samples (a shard copied from another dataset, a partial
    rsync), and would train silently."""
    parts = []
    for i, path in enumerate(paths):
        if not path.is_file():
            raise DataError(f"shard {path} is missing; re-run bert-data-prep shards with the same arguments")
        try:
            arrays = fmt.read_shard(path)
        except fmt.ShardFormatError as exc:
            raise DataError(str(exc)) from exc
        if sha256s is not None and fmt.sha256_file(path) != sha256s[i]:
            raise DataError(f"shard {path} differs from its manifest (sha256); copy it again from the "
                            f"dataset or re-run bert-data-prep shards, and check with bert-data-prep inspect --verify")
        parts.append({k: arrays[k] for k in ARRAY_KEYS if k in arrays})
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def load_split(data_dir: str | Path, manifest: dict, split: str, shards: slice = slice(None)) -> dict[str, np.ndarray]:
    """The arrays of a split's shards (a slice of them), each checked against the manifest."""
    paths = fmt.shard_paths(data_dir, manifest, split)[shards]
    digests = [entry["sha256"] for entry in manifest["splits"][split]["shards"]][shards]
    return load_arrays(paths, digests)


def spread_strata(take: np.ndarray, micro_batch: int) -> np.ndarray:
    """[batches, micro_batch] stratum labels with `take[s]` samples of stratum s in all: every
    batch holds ⌊ideal⌋ or ⌈ideal⌉ of each stratum (ideal = take[s] / batches), the ⌈⌉ going to
    the strata furthest behind, so a stratum too small for a whole sample per batch still trains
    (in every k-th batch) instead of rounding to zero and never training."""
    batches = int(take.sum()) // micro_batch
    ideal = take / batches
    base = np.floor(ideal).astype(np.int64)
    extra = micro_batch - int(base.sum())
    given = np.zeros_like(base)
    rows = np.empty((batches, len(take)), dtype=np.int64)
    for r in range(batches):
        behind = ideal * (r + 1) - (given + base)
        counts = base.copy()
        counts[np.argsort(-behind, kind="stable")[:extra]] += 1
        given += counts
        rows[r] = counts
    assert np.array_equal(given, take), (given, take)  # cumulative rounding ends on the totals
    return np.stack([np.repeat(np.arange(len(take)), counts) for counts in rows])


@dataclass
class RankData:
    arrays: dict[str, np.ndarray]
    strata: list[np.ndarray]   # sample indices of each stratum
    schedule: np.ndarray       # [batches, micro_batch] stratum of each slot, the same on every rank

    @property
    def batches_per_epoch(self) -> int:
        return len(self.schedule)


def epoch_schedule(rank_counts: np.ndarray, micro_batch: int, where: str) -> np.ndarray:
    """Which stratum fills each slot of each micro-batch of an epoch, from what every rank holds
    ([ranks, strata], known from the manifest: no communication). Every rank gets the same
    schedule, so every micro-batch on every rank has the same length mix and no rank waits for
    another; each rank trains all its samples but fewer than one micro-batch (plus the few by
    which shards differ), a different few every epoch."""
    least = rank_counts.min(axis=0)  # what every rank holds at least, per stratum
    batches = int(least.sum()) // micro_batch
    if batches == 0:
        raise DataError(f"{where}: too few training samples for a micro-batch of {micro_batch} on "
                        f"{len(rank_counts)} ranks; make more data or use a smaller micro-batch")
    exact = least / least.sum() * batches * micro_batch
    take = np.floor(exact).astype(np.int64)
    for s in np.argsort(-(exact - take), kind="stable")[: batches * micro_batch - take.sum()]:
        take[s] += 1
    return spread_strata(take, micro_batch)


def rank_training_data(data_dir: str | Path, manifest: dict, rank: int, world: int, micro_batch: int) -> RankData:
    """This rank's disjoint share of the training samples and the epoch's strata schedule.

    With a shard count that is a multiple of the world size, rank r reads shards r, r+W, …;
    otherwise every rank reads all shards and keeps every W-th sample of each stratum."""
    entries = manifest["splits"]["train"]["shards"]
    seq_len, num_strata = manifest["seq_len"], manifest["num_strata"]
    if len(entries) % world == 0:
        arrays = load_split(data_dir, manifest, "train", slice(rank, None, world))
        strata_all = fmt.stratum_of(arrays["lengths"], seq_len, num_strata)
        strata = [np.flatnonzero(strata_all == s) for s in range(num_strata)]
        rank_counts = np.array([[sum(e["strata_counts"][s] for e in entries[r::world]) for s in range(num_strata)]
                                for r in range(world)])
    else:
        arrays = load_split(data_dir, manifest, "train")
        strata_all = fmt.stratum_of(arrays["lengths"], seq_len, num_strata)
        strata = [np.flatnonzero(strata_all == s)[rank::world] for s in range(num_strata)]
        total = np.array(manifest["splits"]["train"]["strata_counts"])
        rank_counts = np.array([[len(range(r, n, world)) for n in total] for r in range(world)])
    return RankData(arrays, strata, epoch_schedule(rank_counts, micro_batch, str(data_dir)))


def epoch_plan(data: RankData, seed: int, epoch: int, rank: int) -> np.ndarray:
    """[batches, micro_batch] sample indices following the schedule, strata shuffled per epoch."""
    rng = np.random.default_rng([seed, epoch, rank])
    plan = np.empty(data.schedule.shape, dtype=np.int64)
    for s, indices in enumerate(data.strata):
        slots = data.schedule == s
        plan[slots] = rng.permutation(indices)[: int(slots.sum())]
    return plan


class BatchMaker:
    """Turns sample indices into a model batch (trimmed; masked here when the shards are not)."""

    def __init__(self, arrays: dict[str, np.ndarray], manifest: dict, vocab: Vocab, seed: int, static: bool):
        self.arrays, self.static, self.seed = arrays, static, seed
        self.seq_len = manifest["seq_len"]
        args = manifest.get("args", {})
        self.mask_prob = args.get("mask_prob", 0.15)
        self.max_predictions = manifest.get("max_predictions") or int(np.ceil(self.mask_prob * self.seq_len))
        self.mask_id = vocab.id("[MASK]")
        self.is_special = vocab.special_mask()
        self.replacement_ids = vocab.random_replacement_ids()
        self.continuation = vocab.continuation_mask() if args.get("whole_word") else None

    def __call__(self, indices: np.ndarray, key: tuple[int, ...]) -> dict[str, torch.Tensor]:
        indices = np.sort(indices)  # contiguous reads; order inside a batch does not matter
        lengths = self.arrays["lengths"][indices].astype(np.int64)
        width = min(self.seq_len, int(-(-lengths.max() // PAD_MULTIPLE) * PAD_MULTIPLE))
        input_ids = self.arrays["input_ids"][indices, :width].astype(np.int64)
        segments = self.arrays["segment_ids"][indices, :width].astype(np.int64)
        attention = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        if self.static:
            positions = self.arrays["masked_lm_positions"][indices].astype(np.int64)
            originals = self.arrays["masked_lm_ids"][indices].astype(np.int64)
            rows, cols = np.nonzero(positions > 0)  # padded with 0; position 0 is [CLS]
            flat = rows * width + positions[rows, cols]
            labels = originals[rows, cols]
        else:
            rng = np.random.default_rng([self.seed, *key])
            flat_parts, label_parts = [], []
            for row in range(len(indices)):
                n = lengths[row]
                masked, pos, orig = mask_sequence(
                    input_ids[row, :n], rng=rng, mask_prob=self.mask_prob,
                    max_predictions=self.max_predictions, mask_id=self.mask_id,
                    is_special=self.is_special, replacement_ids=self.replacement_ids,
                    continuation=self.continuation)
                input_ids[row, :n] = masked
                flat_parts.append(row * width + pos)
                label_parts.append(orig)
            flat, labels = np.concatenate(flat_parts), np.concatenate(label_parts)
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention),
            "token_type_ids": torch.from_numpy(segments),
            "next_sentence_labels": torch.from_numpy(self.arrays["next_sentence_labels"][indices].astype(np.int64)),
            "masked_index": torch.from_numpy(flat.astype(np.int64)),
            "masked_labels": torch.from_numpy(labels.astype(np.int64)),
            "real_tokens": torch.tensor(int(lengths.sum())),
        }


class _PlannedBatches(Dataset):
    def __init__(self, maker: BatchMaker, plan: np.ndarray, start: int, key: tuple[int, ...]):
        self.maker, self.plan, self.start, self.key = maker, plan, start, key

    def __len__(self) -> int:
        return len(self.plan) - self.start

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        index = self.start + i
        return self.maker(self.plan[index], (*self.key, index))


def _ignore_stop_signals(_worker_id: int) -> None:
    """Loader workers outlive a stop signal: the trainer finishes its step and saves a
    checkpoint, and a dead worker would abort it (the launcher signals the whole tree)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


class TrainingBatches:
    """Endless micro-batches over epochs, with a position that checkpoints save and restore."""

    def __init__(self, data_dir: str | Path, manifest: dict, rank: int, world: int, micro_batch: int,
                 seed: int, num_workers: int):
        self.data = rank_training_data(data_dir, manifest, rank, world, micro_batch)
        vocab = Vocab.load(Path(data_dir) / fmt.VOCAB_NAME)
        static = manifest["splits"]["train"]["masking"] == "static"
        self.maker = BatchMaker(self.data.arrays, manifest, vocab, seed, static)
        self.rank, self.seed, self.num_workers = rank, seed, num_workers
        self.epoch, self.batch = 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])

    def __iter__(self):
        while True:
            plan = epoch_plan(self.data, self.seed, self.epoch, self.rank)
            dataset = _PlannedBatches(self.maker, plan, self.batch, (self.epoch, self.rank))
            # its own generator: a loader drawing its worker seed from the global RNG would shift
            # dropout after a resume, which creates the loader at another point of the run
            loader = DataLoader(dataset, batch_size=None, shuffle=False, num_workers=self.num_workers,
                                prefetch_factor=4 if self.num_workers else None,
                                generator=torch.Generator().manual_seed(self.seed),
                                worker_init_fn=_ignore_stop_signals)
            for batch in loader:
                self.batch += 1
                yield batch
            self.epoch, self.batch = self.epoch + 1, 0


def validation_batches(data_dir: str | Path, manifest: dict, rank: int, world: int, micro_batch: int):
    """This rank's slice of the held-out split (statically masked), in length order."""
    if not manifest["splits"]["validation"]["shards"] or manifest["splits"]["validation"]["samples"] == 0:
        return []
    arrays = load_split(data_dir, manifest, "validation")
    order = np.argsort(arrays["lengths"], kind="stable")[rank::world]
    maker = BatchMaker(arrays, manifest, Vocab.load(Path(data_dir) / fmt.VOCAB_NAME), seed=0, static=True)
    return [maker(order[i:i + micro_batch], ()) for i in range(0, len(order), micro_batch)]
