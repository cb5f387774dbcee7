"""One evaluation of a model on a task of any family: every seed of each arm (pretrained, and
random init when asked), each at its chosen rate, beside the family's baselines (classification:
the majority class, the bag of words, the linear probe; QA: the sliding window; tagging: the
majority tag); the result object of `bert-finetune --json`. Shared by the CLI and `--watch`.
Each family is a `Family` of hooks (FAMILIES), so the selection, the seeds and the arms are
written once."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from commodity_bert.finetune import models, qa, tagging, tasks, trainer
from commodity_bert.finetune.models import ModelError, Pretrained
from commodity_bert.finetune.tasks import Task, TaskError


def classification_baselines(pretrained: Pretrained, task: Task, train, dev, fit_rows, held_rows, hp, seeds,
                             device) -> dict:
    """The majority class, the bag of words, the linear probe on frozen features and the
    representation check (baselines.py), beside a classifier's arms."""
    from commodity_bert.finetune import baselines, metrics
    majority_label = tasks.majority_label(task)
    positive = task.label_names.index(task.positive_label) if task.positive_label is not None else None

    def score(predicted, gold):
        return metrics.score(task.metric, predicted, gold, len(task.label_names), positive)

    pad_id = pretrained.tokenizer.pad_token_id or 0
    cosine, probe = {}, {}
    for name, from_random in (("pretrained", False), ("random_init", True)):
        trainer.seed_everything(seeds[0])
        encoder = models.classifier(pretrained, len(task.label_names), from_random, hp.dropout, hp.pooling,
                                    hp.reinit_layers)
        encoder.to(device)
        features = baselines.pooled_features(encoder, train, pad_id, device)  # encoded once for both
        dev_features = baselines.pooled_features(encoder, dev, pad_id, device)
        cosine[name] = baselines.mean_cosine(features[:baselines.COLLAPSE_INPUTS])
        probe[name] = baselines.linear_probe(features, train.labels, dev_features, dev.labels, fit_rows, held_rows,
                                             score)
    return {"majority": {"label": str(majority_label), "value": trainer.majority(task, dev, majority_label)},
            "bag_of_words": baselines.bag_of_words(task, fit_rows, held_rows, score),
            "linear_probe": probe,
            "representations": {"mean_cosine": cosine["pretrained"], "random_init_mean_cosine": cosine["random_init"],
                                "collapsed": baselines.collapsed(cosine["pretrained"], cosine["random_init"])},
            "labels": [str(n) for n in task.label_names],
            "positive_label": None if task.positive_label is None else str(task.positive_label)}


@dataclass(frozen=True)
class Family:
    """A task family's hooks: `encode(task, tokenizer, hp, cache_dir)` → (train, dev, from
    cache), whose splits have `labels` (selection's strata) and `subset(rows)`;
    `finetune(pretrained, task, train, dev, seed, hp, device, random_init, progress, label)` →
    {seed, value, ...}; `baselines(...)` → the result's baseline entries. evaluate() runs any
    family the same way: selection, seeds, arms, baselines."""
    encode: Callable
    finetune: Callable
    baselines: Callable


def _encode_classification(task, tokenizer, hp, cache_dir):
    return trainer.encode(task, tokenizer, hp.max_seq_len, cache_dir)


def _model_free(baselines):
    return lambda pretrained, task, train, dev, *rest: baselines(task, train, dev)


FAMILIES = {"classification": Family(_encode_classification, trainer.finetune, classification_baselines),
            "qa": Family(qa.encode, qa.finetune, _model_free(qa.baselines)),
            "tagging": Family(tagging.encode, tagging.finetune, _model_free(tagging.baselines))}


def evaluate(pretrained: Pretrained, task, hp, seeds: list[int], device, cache_dir: Path | None,
             random_init: bool, progress: bool = True, lr_grid: list[float] | None = None, lr_folds: int = 1) -> dict:
    """Fine-tune over every seed (and the random-init baseline), each arm at its own chosen lr
    when hp.lr is None (auto); the result object of --json."""
    import torch

    from commodity_bert.finetune import selection
    started = time.perf_counter()
    family = FAMILIES[task.family]
    positions = pretrained.config.max_position_embeddings
    if hp.max_seq_len > positions:
        raise ModelError(f"--max-seq-len {hp.max_seq_len}: the model {pretrained.path} has {positions} positions; "
                         f"give --max-seq-len {positions} or less")
    train, dev, from_cache = family.encode(task, pretrained.tokenizer, hp, cache_dir)
    # the slice selection scores on: training rows only, the same for every arm
    fit_rows, held_rows = selection.held_out_slice(train.labels)
    if hp.lr is None and not held_rows:
        raise TaskError(f"--lr auto: {task.name}'s {len(train)} training examples leave none to hold out for "
                        f"choosing the rate; give --lr, or more examples")
    grid = lr_grid or selection.default_grid(pretrained.config.hidden_size)
    splits = selection.folds(train.labels, lr_folds) if lr_folds > 1 else [(fit_rows, held_rows)]
    rows = {}
    for name, from_random in (("pretrained", False),) + ((("random_init", True),) if random_init else ()):
        lr, trials = hp.lr, None
        if lr is None:
            lr, trials = selection.select_lr(pretrained, task, train, hp, grid, seeds[0], device, from_random,
                                             progress, name, splits, family.finetune)
        chosen = replace(hp, lr=lr)
        per_seed = [family.finetune(pretrained, task, train, dev, seed, chosen, device, from_random, progress)
                    for seed in seeds]
        rows[name] = {**trainer.summarise(per_seed), "lr": lr,
                      "lr_selection": None if trials is None else {f"{k:g}": v for k, v in trials.items()}}
        if "exact_match" in per_seed[0]:  # QA: its second metric, summarised as the first
            rows[name]["exact_match"] = {k: v for k, v in trainer.summarise(
                [{"value": r["exact_match"]} for r in per_seed]).items() if k != "per_seed"}
    truncated = sum(len(ids) >= hp.max_seq_len for ids in train.input_ids) / max(len(train.input_ids), 1)
    return {"task": task.name, "family": task.family, "metric": task.metric, **rows["pretrained"],
            "model": str(pretrained.path), "train_size": len(train),
            "train_examples": task.source.get("train_examples"), "dev_size": len(dev),
            "seconds": round(time.perf_counter() - started, 1),
            **family.baselines(pretrained, task, train, dev, fit_rows, held_rows, hp, seeds, device),
            "selection": {"held_out": len(held_rows), "folds": lr_folds, "grid": grid if hp.lr is None else None,
                          "seed": seeds[0], "from": "training split"},
            "random_init": rows.get("random_init"),
            "hyperparameters": trainer.hyperparameters_dict(hp), "device": str(device),
            "threads": torch.get_num_threads(), "tokenized_from_cache": from_cache,
            "truncated_fraction": round(truncated, 4), "pretraining": pretrained.provenance, "source": task.source}
