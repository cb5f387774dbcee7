"""The data path: a rank's training and validation batches (stratified, resumable, bounded in
memory by the shards it streams), and BERT's masking rules, static and dynamic."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import batch_of, run_cli

from commodity_bert.data import shard_format as fmt
from commodity_bert.data.dataset import ShardSet
from commodity_bert.data.loader import (
    ID_STRATUM,
    BatchMaker,
    TrainingBatches,
    ValidationBatches,
    load_arrays,
    rank_shares,
    round_schedule,
    spread_strata,
)
from commodity_bert.data.masking import mask_rows
from commodity_bert.data.vocab import Vocab


def test_batches_are_trimmed_and_masked_like_the_shards(datasets):
    _, batch = batch_of(datasets / "static", range(10))
    width = batch["input_ids"].shape[1]
    longest = int(batch["attention_mask"].sum(1).max())
    assert width % 8 == 0 and longest <= width < longest + 8
    # masked labels sit where the input shows [MASK] most of the time (80/10/10)
    mask_id = Vocab.load(datasets / "static" / "vocab.txt").id("[MASK]")
    shown = batch["input_ids"].view(-1)[batch["masked_index"]]
    assert 0.6 < (shown == mask_id).float().mean() < 0.95


def test_dynamic_masking_is_seeded_perbatch_of(datasets):
    data = datasets / "dynamic"
    manifest = fmt.load_manifest(data)
    arrays = fmt.read_shard(data / "shard_00000.hdf5")
    maker = BatchMaker(arrays, manifest, Vocab.load(data / "vocab.txt"), seed=3, static=False)
    rows = np.arange(64)
    a, b, c = maker(rows, (0, 0, 5)), maker(rows, (0, 0, 5)), maker(rows, (0, 0, 6))
    assert torch.equal(a["input_ids"], b["input_ids"]) and not torch.equal(a["input_ids"], c["input_ids"])
    # BERT's budget per row: 15% of its tokens (at least 1, at most max_predictions) among non-specials
    ids, lengths = arrays["input_ids"][rows], arrays["lengths"][rows].astype(int)
    budget = sum(min(maker.max_predictions, max(1, round(n * maker.mask_prob)),
                     int((~maker.is_special[ids[r, :n]]).sum())) for r, n in enumerate(lengths))
    assert a["masked_labels"].numel() == budget and lengths.sum() >= 300
    assert not np.isin(arrays["input_ids"], [maker.mask_id]).any()  # the shards stay unmasked


def _epoch_plan(batches: TrainingBatches, epoch: int = 0) -> np.ndarray:
    return np.concatenate([r.plan for r in batches.stream.plans(epoch)])


@pytest.mark.parametrize("world, in_memory", [(1, 1), (2, 1), (3, 1), (3, 2), (2, 0)])
def test_every_micro_batch_has_the_same_strata_mix_on_every_rank(datasets, world, in_memory):
    """Streamed a few shards at a time (4 shards; 3 ranks read every W-th sample of every shard)."""
    data = datasets / "static"
    manifest = fmt.load_manifest(data)
    micro = 16
    seen, mixes = [], []
    shares = np.array(manifest["splits"]["train"]["strata_shares"])
    for rank in range(world):
        batches = TrainingBatches(ShardSet.open(data), rank, world, micro, seed=1, num_workers=0, shards_in_memory=in_memory)
        plan = _epoch_plan(batches)
        mixes.append(np.stack([np.bincount((row >> ID_STRATUM) & 15, minlength=len(shares)) for row in plan]))
        # a sample's identity: its token row, read back through the batches the rank trains
        stream, rows = iter(batches), set()
        for _ in range(len(plan)):
            batch = next(stream)
            for ids, n in zip(batch["input_ids"], batch["attention_mask"].sum(1)):
                rows.add(ids[:n].numpy().tobytes())
        assert batches.epoch == 0 and len(plan) * micro - len(rows) < 3  # no sample twice (a rare exact duplicate text aside)
        seen.append(rows)
    # the same number of batches and the same mix in batch r everywhere: no rank waits at a collective
    assert all(np.array_equal(m, mixes[0]) for m in mixes)
    assert (mixes[0].sum(axis=1) == micro).all()
    assert np.abs(mixes[0] - shares * micro).max() < 1 + 1e-9  # every batch within one sample of the shares
    for i in range(world):
        for j in range(i + 1, world):
            assert len(seen[i] & seen[j]) < 3  # disjoint samples
    # every sample trains in the epoch but fewer than a micro-batch per rank (plus shards' differences)
    total = sum(manifest["splits"]["train"]["strata_counts"])
    assert total - sum(len(r) for r in seen) < world * (micro + len(shares)) + 3


@pytest.mark.parametrize("shards, world", [(256, 10), (4, 3), (2, 3), (8, 4)])
def test_whole_shards_are_dealt_and_only_those_left_over_split(shards, world):
    """For any shard count a rank reads ⌊n/W⌋ whole shards and the n mod W left over (not all n):
    every sample goes to exactly one rank, and the ranks' counts in each stratum differ by at most
    two samples (with every shard split from rank 0, rank 0 held one more sample per shard and
    stratum, left untrained each epoch)."""
    totals = np.array([681, 1635, 4502, 14517])  # a stratum's extra samples go to its first shards
    manifest = {"splits": {"train": {"shards": [{"strata_counts": (totals // shards + (k < totals % shards)).tolist()}
                                                for k in range(shards)]}}}
    dealt = [rank_shares(manifest, r, world) for r in range(world)]
    whole, left = shards // world, shards % world
    for shares in dealt:
        read = {share.shard for share in shares}
        assert len(shares) == len(read) == (whole + left if whole else shards)
        assert sum(share.step == 1 for share in shares) == whole
    ids = np.concatenate([share.ids(s) for shares in dealt for share in shares for s in range(4)])
    assert len(ids) == len(np.unique(ids)) == totals.sum()
    counts = np.array([sum(share.counts() for share in shares) for shares in dealt])
    assert (counts.max(axis=0) - counts.min(axis=0) <= 2).all()


def test_a_stratum_too_small_for_one_sample_per_batch_still_trains_every_epoch():
    # shares [.03, .03, .04, .90] at micro-batch 16 rounded to [1, 0, 1, 14] per batch
    counts = np.array([[30, 30, 40, 900], [31, 30, 40, 899]])
    schedule = round_schedule(counts, 16)
    per_stratum = np.bincount(schedule.ravel(), minlength=4)
    assert per_stratum.sum() == len(schedule) * 16 == 992
    assert (per_stratum >= counts.min(axis=0) - 16).all() and per_stratum[1] >= 29  # all but < one batch
    mix = np.stack([np.bincount(row, minlength=4) for row in schedule])
    assert np.abs(mix - np.array([.03, .03, .04, .90]) * 16).max() < 1.1
    assert np.array_equal(spread_strata(per_stratum, 16), schedule)


@pytest.mark.parametrize("in_memory", [1, 0])
def test_an_epoch_of_batches_trains_the_rare_length_stratum(datasets, in_memory):
    """This dataset's stratum 2 holds 0.3% of the samples: 0.09 of a micro-batch of 32, which
    rounding per batch made 0, so those samples never trained; streamed, a round's few are
    carried into the next until they fill their slots."""
    data = datasets / "static"
    manifest = fmt.load_manifest(data)
    rare = int(np.argmin([c if c else np.inf for c in manifest["splits"]["train"]["strata_counts"]]))
    assert 0 < manifest["splits"]["train"]["strata_shares"][rare] * 32 < 0.5
    batches = TrainingBatches(ShardSet.open(data), 0, 1, 32, seed=5, num_workers=0, shards_in_memory=in_memory)
    stream = iter(batches)
    lengths = []
    while batches.epoch == 0:
        batch = next(stream)
        lengths.extend(batch["attention_mask"].sum(1).tolist())
    strata = fmt.stratum_of(np.array(lengths), 64, manifest["num_strata"])
    total = manifest["splits"]["train"]["strata_counts"][rare]
    assert (strata == rare).sum() >= total - 1


@pytest.mark.parametrize("in_memory", [1, 2])
def test_training_batches_resume_at_their_position(datasets, in_memory):
    """Mid-round, at a round's first batch and in the next epoch; with and without a loader worker."""
    data = datasets / "dynamic"

    def batches_from(seed, micro_batch, workers):
        return TrainingBatches(ShardSet.open(data), 0, 1, micro_batch, seed=seed, num_workers=workers,
                               shards_in_memory=in_memory)
    # a seed and micro-batch whose round 0 carries samples into round 1, where two of the
    # positions below resume (whether it does depends on the shards' sizes)
    seed, micro_batch = next((seed, mb) for mb in (8, 7, 6, 5) for seed in range(5, 10)
                             if len(next(iter(batches_from(seed, mb, 0).stream.plans(0))).carried_out))
    first = batches_from(seed, micro_batch, 0)
    rounds = first.stream.rounds(0)
    assert len(rounds) > 1
    epoch_length = first.stream.batches_in_epoch(0)
    stream = iter(first)
    batches = [next(stream) for _ in range(epoch_length + 5)]
    for position, workers in [(4, 1), (rounds[1].first_batch, 0), (rounds[1].first_batch + 3, 1),
                              (epoch_length + 2, 0)]:
        again = batches_from(seed, micro_batch, workers)
        again.load_state_dict({"epoch": position // epoch_length, "batch": position % epoch_length})
        resumed = iter(again)
        for expected in batches[position:position + 3]:
            got = next(resumed)
            assert all(torch.equal(got[k], expected[k]) for k in expected)
    val = list(ValidationBatches(ShardSet.open(data), 0, 1, 8))
    assert val and all(b["masked_labels"].numel() for b in val)  # held-out split is pre-masked


def test_each_rank_holds_only_its_part_of_the_held_out_split(tmp_path, sotu_small):
    """The batches a whole-split load made, from a rank that keeps only its 1/world of the
    samples (read shard by shard): the split grows with the data set."""
    data = tmp_path / "val3"
    run_cli("shards", "--input", sotu_small, "--seq-len", 64, "--dupe-factor", 1, "--val-fraction", 0.2,
            "--num-val-shards", 3, "--num-shards", 2, "--workers", 2, "--output", data)
    manifest = fmt.load_manifest(data)
    digests = [entry["sha256"] for entry in manifest["splits"]["validation"]["shards"]]
    whole = load_arrays(fmt.shard_paths(data, manifest, "validation"), digests)
    order = np.argsort(whole["lengths"], kind="stable")
    maker = BatchMaker(whole, manifest, Vocab.load(data / "vocab.txt"), seed=0, static=True)
    assert len(manifest["splits"]["validation"]["shards"]) == 3 and len(order) > 100
    for world in (1, 3):
        held = 0
        for rank in range(world):
            val = ValidationBatches(ShardSet.open(data), rank, world, 8)
            mine = order[rank::world]
            expected = [maker(mine[i:i + 8], ()) for i in range(0, len(mine), 8)]
            got = list(val)
            assert len(val) == len(got) == len(expected)
            for g, e in zip(got, expected):
                assert g.keys() == e.keys() and all(torch.equal(g[k], e[k]) for k in e)
            assert all(len(a) == len(mine) for a in val.maker.arrays.values())  # its part, no more
            held += len(mine)
        assert held == len(order)


def _tiled_dataset(source: Path, out: Path, num_shards: int, samples_per_shard: int) -> Path:
    """`num_shards` real shards of the source's samples repeated (same text, new files), with
    their manifest: a data set larger than the stream window without preparing more text."""
    manifest = fmt.load_manifest(source)
    arrays = {k: np.concatenate([fmt.read_shard(p)[k] for p in fmt.shard_paths(source, manifest)])
              for k in ("input_ids", "segment_ids", "next_sentence_labels", "lengths",
                        "masked_lm_positions", "masked_lm_ids")}
    seq_len, vocab_size = manifest["seq_len"], manifest["vocab"]["size"]
    records = np.zeros(len(arrays["lengths"]), dtype=fmt.record_dtype(seq_len, manifest["max_predictions"], vocab_size, True))
    records["tokens"], records["length"] = arrays["input_ids"], arrays["lengths"]
    records["segment_a"] = np.where(arrays["segment_ids"].any(1), arrays["segment_ids"].argmax(1), arrays["lengths"])
    records["random_next"] = arrays["next_sentence_labels"]
    records["masked_positions"], records["masked_ids"] = arrays["masked_lm_positions"], arrays["masked_lm_ids"]
    out.mkdir()
    infos = []
    for k in range(num_shards):
        rows = np.arange(k * samples_per_shard, (k + 1) * samples_per_shard) % len(records)
        infos.append(fmt.write_shard(out / fmt.shard_name(k), records[rows], seq_len=seq_len,
                                     num_strata=manifest["num_strata"], static_masking=True, vocab_size=vocab_size,
                                     split="train", vocab_sha256=manifest["vocab"]["sha256"]).to_json())
    train = manifest["splits"]["train"]
    train["shards"] = infos
    train["strata_counts"] = np.sum([i["strata_counts"] for i in infos], axis=0).tolist()
    train["samples"] = sum(train["strata_counts"])
    (out / fmt.MANIFEST_NAME).write_text(json.dumps(manifest))
    (out / fmt.VOCAB_NAME).write_bytes((source / fmt.VOCAB_NAME).read_bytes())
    return out


EPOCH_PEAK_RSS = """
import sys
from commodity_bert.data.dataset import ShardSet
from commodity_bert.data.loader import TrainingBatches
def peak_mb():
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024
data, in_memory = sys.argv[1], int(sys.argv[2])
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on: torch's import peaks higher
start = peak_mb()
batches = TrainingBatches(ShardSet.open(data), 0, 1, 256, seed=1, num_workers=0, shards_in_memory=in_memory)
stream = iter(batches)
while batches.epoch == 0:
    next(stream)
print(peak_mb() - start)
"""


def test_a_ranks_memory_is_bounded_by_the_shards_it_streams_not_the_data_set(datasets, tmp_path):
    """An epoch over 4× the shards (same shard size) in a fresh process: the peak RSS grows by
    less than a quarter of the arrays added when streaming one shard at a time, and by most of
    them with every shard held (the measurement can tell the two apart)."""
    shard_mb = 4
    per_sample = sum(a.itemsize * (a.size // len(a)) for k, a in fmt.read_shard(
        datasets / "static" / "shard_00000.hdf5").items() if k != "input_mask")
    samples = shard_mb * 2**20 // per_sample
    small = _tiled_dataset(datasets / "static", tmp_path / "small", 4, samples)
    large = _tiled_dataset(datasets / "static", tmp_path / "large", 16, samples)

    def peak_mb(data, in_memory):
        out = subprocess.run([sys.executable, "-c", EPOCH_PEAK_RSS, str(data), str(in_memory)], check=True,
                             capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        return float(out.stdout.split()[-1])

    added_mb = 12 * shard_mb
    streamed = peak_mb(small, 1), peak_mb(large, 1)
    held = peak_mb(large, 0)
    print("peak MB above start, streamed small/large and held:", streamed, held)
    assert streamed[1] - streamed[0] < added_mb / 4, (streamed, held)
    assert held - streamed[0] > added_mb / 2, (streamed, held)


def test_masking_keeps_the_budget_and_the_special_tokens():
    rng = np.random.default_rng(1)
    tokens = np.concatenate(([2], rng.integers(1000, 2000, 126), [3]))[None, :].repeat(50, 0)
    is_special = np.zeros(3000, dtype=bool)
    is_special[:5] = True
    masked, positions, originals = mask_rows(tokens, np.full(50, 128), rng=rng, mask_prob=0.15, max_predictions=20,
                                             mask_id=4, is_special=is_special, replacement_ids=np.arange(5, 3000))
    for row in range(50):
        pos = positions[row, :19]
        assert np.all(positions[row, 19:] == 0) and np.all(np.diff(pos) > 0)  # round(128 × 0.15)
        assert 0 not in pos and 127 not in pos
        assert np.array_equal(originals[row, :19], tokens[row, pos])
        assert np.array_equal(np.delete(masked[row], pos), np.delete(tokens[row], pos))
    assert len({tuple(p) for p in positions}) == 50  # every row draws its own


def test_whole_word_masking_takes_words_whole_and_skips_those_that_overshoot():
    """BERT's whole-word rule, for all rows at once: a word's pieces are masked together, the
    budget is never passed, and every word left out is longer than what the budget had left
    (it was skipped, not forgotten); the words chosen vary with the draw."""
    from commodity_bert.data.masking import select_rows

    rng = np.random.default_rng(4)
    is_special = np.zeros(3000, dtype=bool)
    is_special[:5] = True
    continuation = np.zeros(3000, dtype=bool)
    continuation[2000:] = True  # ids 2000+ are '##' pieces
    lengths = rng.integers(6, 129, 3000)
    tokens = np.zeros((len(lengths), 128), dtype=np.int64)
    for row, n in enumerate(lengths):
        body = np.where(rng.random(n - 2) < 0.4, rng.integers(2000, 3000, n - 2), rng.integers(1000, 2000, n - 2))
        tokens[row, :n] = np.concatenate(([2], body, [3]))
    tokens[:, 4] = np.where(lengths > 5, 1, tokens[:, 4])  # a special token inside a run of pieces ends a word
    selected = select_rows(tokens, lengths, rng=rng, mask_prob=0.15, max_predictions=20, is_special=is_special,
                           continuation=continuation)
    budget = np.minimum(20, np.maximum(1, np.round(lengths * 0.15)))
    for row, n in enumerate(lengths):
        words, word = [], []
        for col in range(n):
            if is_special[tokens[row, col]]:
                words, word = words + [word] if word else words, []
            elif continuation[tokens[row, col]] and word:
                word.append(col)
            else:
                words, word = words + [word] if word else words, [col]
        words += [word] if word else []
        taken = [w for w in words if selected[row, w].all()]
        assert all(selected[row, w].all() or not selected[row, w].any() for w in words)
        assert not selected[row, n:].any() and not is_special[tokens[row, selected[row]]].any()
        have = sum(map(len, taken))
        assert have <= budget[row]
        assert all(len(w) > budget[row] - have for w in words if not selected[row, w].any())
    assert selected.sum() > 0.95 * budget.sum()  # skipping leaves little of the budget unused
    again = select_rows(tokens, lengths, rng=rng, mask_prob=0.15, max_predictions=20, is_special=is_special,
                        continuation=continuation)
    assert (again != selected).any(axis=1).mean() > 0.9


def test_mask_rows_follows_mask_sequences_rule_for_every_row():
    """The vectorized static masking of bert-data-prep: the same budget, no special token, sorted
    positions padded with 0, the originals where they were, and the 80/10/10 split overall."""
    rng = np.random.default_rng(2)
    lengths = rng.integers(3, 129, 4000)
    tokens = np.zeros((len(lengths), 128), dtype=np.uint16)
    for row, n in enumerate(lengths):
        tokens[row, :n] = np.concatenate(([2], rng.integers(1000, 2000, n - 2), [3]))
    tokens[:, 7] = np.where(lengths > 8, 0, tokens[:, 7])  # a [PAD]-like special inside some rows
    is_special = np.zeros(3000, dtype=bool)
    is_special[:5] = True
    masked, positions, originals = mask_rows(tokens, lengths, rng=rng, mask_prob=0.15, max_predictions=20,
                                             mask_id=4, is_special=is_special, replacement_ids=np.arange(5, 3000))
    candidates = ((np.arange(128) < lengths[:, None]) & ~is_special[tokens]).sum(1)
    budget = np.minimum(np.minimum(20, np.maximum(1, np.round(lengths * 0.15))), candidates)
    counts = (positions > 0).sum(1)
    assert np.array_equal(counts, budget)
    shown, kept_as_is = [], 0
    for row in range(len(lengths)):
        pos = positions[row, :counts[row]]
        assert np.all(np.diff(pos) > 0) and np.all(positions[row, counts[row]:] == 0)
        assert not is_special[tokens[row, pos]].any() and np.all(pos < lengths[row])
        assert np.array_equal(originals[row, :counts[row]], tokens[row, pos])
        assert np.array_equal(np.delete(masked[row], pos), np.delete(tokens[row], pos))
        shown.extend(masked[row, pos].tolist())
        kept_as_is += int((masked[row, pos] == tokens[row, pos]).sum())
    shown = np.array(shown)
    assert 0.78 < (shown == 4).mean() < 0.82  # [MASK]
    assert 0.09 < kept_as_is / len(shown) < 0.115  # kept (and the few random draws of the same id)


def _trained_ids(batches: TrainingBatches, count: int) -> list[np.ndarray]:
    ids = batches.sample_ids()
    return [next(ids) for _ in range(count)]


@pytest.mark.parametrize("layouts", [
    [(2, 16, 1), (1, 32, 1)],             # half the ranks, the global batch kept
    [(1, 16, 2), (3, 8, 1), (2, 8, 0)],   # more ranks, then fewer, the shard window changed each time
    [(3, 8, 1, "split"), (3, 8, 1)],      # a checkpoint from before whole shards were dealt (4 shards, 3 ranks)
    [(6, 8, 1, "split"), (6, 8, 1)],      # ... and with more ranks than shards
])
def test_a_relaunch_on_another_layout_trains_the_rest_of_the_epoch_once(datasets, layouts):
    """A relaunch under another world size, micro-batch or shard window continues the epoch by the
    samples it consumed: over the resumed epoch each sample trains once, and as many train as in
    an uninterrupted run (all but fewer than a micro-batch per rank and stratum); the next epoch is
    a fresh run's under the new layout. Read as (epoch, batch) under the new layout, the same
    position trains other samples, some a second time."""
    data = datasets / "static"
    manifest = fmt.load_manifest(data)
    strata = manifest["num_strata"]
    total = sum(manifest["splits"]["train"]["strata_counts"])

    def ranks(world, micro, window, dealing="whole"):
        return [TrainingBatches(ShardSet.open(data), r, world, micro, seed=3, num_workers=0, shards_in_memory=window,
                                dealing=dealing) for r in range(world)]

    uninterrupted = ranks(*layouts[0])
    whole = np.concatenate([np.concatenate(_trained_ids(b, b.stream.batches_in_epoch(0))) for b in uninterrupted])
    assert len(np.unique(whole)) == len(whole) and total - len(whole) < layouts[0][0] * (layouts[0][1] + strata)

    trained, state, lines = [], None, []
    for k, layout in enumerate(layouts):
        group = ranks(*layout)
        for b in group:
            if state is not None:
                line = b.load_state_dict(state)
        if state is not None:
            lines.append(line)
        last = k == len(layouts) - 1
        steps = group[0].current_stream().batches_in_epoch(0) if last else 3 + 2 * k
        for b in group:
            trained.extend(_trained_ids(b, steps))
        assert all(b.epoch == 0 for b in group) if not last else True
        state = group[0].state_dict()
        state = json.loads(json.dumps(state))  # as a checkpoint keeps it
        if len(layout) > 3:  # the earlier rule, as a checkpoint of its time saved it: no "dealing"
            del state["layout"]["dealing"]
    resumed = np.concatenate(trained)
    assert len(np.unique(resumed)) == len(resumed)  # none twice
    world, micro = layouts[-1][:2]
    assert total - len(resumed) < world * (micro + strata)  # the last layout's few, as a fresh run leaves
    assert all("the rest of the epoch is dealt to" in line for line in lines)
    assert ("every shard split" in lines[0]) == (len(layouts[0]) > 3)
    # the next epoch: the last layout's own plan, as a fresh run under it deals it
    fresh = ranks(*layouts[-1])
    assert np.array_equal(next(group[0].sample_ids()), next(iter(fresh[0].stream.plans(1))).plan[0])
    assert group[0].epoch == 1 and not group[0].earlier
    if len(layouts[0]) > 3:
        return
    # what main did: the position read as (epoch, batch) under the new layout
    first = ranks(*layouts[0])
    before = np.concatenate([np.concatenate(_trained_ids(b, 3)) for b in first])
    naive = ranks(*layouts[1])
    after = []
    for b in naive:
        b.batch = 3
        after.extend(_trained_ids(b, naive[0].stream.batches_in_epoch(0) - 3))
    assert np.isin(np.concatenate(after), before).any()


def _steps_of(batches: TrainingBatches, accumulation: int, steps: int) -> list[list[bytes]]:
    """Per step, the samples of each micro-batch this rank trains (as bytes, to compare as sets)."""
    ids, per_step = batches.sample_ids(), batches.micro_batches_per_step(accumulation)
    return [[next(ids).tobytes() for _ in range(per_step)] for _ in range(steps)]


def test_a_deal_by_speed_trains_the_equal_splits_micro_batches_in_every_step(datasets):
    """Ranks of unequal speed (data/deal.py) train the same micro-batches a step as the equal split,
    only on other ranks: across an epoch's end, after a relaunch at a step's boundary under another
    deal, and with the same tensors (masks included) as the rank whose stream they come from."""
    from commodity_bert.data.deal import Deal
    data, world, accumulation = datasets / "dynamic", 3, 4

    def ranks(deal=None, state=None):
        group = [TrainingBatches(ShardSet.open(data), r, world, 6, seed=3, num_workers=0, shards_in_memory=1)
                 for r in range(world)]
        for b in group:
            b.set_deal(deal)
            if state:
                b.load_state_dict(state)
        return group

    steps = ranks()[0].stream.batches_in_epoch(0) // accumulation + 3  # into the next epoch, across its end
    equal = [_steps_of(b, accumulation, steps) for b in ranks()]
    by_speed = Deal.from_speeds([1.0, 2.0, 0.5], accumulation)
    assert by_speed.counts() == [4, 7, 1] and by_speed.taken(1) == [(2, 0, 3), (1, 0, 4)]
    fast = ranks(by_speed)
    dealt = [_steps_of(b, accumulation, 5) for b in fast]
    state = fast[0].state_dict()
    assert all(b.state_dict() == state for b in fast)  # every rank at the step's end, as the equal split
    again = ranks(Deal.from_speeds([3.0, 1.0, 1.0], accumulation), json.loads(json.dumps(state)))
    dealt = [steps_before + _steps_of(b, accumulation, steps - 5) for steps_before, b in zip(dealt, again)]
    for step in range(steps):
        whole = sorted(sum((ranks_steps[step] for ranks_steps in equal), []))
        assert sorted(sum((ranks_steps[step] for ranks_steps in dealt), [])) == whole
    assert [len(s[0]) for s in dealt] == [4, 7, 1]
    # rank 1 trains micro-batch j of rank 2's stream, then of its own, for each j in turn:
    # rank 2's first ones, made alike
    mine, theirs = iter(ranks(by_speed)[1]), iter(ranks()[2])
    for _ in range(2):
        got, _, expected = next(mine), next(mine), next(theirs)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
