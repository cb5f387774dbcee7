"""Training data: the shards of `bert-data-prep`, split across ranks, batched by strata.

Every micro-batch on every rank takes the same number of samples from each length stratum, as
MLPerf's BERT does: one schedule, computed by every rank from the manifest, spreads each
stratum's samples evenly over the batches (a stratum smaller than one sample per batch
appears in every k-th batch), and each rank fills it with its own shuffled samples. Work per
rank is then balanced without any communication. A rank streams its shards: an epoch is a
series of rounds, each over a few of its shards in memory (`StreamPlan`), so a rank's memory is
set by the shard size, not by the data set's. Each batch is trimmed to its
longest sample (rounded up to a multiple of 8). Unmasked (dynamic) shards are masked here, the
whole batch in one numpy pass (`masking.select_rows`), with a generator seeded by (seed, epoch,
rank, batch) so a resumed run masks exactly as an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from commodity_bert.data import shard_format
from commodity_bert.data.dataset import ShardSet
from commodity_bert.data.deal import Deal
from commodity_bert.data.masking import MASK_PROB, mask_selected, select_rows
from commodity_bert.data.vocab import Vocab

PAD_MULTIPLE = 8
ARRAY_KEYS = ("input_ids", "segment_ids", "next_sentence_labels", "lengths",
              "masked_lm_positions", "masked_lm_ids")


class DataError(Exception):
    pass


def check_shard_file(path: Path, sha256: str | None) -> None:
    """The shard is there and, given the manifest's sha256, holds the bytes that were written."""
    if not path.is_file():
        raise DataError(f"shard {path} is missing; re-run bert-data-prep shards with the same arguments")
    if sha256 is not None and shard_format.sha256_file(path) != sha256:
        try:  # the more telling of the two: not a shard at all, or another shard's samples
            shard_format.read_shard(path)
        except shard_format.ShardFormatError as exc:
            raise DataError(str(exc)) from exc
        raise DataError(f"shard {path} differs from its manifest (sha256); copy it again from the "
                        f"dataset or re-run bert-data-prep shards, and check with bert-data-prep inspect --verify")


def load_arrays(paths: list[Path], sha256s: list[str] | None = None) -> dict[str, np.ndarray]:
    """The arrays of several shards, concatenated (input_mask is rebuilt from lengths). With
    `sha256s` (the manifest's), a shard whose bytes differ from what was written is refused: it
    may read fine and still hold other samples (a shard copied from another dataset, a partial
    rsync), and would train silently."""
    parts = []
    for i, path in enumerate(paths):
        if not path.is_file():
            check_shard_file(path, None)
        try:
            parts.append(shard_format.read_shard(path, keys=ARRAY_KEYS))
        except shard_format.ShardFormatError as exc:
            raise DataError(str(exc)) from exc
        if sha256s is not None:
            check_shard_file(path, sha256s[i])
    if len(parts) == 1:  # a streamed shard: no second copy
        return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


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


ID_SHARD, ID_STRATUM = 36, 32  # a sample's id: shard << 36 | stratum << 32 | ordinal in its stratum


def sample_ids(shard: int, stratum: int, ordinals: np.ndarray) -> np.ndarray:
    return (np.int64(shard) << ID_SHARD) | (np.int64(stratum) << ID_STRATUM) | np.asarray(ordinals, dtype=np.int64)


@dataclass(frozen=True)
class ShardShare:
    """The samples of one shard that one rank trains: per stratum s, the ordinals
    range(first[s], stratum size, step) (ranges, not arrays: every rank keeps every rank's shares);
    `first` is one start for every stratum or one per stratum."""
    shard: int
    sizes: tuple[int, ...]
    first: int | tuple[int, ...] = 0
    step: int = 1

    def _first(self, stratum: int) -> int:
        return self.first[stratum] if isinstance(self.first, tuple) else self.first

    def counts(self) -> np.ndarray:
        return np.array([len(range(self._first(s), n, self.step)) for s, n in enumerate(self.sizes)], dtype=np.int64)

    def ids(self, stratum: int) -> np.ndarray:
        return sample_ids(self.shard, stratum, np.arange(self._first(stratum), self.sizes[stratum], self.step))


