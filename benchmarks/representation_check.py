"""bert-finetune's representation check on several models: the mean cosine similarity between
the mean-pooled final states of 256 training inputs of each embedded task, each model beside
its architecture at random init (seed 1), with each run's validation MLM and unigram accuracy.
Calibrates when a model is called collapsed (commodity_bert/finetune/baselines.py).

    python benchmarks/representation_check.py RUN [RUN ...] --json OUT.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from commodity_bert.finetune import baselines, models, tasks, trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for run in args.runs:
        pretrained = models.load(run)
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
        row = {"run": str(run), "step": summary.get("step"), "val_mlm_acc": summary.get("val_mlm_acc"),
               "unigram_acc": summary.get("unigram_acc"), "hidden_size": pretrained.config.hidden_size,
               "vocab_size": pretrained.config.vocab_size}
        for name in tasks.EMBEDDED:
            task = tasks.embedded(name)
            train, _, _ = trainer.encode(task, pretrained.tokenizer, 128, None)
            for arm, random_init in (("pretrained", False), ("random_init", True)):
                trainer.seed_everything(1)
                model = models.classifier(pretrained, len(task.label_names), random_init)
                row[f"{name}/{arm}"] = round(baselines.mean_pairwise_cosine(
                    model, train, pretrained.tokenizer.pad_token_id or 0, "cpu"), 4)
            row[f"{name}/collapsed"] = baselines.collapsed(row[f"{name}/pretrained"], row[f"{name}/random_init"])
        print(json.dumps(row), flush=True)
        rows.append(row)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
