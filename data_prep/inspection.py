"""`bert-data-prep inspect DIR`: what a dataset holds, and with --verify whether it is intact."""
from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import numpy as np

from commodity_bert.data import shard_format
from commodity_bert.data.vocab import Vocab, VocabError

HISTOGRAM_BINS = 8


def _masking_stats(arrays: dict, mask_id: int) -> np.ndarray:
    """Counts of [masked positions, → [MASK], → kept, → random]."""
    positions = arrays["masked_lm_positions"].astype(np.int64)
    originals = arrays["masked_lm_ids"].astype(np.int64)
    # position 0 is always [CLS], never masked: NVIDIA's format pads positions with 0
    real = positions > 0
    shown = np.take_along_axis(arrays["input_ids"].astype(np.int64), positions, axis=1)
    to_mask = (shown == mask_id) & real
    kept = (shown == originals) & real & ~to_mask
    return np.array([real.sum(), to_mask.sum(), kept.sum(), (real & ~to_mask & ~kept).sum()])


def inspect_dataset(data_dir: str, verify: bool = False) -> tuple[dict, list[str]]:
    """Statistics of every split, and (with verify) the problems found."""
    manifest = shard_format.load_manifest(data_dir)
    problems: list[str] = []
    seq_len, num_strata = manifest["seq_len"], manifest["num_strata"]
    vocab_size = manifest["vocab"]["size"]
    mask_id = None
    try:
        vocab = Vocab.load(Path(data_dir) / shard_format.VOCAB_NAME)
        mask_id = vocab.id("[MASK]")
        if vocab.sha256 != manifest["vocab"]["sha256"]:
            problems.append(f"{data_dir}/{shard_format.VOCAB_NAME}: sha256 differs from the manifest's")
    except VocabError as exc:
        problems.append(str(exc))
    report = {"dir": str(data_dir), "seq_len": seq_len, "nsp": manifest["nsp"],
              "masking": manifest["masking"], "vocab_size": vocab_size,
              "strata_bounds": manifest["strata_bounds"], "splits": {}}
    for split, summary in manifest["splits"].items():
        static = summary["masking"] == "static"
        lengths_hist = np.zeros(seq_len + 1, dtype=np.int64)
        mask_counts = np.zeros(4, dtype=np.int64)
        strata_total = np.zeros(num_strata, dtype=np.int64)
        shard_rows, worst_deviation = [], 0.0
        for entry, path in zip(summary["shards"], shard_format.shard_paths(data_dir, manifest, split)):
            if not path.is_file():
                problems.append(f"{path}: missing; re-run bert-data-prep shards with the same arguments")
                continue
            if verify and shard_format.sha256_file(path) != entry["sha256"]:
                problems.append(f"{path}: sha256 differs from the manifest's (corrupt or replaced)")
            try:
                arrays = shard_format.read_shard(path)
            except shard_format.ShardFormatError as exc:
                problems.append(str(exc))
                continue
            lengths = arrays[shard_format.LENGTHS_KEY].astype(np.int64)
            lengths_hist += np.bincount(lengths, minlength=seq_len + 1)[: seq_len + 1]
            strata = np.bincount(shard_format.stratum_of(lengths, seq_len, num_strata), minlength=num_strata)
            strata_total += strata
            if static and mask_id is not None and len(lengths):
                mask_counts += _masking_stats(arrays, mask_id)
            shard_rows.append({"name": entry["name"], "samples": len(lengths),
                               "strata_counts": strata.tolist()})
            if verify:
                problems += shard_format.check_shard_arrays(arrays, where=str(path), seq_len=seq_len,
                                                   static_masking=static, vocab_size=vocab_size)
                if len(lengths) != entry["samples"] or strata.tolist() != entry["strata_counts"]:
                    problems.append(f"{path}: holds {len(lengths)} samples / strata {strata.tolist()}, "
                                    f"manifest says {entry['samples']} / {entry['strata_counts']}")
                if len(lengths) and np.any(np.diff(shard_format.stratum_of(lengths, seq_len, num_strata) * (seq_len + 1)
                                                   + lengths) < 0):
                    problems.append(f"{path}: samples are not ordered by stratum and length")
        samples = int(strata_total.sum())
        tokens = int(np.dot(np.arange(seq_len + 1), lengths_hist))
        shares = (strata_total / samples).tolist() if samples else [0.0] * num_strata
        for row in shard_rows:
            n = row["samples"]
            deviation = max((abs(c - n * s) for c, s in zip(row["strata_counts"], shares)), default=0.0)
            worst_deviation = max(worst_deviation, deviation)
        edges = np.linspace(0, seq_len, HISTOGRAM_BINS + 1).astype(int)
        histogram = [{"lengths": [int(lo) + 1, int(hi)], "samples": int(lengths_hist[lo + 1: hi + 1].sum())}
                     for lo, hi in pairwise(edges)]
        split_report = {
            "shards": len(summary["shards"]), "documents": summary["documents"],
            "samples": samples, "tokens": tokens,
            "padding_fraction": 1 - tokens / (samples * seq_len) if samples else 0.0,
            "length_histogram": histogram,
            "strata_counts": strata_total.tolist(), "strata_shares": shares,
            "shard_sizes": [min((r["samples"] for r in shard_rows), default=0),
                            max((r["samples"] for r in shard_rows), default=0)],
            "max_strata_deviation_samples": worst_deviation,
            "masking": summary["masking"],
        }
        if static and mask_counts[0]:
            split_report["masked_fraction"] = float(mask_counts[0] / tokens)
            split_report["masked_as_mask_token"] = float(mask_counts[1] / mask_counts[0])
            split_report["masked_kept"] = float(mask_counts[2] / mask_counts[0])
            split_report["masked_random"] = float(mask_counts[3] / mask_counts[0])
        report["splits"][split] = split_report
        if verify and (samples != summary["samples"] or strata_total.tolist() != summary["strata_counts"]):
            problems.append(f"{data_dir}: {split} holds {samples} samples, manifest says {summary['samples']}")
    report["problems"] = problems
    return report, problems


def format_report(report: dict) -> str:
    header = (f"{report['dir']}: seq_len {report['seq_len']}, {report['masking']} masking, "
              f"{'NSP pairs' if report['nsp'] else 'full-sentence packing'}, vocab {report['vocab_size']}")
    lines = [header]
    for split, r in report["splits"].items():
        lines.append(f"\n[{split}] {r['shards']} shards ({r['shard_sizes'][0]}–{r['shard_sizes'][1]} samples each), "
                     f"{r['documents']} documents, {r['samples']:,} samples, {r['tokens']:,} tokens, "
                     f"padding {r['padding_fraction']:.1%} at length {report['seq_len']}")
        strata = ", ".join(f"{lo}–{hi}: {share:.1%}" for (lo, hi), share
                           in zip(report["strata_bounds"], r["strata_shares"]))
        lines.append(f"  strata     {strata}; worst shard off by {r['max_strata_deviation_samples']:.2f} samples")
        peak = max((b["samples"] for b in r["length_histogram"]), default=0) or 1
        for b in r["length_histogram"]:
            bar = "#" * round(40 * b["samples"] / peak)
            lines.append(f"  {b['lengths'][0]:>4}–{b['lengths'][1]:<4} {b['samples']:>10,} {bar}")
        if "masked_fraction" in r:
            lines.append(f"  masking    {r['masked_fraction']:.2%} of tokens; [MASK] {r['masked_as_mask_token']:.1%}, "
                         f"kept {r['masked_kept']:.1%}, random {r['masked_random']:.1%}")
        else:
            lines.append("  masking    dynamic (applied during training)")
    return "\n".join(lines)
