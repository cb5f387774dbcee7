"""What the quickstart's model learned, told honestly: validation MLM accuracy by step beside
the accuracy of always answering the most frequent masked token, then fill-mask probes chosen
before training, printed whatever the model answers.

    python recipes/quickstart_report.py RUN DATA_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from commodity_bert.run_dir import HF_MODEL, METRICS

# Chosen before the quickstart's own run and printed whatever the model answers. The first four
# are what a model of this budget (5 CPU minutes) gets right in trial runs: where a sentence
# starts and ends, the verb after "there" and "this"; the last, a collocation the addresses
# repeat 4,536 times, needs more training than that (docs/quickstart.md).
PROBES = [
    ("[MASK] must do more .", "we"),
    ("we must do more [MASK]", "."),
    ("there [MASK] no doubt .", "is"),
    ("this [MASK] a great nation .", "is"),
    ("the congress of the united [MASK] shall assemble .", "states"),
]


def most_frequent_token_accuracy(data_dir: Path) -> tuple[float, str]:
    """Accuracy of answering the validation set's most frequent masked token everywhere."""
    from commodity_bert.data import shard_format as fmt
    manifest = fmt.load_manifest(data_dir)
    shards = [fmt.read_shard(p) for p in fmt.shard_paths(data_dir, manifest, "validation")]
    labels = np.concatenate([s["masked_lm_ids"][s["masked_lm_positions"] > 0] for s in shards])
    counts = np.bincount(labels.astype(np.int64))
    vocab = (data_dir / fmt.VOCAB_NAME).read_text().splitlines()
    return counts.max() / counts.sum(), vocab[int(counts.argmax())]


def main(run: Path, data_dir: Path) -> None:
    import transformers
    from transformers import pipeline
    transformers.logging.set_verbosity_error()  # the NSP head fill-mask does not use is reported otherwise
    transformers.utils.logging.disable_progress_bar()
    evals = [(r["step"], r["val_mlm_acc"]) for r in map(json.loads, (run / METRICS).read_text().splitlines())
             if "val_mlm_acc" in r]
    baseline, token = most_frequent_token_accuracy(data_dir)
    print("validation MLM accuracy by step:", ", ".join(f"{s}: {a:.1%}" for s, a in evals))
    print(f"always answering the most frequent masked token ({token!r}) would score {baseline:.1%}; "
          f"the model scores {evals[-1][1]:.1%}")
    fill = pipeline("fill-mask", model=str(run / HF_MODEL))
    right = 0
    for phrase, expected in PROBES:
        answers = fill(phrase, top_k=3)
        hit = answers[0]["token_str"] == expected
        right += hit
        print(f"  {'✓' if hit else '✗'} {phrase!r} -> " + ", ".join(f"{a['token_str']} ({a['score']:.2f})"
                                                              for a in answers) + f"   [expected {expected}]")
    print(f"fill-mask probes right: {right} of {len(PROBES)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