def rank_shares(manifest: dict, rank: int, world: int, dealing: str = "whole") -> list[ShardShare]:
    """Which samples rank `rank` trains, shard by shard, from the manifest alone. The one rule,
    for any shard count: the first ⌊n/W⌋·W shards are dealt whole (rank r: shards r, r+W, …), and
    the samples of the n mod W left over are dealt in turn, stratum by stratum, as if those shards
    were one (every W-th sample, the turn going on from one shard to the next), so a rank reads
    ⌊n/W⌋ + n mod W shards an epoch, not all n, and a stratum's counts differ by at most two
    samples between ranks (`bert-data-prep` gives a stratum's extra samples to its first shards;
    what a rank holds beyond the others' goes untrained in the epoch). Every rank gets the same
    number of shares. "split": the rule of checkpoints made before shards were dealt whole (every
    shard split, each from rank 0, when W does not divide n), kept so their epoch resumes exactly."""
    entries = manifest["splits"]["train"]["shards"]
    if dealing == "split" and len(entries) % world:
        return [ShardShare(k, tuple(e["strata_counts"]), rank, world) for k, e in enumerate(entries)]
    whole = len(entries) // world * world
    shares = [ShardShare(k, tuple(entries[k]["strata_counts"])) for k in range(rank, whole, world)]
    before = np.zeros(manifest.get("num_strata", len(entries[0]["strata_counts"])), dtype=np.int64)
    for k in range(whole, len(entries)):
        sizes = tuple(entries[k]["strata_counts"])
        shares.append(ShardShare(k, sizes, tuple(int(f) for f in (rank - before) % world), world))
        before += sizes
    return shares


def deal_as_saved(manifest: dict, world: int) -> str:
    """The dealing a checkpoint saved without one used: "split" wherever W does not divide the
    shard count (fewer shards than ranks included: the turn of the left-over samples differs)."""
    return "split" if len(manifest["splits"]["train"]["shards"]) % world else "whole"


@dataclass(frozen=True)
class RemainingShare:
    """What one rank trains of one shard in the rest of an epoch: every `step`-th of the samples
    the epoch's earlier layouts left in each stratum (`left`, shared by every rank's share), from
    `first`, so the ranks' shares differ by at most one sample per stratum, as a fresh layout's
    do, and none of the samples left stays untrained for want of a rank to take it."""
    shard: int
    left: tuple[np.ndarray, ...]
    first: int
    step: int

    def ids(self, stratum: int) -> np.ndarray:
        return self.left[stratum][self.first::self.step]

    def counts(self) -> np.ndarray:
        return np.array([len(range(self.first, len(ids), self.step)) for ids in self.left], dtype=np.int64)


def samples_left(manifest: dict, consumed: np.ndarray) -> list[tuple[np.ndarray, ...]]:
    """Per shard and stratum, the ids an epoch has not trained (`consumed`: sorted ids): 8 bytes
    a sample, worked out once for every rank's shares."""
    left = []
    for k, entry in enumerate(manifest["splits"]["train"]["shards"]):
        per_stratum = []
        for s, size in enumerate(entry["strata_counts"]):
            ids = sample_ids(k, s, np.arange(size))
            lo, hi = np.searchsorted(consumed, [ids[0], ids[-1] + 1]) if size else (0, 0)
            per_stratum.append(ids[~np.isin(ids, consumed[lo:hi], assume_unique=True)])
        left.append(tuple(per_stratum))
    return left


def round_schedule(rank_counts: np.ndarray, micro_batch: int) -> np.ndarray:
    """Which stratum fills each slot of each micro-batch, from what every rank holds ([ranks,
    strata], known from the manifest: no communication). Every rank gets the same schedule, so
    every micro-batch on every rank has the same length mix and no rank waits for another. It
    takes what every rank holds at least, less a part of a micro-batch: the rest is carried."""
    least = rank_counts.min(axis=0)
    batches = int(least.sum()) // micro_batch
    if batches == 0:
        return np.zeros((0, micro_batch), dtype=np.int64)
    exact = least / least.sum() * batches * micro_batch
    take = np.floor(exact).astype(np.int64)
    for s in np.argsort(-(exact - take), kind="stable")[: batches * micro_batch - take.sum()]:
        take[s] += 1
    return spread_strata(take, micro_batch)


