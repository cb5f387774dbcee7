"""Training data: the shards of `bert-data-prep`, split across ranks, batched by strata.

Every micro-batch on every rank takes the same number of samples from each length stratum
(proportional to the dataset's shares), as MLPerf's BERT does: per rank and epoch each
stratum is shuffled and cut into rows of its count, and batch r is row r of every stratum.
Work per rank is then balanced without any communication. Each batch is trimmed to its
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


def load_arrays(paths: list[Path]) -> dict[str, np.ndarray]:
    """The arrays of several shards, concatenated (input_mask is rebuilt from lengths)."""
    parts = []
    for path in paths:
        if not path.is_file():
            raise DataError(f"shard {path} is missing; re-run bert-data-prep shards with the same arguments")
        try:
            arrays = fmt.read_shard(path)
        except fmt.ShardFormatError as exc:
            raise DataError(str(exc)) from exc
        parts.append({k: arrays[k] for k in ARRAY_KEYS if k in arrays})
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def strata_counts_per_batch(shares: list[float], micro_batch: int) -> np.ndarray:
    """Samples of each stratum in a micro-batch: largest-remainder rounding of the shares."""
    exact = np.asarray(shares, dtype=np.float64) * micro_batch
    counts = np.floor(exact).astype(np.int64)
    for s in np.argsort(-(exact - counts), kind="stable")[: micro_batch - counts.sum()]:
        counts[s] += 1
    return counts


@dataclass
class RankData:
    arrays: dict[str, np.ndarray]
    strata: list[np.ndarray]   # sample indices of each stratum
    batches_per_epoch: int


def rank_training_data(data_dir: str | Path, manifest: dict, rank: int, world: int,
                       micro_batch: int) -> tuple[RankData, np.ndarray]:
    """This rank's disjoint share of the training samples, and the strata counts per batch.

    With a shard count that is a multiple of the world size, rank r reads shards r, r+W, …;
    otherwise every rank reads all shards and keeps every W-th sample of each stratum."""
    paths = fmt.shard_paths(data_dir, manifest, "train")
    entries = manifest["splits"]["train"]["shards"]
    seq_len, num_strata = manifest["seq_len"], manifest["num_strata"]
    per_batch = strata_counts_per_batch(manifest["splits"]["train"]["strata_shares"], micro_batch)
    if len(paths) % world == 0:
        arrays = load_arrays(paths[rank::world])
        strata_all = fmt.stratum_of(arrays["lengths"], seq_len, num_strata)
        strata = [np.flatnonzero(strata_all == s) for s in range(num_strata)]
        rank_counts = np.array([[sum(e["strata_counts"][s] for e in entries[r::world]) for s in range(num_strata)]
                                for r in range(world)])
    else:
        arrays = load_arrays(paths)
        strata_all = fmt.stratum_of(arrays["lengths"], seq_len, num_strata)
        strata = [np.flatnonzero(strata_all == s)[rank::world] for s in range(num_strata)]
        total = np.array(manifest["splits"]["train"]["strata_counts"])
        rank_counts = np.array([[len(range(r, n, world)) for n in total] for r in range(world)])
    used = per_batch > 0
    # every rank must run the same number of batches, or collectives would hang: the
    # manifest tells each rank what every other rank holds
    batches = int((rank_counts[:, used] // per_batch[used]).min())
    if batches == 0:
        raise DataError(f"{data_dir}: too few training samples for a micro-batch of {micro_batch} on "
                        f"{world} ranks; make more data or use a smaller micro-batch")
    return RankData(arrays, strata, batches), per_batch


def epoch_plan(data: RankData, per_batch: np.ndarray, seed: int, epoch: int, rank: int) -> np.ndarray:
    """[batches, micro_batch] sample indices: batch r is row r of every stratum."""
    rng = np.random.default_rng([seed, epoch, rank])
    columns = []
    for indices, count in zip(data.strata, per_batch):
        if count == 0:
            continue
        rows = rng.permutation(indices)[: data.batches_per_epoch * count]
        columns.append(rows.reshape(data.batches_per_epoch, count))
    plan = np.concatenate(columns, axis=1)
    return plan[:, rng.permutation(plan.shape[1])]  # strata mixed within the batch


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
        self.data, self.per_batch = rank_training_data(data_dir, manifest, rank, world, micro_batch)
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
            plan = epoch_plan(self.data, self.per_batch, self.seed, self.epoch, self.rank)
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
    paths = fmt.shard_paths(data_dir, manifest, "validation")
    if not paths or manifest["splits"]["validation"]["samples"] == 0:
        return []
    arrays = load_arrays(paths)
    order = np.argsort(arrays["lengths"], kind="stable")[rank::world]
    maker = BatchMaker(arrays, manifest, Vocab.load(Path(data_dir) / fmt.VOCAB_NAME), seed=0, static=True)
    return [maker(order[i:i + micro_batch], ()) for i in range(0, len(order), micro_batch)]
