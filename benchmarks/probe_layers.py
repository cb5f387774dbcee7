"""Where a pretrained BERT keeps what a task needs: a linear probe on each layer's frozen,
mean-pooled states, pretrained beside the same architecture at random init.

bert-finetune's linear probe reads the last layer only. When a small, briefly pretrained
model's last layer probes worse than random weights (issue 30 measured it on both embedded
tasks), this says whether the information is gone from the whole encoder or only from the top
layers that masked-LM training turns toward predicting frequent tokens. Same procedure as
bert-finetune (baselines.probe_features): logistic regression on standardised features, C chosen
on the held-out slice of the training split (selection.held_out_slice), scored on dev once.

    python benchmarks/probe_layers.py --model RUN --task embedded:polarity [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from commodity_bert.finetune import baselines, metrics, models, selection, tasks, trainer  # noqa: E402


def layer_features(encoder, data, pad_id: int, batch_size: int = 64) -> list[np.ndarray]:
    """Mean-pooled states of every layer (0 = embeddings), rows in order."""
    order = sorted(range(len(data)), key=lambda i: -len(data.input_ids[i]))
    out = None
    encoder.eval()
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            at = order[start:start + batch_size]
            batch = trainer._collate(data, at, pad_id, "cpu")
            states = encoder.bert(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                                  attention_mask=batch["attention_mask"], output_hidden_states=True).hidden_states
            mask = batch["attention_mask"].unsqueeze(-1).float()
            if out is None:
                out = [np.zeros((len(data), s.shape[-1]), dtype=np.float32) for s in states]
            for layer, s in enumerate(states):
                out[layer][at] = ((s.float() * mask).sum(1) / mask.sum(1)).numpy()
    return out


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
    labels = np.array(train.labels)

    def score(predicted, gold):
        return metrics.score(task.metric, predicted, gold, len(task.label_names), None)

    pad_id = pretrained.tokenizer.pad_token_id or 0
    result = {}
    for arm, from_random in (("pretrained", False), ("random_init", True)):
        trainer.seed_everything(args.seed)
        encoder = models.classifier(pretrained, len(task.label_names), from_random, 0.1, "mean")
        feats, dev_feats = layer_features(encoder, train, pad_id), layer_features(encoder, dev, pad_id)
        result[arm] = [baselines.probe_features(f, labels, d, dev.labels, fit_rows, held_rows, score)
                       for f, d in zip(feats, dev_feats)]
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