@dataclass
class Round:
    """Part of an epoch trained from a few shards in memory (and the samples carried into it)."""
    index: int
    first_batch: int     # its first batch's index in the epoch
    schedule: np.ndarray  # [batches, micro_batch] stratum of each slot (int8)
    positions: np.ndarray  # which of the rank's shares (shards) it reads

    @property
    def batches(self) -> int:
        return len(self.schedule)


@dataclass
class RoundPlan:
    round: Round
    shards: list[int]       # the shards it reads
    plan: np.ndarray        # [batches, micro_batch] sample ids
    carried_in: np.ndarray  # ids of samples of earlier rounds that it trains or carries on
    carried_out: np.ndarray


class StreamPlan:
    """An epoch as rounds of `shards_in_memory` of this rank's shards, from the manifest alone.

    The shard order is shuffled per epoch with the same generator on every rank, so round k
    reads as many shards on every rank; its schedule comes from what every rank holds in it
    (`round_schedule`), so the strata mix of micro-batch i is the same everywhere. What a rank
    holds beyond what every rank holds (shards differ by a sample per stratum), and the last
    part of a micro-batch, is carried into the next round: every sample trains once per epoch
    but fewer than a micro-batch plus the few by which ranks' shares differ, as with the whole
    data set in memory. Within a round each stratum's samples are shuffled per (epoch, rank,
    round). The schedules are counts (kept for the epoch); the sample ids of a round are drawn
    when it is reached (`plans`), so memory follows the round, not the data set, and a position
    in the epoch (batch index) is enough to rebuild everything on resume."""

    def __init__(self, manifest: dict, rank: int, world: int, micro_batch: int, seed: int,
                 shards_in_memory: int, where: str = "data", left: list | None = None, segment: int = 0,
                 dealing: str = "whole"):
        """`left`, `segment`: the plan of the rest of an epoch, after `segment` earlier layouts
        (TrainingBatches.earlier) left these samples (samples_left); its generators are its own.
        `dealing`: how whole shards go to ranks (`rank_shares`)."""
        self.rank, self.micro_batch, self.seed = rank, micro_batch, seed
        self.num_strata = manifest["num_strata"]
        self.salt = [segment] if segment else []  # the first layout's draws as they always were
        self.shares = [rank_shares(manifest, r, world, dealing) if left is None else
                       [RemainingShare(k, ids, r, world) for k, ids in enumerate(left)] for r in range(world)]
        self.counts = np.array([[share.counts() for share in shares] for shares in self.shares])  # [W, n, S]
        n = len(self.shares[rank])
        self.window = n if shards_in_memory <= 0 else min(shards_in_memory, n)
        self._cache: dict[int, list[Round]] = {}
        if left is None and self.batches_in_epoch(0) == 0:
            raise DataError(f"{where}: too few training samples for a micro-batch of {micro_batch} on "
                            f"{world} ranks; make more data or use a smaller micro-batch")

    def rounds(self, epoch: int) -> list[Round]:
        """The epoch's rounds: shards and schedules (counts only, the same arithmetic on every rank)."""
        if epoch not in self._cache:
            n = self.counts.shape[1]
            order = np.random.default_rng([self.seed, epoch, *self.salt]).permutation(n)  # the same on every rank
            carry_counts = np.zeros((self.counts.shape[0], self.num_strata), dtype=np.int64)
            rounds, first = [], 0
            for k, start in enumerate(range(0, n, self.window)):
                positions = order[start:start + self.window]
                held = carry_counts + self.counts[:, positions].sum(axis=1)
                schedule = round_schedule(held, self.micro_batch).astype(np.int8)
                carry_counts = held - np.bincount(schedule.ravel(), minlength=self.num_strata)
                rounds.append(Round(k, first, schedule, positions))
                first += len(schedule)
            self._cache = {epoch: rounds}  # the current epoch only
        return self._cache[epoch]

    def batches_in_epoch(self, epoch: int) -> int:
        return sum(r.batches for r in self.rounds(epoch))

    def trained(self, epoch: int, batches: int) -> np.ndarray:
        """The ids this rank's first `batches` micro-batches of `epoch` train."""
        rows = []
        for rnd in self.plans(epoch):
            if batches <= rnd.round.first_batch:
                break
            rows.append(rnd.plan[:batches - rnd.round.first_batch].ravel())
        return np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)

    def plans(self, epoch: int, rank: int | None = None):
        """Each round's sample ids, in order: a round's pool per stratum is what was carried in
        and its shards' samples, shuffled; the first `take` fill the schedule, the rest carry on.
        `rank`: another rank's (a rank that trains some of its micro-batches: data/deal.py)."""
        rank = self.rank if rank is None else rank
        own = self.shares[rank]
        carry = [np.zeros(0, dtype=np.int64) for _ in range(self.num_strata)]
        for rnd in self.rounds(epoch):
            rng = np.random.default_rng([self.seed, epoch, rank, rnd.index, *self.salt])
            plan = np.empty(rnd.schedule.shape, dtype=np.int64)
            carried_in = np.concatenate(carry)
            for s in range(self.num_strata):
                slots = rnd.schedule == s
                take = int(slots.sum())
                pool = np.concatenate([carry[s], *(own[p].ids(s) for p in rnd.positions)])
                pool = pool[rng.permutation(len(pool))]
                plan[slots] = pool[:take]
                carry[s] = pool[take:]
            yield RoundPlan(rnd, [own[p].shard for p in rnd.positions], plan, carried_in, np.concatenate(carry))


