"""Where a pretrained BERT keeps what a task needs: a linear probe on each layer's frozen,
mean-pooled states, pretrained beside the same architecture at random init.

bert-finetune's linear probe reads the last layer only. When a small, briefly pretrained
model's last layer probes worse than random weights (measured on both embedded
tasks: RESULTS.md), this says whether the information is gone from the whole encoder or only from the
top layers that masked-LM training turns toward predicting frequent tokens. Same procedure as
bert-finetune (baselines.pooled_features, baselines.linear_probe): logistic regression on
standardised features, C chosen on the held-out slice of the training split
(selection.held_out_slice), scored on dev once.

    python benchmarks/probe_layers.py --model RUN --task embedded:polarity [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from commodity_bert.finetune import baselines, metrics, models, selection, tasks, trainer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--task", default="embedded:polarity")
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=1, help="of the random-init weights")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    started = time.perf_counter()
    task = tasks.embedded(args.task)
    pretrained = models.load(args.model)
    train, dev, _ = trainer.encode(task, pretrained.tokenizer, args.max_seq_len, None)
    fit_rows, held_rows = selection.held_out_slice(train.labels)

    def score(predicted, gold):
        return metrics.score(task.metric, predicted, gold, len(task.label_names), None)

    pad_id = pretrained.tokenizer.pad_token_id or 0
    result = {}
    for arm, from_random in (("pretrained", False), ("random_init", True)):
        trainer.seed_everything(args.seed)
        encoder = models.classifier(pretrained, len(task.label_names), from_random, 0.1, "mean")
        layers = baselines.pooled_features(encoder, train, pad_id, "cpu", all_layers=True)
        dev_layers = baselines.pooled_features(encoder, dev, pad_id, "cpu", all_layers=True)
        result[arm] = [baselines.linear_probe(f, train.labels, d, dev.labels, fit_rows, held_rows, score)
                       for f, d in zip(layers, dev_layers)]
    print(f"{task.name}: linear probe on each layer's mean-pooled states ({args.model})")
    print(f"{'layer':<8}{'pretrained':>12}{'random init':>13}")
    for layer, (a, b) in enumerate(zip(result["pretrained"], result["random_init"])):
        print(f"{layer:<8}{100 * a['value']:>11.1f}%{100 * b['value']:>12.1f}%")
    if args.json:
        args.json.write_text(json.dumps({"task": task.name, "model": str(args.model), "layers": result,
                                         "provenance": pretrained.provenance, "seed": args.seed,
                                         "machine": {"cpu": platform.processor() or platform.machine(),
                                                     "threads": torch.get_num_threads()},
                                         "seconds": round(time.perf_counter() - started, 1)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