class ShardReader:
    """Reads this split's shards one at a time (each checked against the manifest) and gathers
    the rows of given sample ids from them."""

    def __init__(self, data_dir: str | Path, manifest: dict):
        self.paths = shard_format.shard_paths(data_dir, manifest, "train")
        self.entries = manifest["splits"]["train"]["shards"]
        self.seq_len, self.num_strata = manifest["seq_len"], manifest["num_strata"]

    def load(self, shard: int) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
        """A shard's arrays and, per stratum, its rows in order (the ordinals of sample ids)."""
        arrays = load_arrays([self.paths[shard]], [self.entries[shard]["sha256"]])
        strata = shard_format.stratum_of(arrays["lengths"], self.seq_len, self.num_strata)
        rows = [np.flatnonzero(strata == s) for s in range(self.num_strata)]
        if [len(r) for r in rows] != list(self.entries[shard]["strata_counts"]):
            raise DataError(f"shard {self.paths[shard]} holds other length strata than its manifest says; "
                            f"re-run bert-data-prep shards and check with bert-data-prep inspect --verify")
        return arrays, rows

    def gather(self, ids: np.ndarray, kept: tuple[np.ndarray, dict] | None = None) -> dict[str, np.ndarray]:
        """The rows of `ids` (sorted, unique), taken from `kept` (ids, arrays of an earlier
        gather) where it has them and from their shards otherwise, one shard in memory at a time."""
        out: dict[str, np.ndarray] = {}

        def put(where: np.ndarray, source: dict[str, np.ndarray], rows: np.ndarray) -> None:
            for key, array in source.items():
                if key not in out:
                    out[key] = np.empty((len(ids), *array.shape[1:]), dtype=array.dtype)
                out[key][where] = array[rows]

        todo = np.ones(len(ids), dtype=bool)
        if kept is not None and len(kept[0]):
            found = np.isin(ids, kept[0])
            put(np.flatnonzero(found), kept[1], np.searchsorted(kept[0], ids[found]))
            todo &= ~found
        shards = ids >> ID_SHARD
        for shard in np.unique(shards[todo]):
            where = np.flatnonzero(todo & (shards == shard))
            arrays, rows = self.load(int(shard))
            strata = (ids[where] >> ID_STRATUM) & ((1 << (ID_SHARD - ID_STRATUM)) - 1)
            ordinals = ids[where] & ((1 << ID_STRATUM) - 1)
            starts = np.concatenate([[0], np.cumsum([len(r) for r in rows])[:-1]])
            put(where, arrays, np.concatenate(rows)[starts[strata] + ordinals])
            del arrays
        return out


class BatchMaker:
    """Turns sample indices into a model batch (trimmed; masked here when the shards are not)."""

    def __init__(self, arrays: dict[str, np.ndarray], manifest: dict, vocab: Vocab, seed: int, static: bool,
                 mask_prob: float | None = None):
        self.arrays, self.static, self.seed = arrays, static, seed
        self.seq_len = manifest["seq_len"]
        args = manifest.get("args", {})
        if mask_prob is None:  # the rate the shards were prepared for
            self.mask_prob = args.get("mask_prob", MASK_PROB)
            self.max_predictions = manifest.get("max_predictions") or int(np.ceil(self.mask_prob * self.seq_len))
        else:  # another rate (dynamic shards only): the prediction cap follows it
            self.mask_prob, self.max_predictions = mask_prob, int(np.ceil(mask_prob * self.seq_len))
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
            selected = select_rows(input_ids, lengths, rng=rng, mask_prob=self.mask_prob,
                                   max_predictions=self.max_predictions, is_special=self.is_special,
                                   continuation=self.continuation)
            input_ids, rows, cols = mask_selected(input_ids, selected, rng=rng, mask_id=self.mask_id,
                                                  replacement_ids=self.replacement_ids)
            flat, labels = rows * width + cols, self.arrays["input_ids"][indices[rows], cols]
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention),
            "token_type_ids": torch.from_numpy(segments),
            "next_sentence_labels": torch.from_numpy(self.arrays["next_sentence_labels"][indices].astype(np.int64)),
            "masked_index": torch.from_numpy(flat.astype(np.int64)),
            "masked_labels": torch.from_numpy(labels.astype(np.int64)),
            "real_tokens": torch.tensor(int(lengths.sum())),
        }


class _DealtBatches(Dataset):
    """A round's micro-batches that this rank trains: item (unit, j) is micro-batch j of the
    epoch in unit `unit`'s plan, masked by the unit's generator key (the same whoever trains it)."""

    def __init__(self, units: list[tuple[BatchMaker, np.ndarray, tuple[int, ...]]], items: list[tuple[int, int]],
                 first: int):
        self.units, self.items, self.first = units, items, first

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        unit, j = self.items[i]
        maker, rows, key = self.units[unit]
        return maker(rows[j - self.first], (*key, j))


def _start_worker(_worker_id: int) -> None:
    """Loader workers outlive a stop signal: the trainer finishes its step and saves a
    checkpoint, and a dead worker would abort it (the launcher signals the whole tree). And a
    worker whose rank can no longer take its batches (the rank out of file descriptors, or gone)
    stays quiet: multiprocessing's thread that hands a batch's file descriptors over reports the
    broken pipe through sys.excepthook, a traceback on the terminal beside the rank's own line,
    which names the cause."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    report = sys.excepthook

    def quiet_when_the_rank_is_gone(kind, value, traceback):
        if not issubclass(kind, (BrokenPipeError, ConnectionResetError)):
            report(kind, value, traceback)

    sys.excepthook = quiet_when_the_rank_is_gone


SHARDS_IN_MEMORY = 2


@dataclass(frozen=True)
class Layout:
    """How an epoch's samples are dealt: ranks, micro-batch, shard window and the shard dealing
    (each changes the plan), and how many micro-batches a rank trained under it."""
    world: int
    micro_batch: int
    shards_in_memory: int
    batches: int = 0
    dealing: str = "whole"

    def deals_as(self, other: "Layout") -> bool:
        return (self.world, self.micro_batch, self.shards_in_memory, self.dealing) == \
            (other.world, other.micro_batch, other.shards_in_memory, other.dealing)


class TrainingBatches:
    """Endless micro-batches over epochs, streamed a round of shards at a time (`StreamPlan`),
    with a position that checkpoints save and restore: the epoch, the micro-batch within it, and
    the layouts (world size, micro-batch, shard window) under which earlier launches trained
    parts of the same epoch. A relaunch under another layout goes on with the samples the epoch
    has not trained (by samples consumed, not by batch index, which means other samples under
    another layout), so none is repeated or skipped. A rank holds the arrays of at most
    `shards_in_memory` of its shards (plus the one being read, and the few samples carried
    between rounds); 0 holds all of them."""

    def __init__(self, data: ShardSet, rank: int, world: int, micro_batch: int, seed: int, num_workers: int,
                 shards_in_memory: int = SHARDS_IN_MEMORY, mask_prob: float | None = None, dealing: str = "whole"):
        manifest = data.manifest
        self.where = str(data.path)
        self.stream = StreamPlan(manifest, rank, world, micro_batch, seed, shards_in_memory, self.where,
                                 dealing=dealing)
        self.reader = ShardReader(data.path, manifest)
        # every shard this rank will read, checked now: a missing or changed one stops the launch
        # in one line from every rank, before a step, not one rank hours later (each is checked
        # again when its round loads it)
        for share in self.stream.shares[rank]:
            check_shard_file(self.reader.paths[share.shard], self.reader.entries[share.shard]["sha256"])
        self.manifest, self.vocab = manifest, Vocab.load(data.vocab_path)
        self.static = manifest["splits"]["train"]["masking"] == "static"
        self.rank, self.seed, self.num_workers = rank, seed, num_workers
        self.layout = Layout(world, micro_batch, shards_in_memory, dealing=dealing)
        self.mask_prob = mask_prob  # None: the shards' own rate
        self.epoch, self.batch = 0, 0
        self.earlier: list[Layout] = []  # the epoch's earlier layouts, each with the batches it trained
        self._remaining: tuple[tuple, StreamPlan] | None = None
        self.deal: Deal | None = None  # who trains which micro-batch of a step (None: each its own)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch, "layout": vars(self.layout),
                "earlier": [vars(layout) for layout in self.earlier]}

    def load_state_dict(self, state: dict) -> str | None:
        """Go on from a saved position; under another layout than the saved one, with the epoch's
        untrained samples, and one line that says so (None otherwise)."""
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self.earlier = [self._saved_layout(layout) for layout in state.get("earlier", [])]
        saved = self._saved_layout(state["layout"]) if "layout" in state else self.layout  # older checkpoints: as before
        if saved.deals_as(self.layout):
            return None
        self.earlier.append(dataclasses.replace(saved, batches=self.batch))
        self.batch = 0
        done = sum(layout.batches * layout.world * layout.micro_batch for layout in self.earlier)
        return (f"data: {done:,} samples of epoch {self.epoch} trained on {saved.world} rank(s) × micro-batch "
                f"{saved.micro_batch}{' (every shard split by samples)' if saved.dealing == 'split' else ''}; "
                f"the rest of the epoch is dealt to {self.layout.world} rank(s) × micro-batch "
                f"{self.layout.micro_batch} (no sample repeated or skipped), the next epochs as a fresh run's")

    def _saved_layout(self, saved: dict) -> Layout:
        """A checkpoint's layout; one saved before shards were dealt whole dealt them as it did."""
        return Layout(**{"dealing": deal_as_saved(self.manifest, saved["world"]), **saved})

    def current_stream(self) -> StreamPlan:
        """The plan of the current epoch under this layout: the whole epoch's, or, after earlier
        layouts in it, that of the samples they did not train."""
        if not self.earlier:
            return self.stream
        key = (self.epoch, tuple(self.earlier))
        if self._remaining is None or self._remaining[0] != key:
            consumed, left = np.zeros(0, dtype=np.int64), None
            for k, layout in enumerate(self.earlier):
                taken = [StreamPlan(self.manifest, r, layout.world, layout.micro_batch, self.seed,
                                    layout.shards_in_memory, self.where, left, k, layout.dealing)
                         .trained(self.epoch, layout.batches) for r in range(layout.world)]
                consumed = np.union1d(consumed, np.concatenate(taken))
                left = samples_left(self.manifest, consumed)
            self._remaining = key, StreamPlan(self.manifest, self.rank, self.layout.world, self.layout.micro_batch,
                                              self.seed, self.layout.shards_in_memory, self.where, left,
                                              len(self.earlier))
        return self._remaining[1]

    def round_arrays(self, rnd: RoundPlan, kept: tuple[np.ndarray, dict] | None) -> tuple[np.ndarray, dict]:
        """The round's samples (those it trains and those it carries on), sorted by id."""
        ids = np.unique(np.concatenate([rnd.plan.ravel(), rnd.carried_out]))
        return ids, self.reader.gather(ids, kept)

    def set_deal(self, deal: Deal | None) -> None:
        """Train the micro-batches `deal` gives this rank (data/deal.py), from the next iteration
        on, which must start at a step's boundary; None: this rank's own stream, all of it. The
        shards of the other ranks' micro-batches it takes are checked now, as its own were."""
        if deal is not None and deal.world != self.layout.world:
            raise DataError(f"a deal for {deal.world} ranks cannot deal the micro-batches of {self.layout.world}")
        self.deal = None if deal is None or deal.is_equal() else deal
        for unit, _, _ in self.units():
            if unit != self.rank:
                for share in self.stream.shares[unit]:
                    check_shard_file(self.reader.paths[share.shard], self.reader.entries[share.shard]["sha256"])

    def units(self) -> list[tuple[int, int, int]]:
        """(unit, first, end): the ranks' streams this rank trains micro-batches first..end-1 of in
        every step, its own last (all of its own under the equal split)."""
        return [(self.rank, 0, 1)] if self.deal is None else self.deal.taken(self.rank)

    def micro_batches_per_step(self, accumulation: int) -> int:
        return accumulation if self.deal is None else self.deal.counts()[self.rank]

    def rounds(self, units: list[int]):
        """The rounds from the current position on, endlessly (an epoch's last few samples, fewer
        than a micro-batch per rank, untrained): per round, the RoundPlan of each of `units`
        (the same rounds in every rank's stream), the generator keys of their batches' masks and
        whether the round before it was skipped."""
        while True:
            stream = self.current_stream()
            keys = [(self.epoch, unit, *([len(self.earlier)] if self.earlier else [])) for unit in units]
            skipped = False
            for plans in zip(*(stream.plans(self.epoch, unit) for unit in units)):
                first, batches = plans[0].round.first_batch, plans[0].round.batches
                if self.batch >= first + batches and (batches or self.batch > first):
                    skipped = True  # a resumed run skips the rounds it trained; gather finds their carry
                    continue
                yield plans, keys, skipped
                skipped = False
            self.epoch, self.batch, self.earlier = self.epoch + 1, 0, []

    def dealt_rounds(self):
        """Per round: its plans and keys, and the (unit index, j) items this rank trains in it,
        in order: micro-batch j of every unit it takes, for each j in turn. The iteration starts
        at a step's boundary, so micro-batch j is the step's ((j - start) mod a)-th of each unit."""
        units = self.units()
        accumulation = 1 if self.deal is None else self.deal.accumulation
        passed = 0  # micro-batches of a unit since the iteration began
        for plans, keys, skipped in self.rounds([unit for unit, _, _ in units]):
            first, end = plans[0].round.first_batch, plans[0].round.first_batch + plans[0].round.batches
            start = max(self.batch, first)
            items = [(k, j) for j in range(start, end) for k, (_, lo, hi) in enumerate(units)
                     if self.deal is None or lo <= (passed + j - start) % accumulation < hi]
            passed += end - start
            yield plans, keys, skipped, items

    def sample_ids(self):
        """The ids of each micro-batch's samples, in training order, without reading a shard (what
        __iter__ trains; for checks of the data order)."""
        for plans, _, _, items in self.dealt_rounds():
            first = plans[0].round.first_batch
            for k, j in items:
                self.batch = j + 1
                yield plans[k].plan[j - first]
            self.batch = first + plans[0].round.batches

    def __iter__(self):
        kept = {}  # per unit, the samples carried out of its previous round, with their arrays
        for plans, keys, skipped, items in self.dealt_rounds():
            units = []
            for rnd, key in zip(plans, keys):
                unit = key[1]
                if skipped or rnd.round.index == 0:
                    kept[unit] = None
                ids, arrays = self.round_arrays(rnd, kept.get(unit))
                maker = BatchMaker(arrays, self.manifest, self.vocab, self.seed, self.static, self.mask_prob)
                units.append((maker, np.searchsorted(ids, rnd.plan), key, ids, arrays))
            first = plans[0].round.first_batch
            dataset = _DealtBatches([u[:3] for u in units], items, first)
            # its own generator: a loader drawing its worker seed from the global RNG would shift
            # dropout after a resume, which creates the loader at another point of the run
            loader = DataLoader(dataset, batch_size=None, shuffle=False, num_workers=self.num_workers,
                                prefetch_factor=4 if self.num_workers else None,
                                generator=torch.Generator().manual_seed(self.seed),
                                worker_init_fn=_start_worker)
            for (_, j), batch in zip(items, loader):
                self.batch = j + 1
                yield batch
            self.batch = first + plans[0].round.batches
            for rnd, (_, _, key, ids, arrays) in zip(plans, units):
                carried_ids = np.sort(rnd.carried_out)
                carried = np.searchsorted(ids, carried_ids)
                kept[key[1]] = (carried_ids, {k: v[carried] for k, v in arrays.items()})
            del loader, dataset, units


class ValidationBatches:
    """This rank's part of the held-out split (statically masked), in length order, as batches
    made when iterated. The split grows with the data set (1% of documents by default), so a
    rank keeps only its 1/world of the samples, in the shards' compact dtypes, and reads the
    shards one at a time to pick them out, never the whole split at once."""

    def __init__(self, data: ShardSet, rank: int, world: int, micro_batch: int):
        self.micro_batch, self.orders, self.maker = micro_batch, np.zeros(0, dtype=np.int64), None
        manifest = data.manifest
        split = manifest["splits"]["validation"]
        if not split["shards"] or split["samples"] == 0:
            return
        paths = shard_format.shard_paths(data.path, manifest, "validation")
        digests = [entry["sha256"] for entry in split["shards"]]
        sizes = [entry["samples"] for entry in split["shards"]]
        lengths = []
        for path in paths:
            check_shard_file(path, None)
            try:
                lengths.append(shard_format.read_shard(path, keys=())[shard_format.LENGTHS_KEY])
            except shard_format.ShardFormatError as exc:
                raise DataError(str(exc)) from exc
        mine = np.argsort(np.concatenate(lengths), kind="stable")[rank::world]  # global ids, length order
        kept_ids = np.sort(mine)  # kept rows in the shards' order: batches as a whole-split load made them
        starts = np.cumsum([0, *sizes])
        kept: dict[str, np.ndarray] = {}
        for k, path in enumerate(paths):
            inside = (kept_ids >= starts[k]) & (kept_ids < starts[k + 1])
            if not inside.any():
                continue
            arrays = load_arrays([path], [digests[k]])
            for key, values in arrays.items():
                if key not in kept:
                    kept[key] = np.empty((len(kept_ids), *values.shape[1:]), dtype=values.dtype)
                kept[key][inside] = values[kept_ids[inside] - starts[k]]
            del arrays
        self.orders = np.searchsorted(kept_ids, mine)
        self.maker = BatchMaker(kept, manifest, Vocab.load(data.vocab_path), seed=0, static=True)

    def __len__(self) -> int:
        return -(-len(self.orders) // self.micro_batch)

    def __iter__(self):
        for i in range(0, len(self.orders), self.micro_batch):
            yield self.maker(self.orders[i:i + self.micro_batch], ())
