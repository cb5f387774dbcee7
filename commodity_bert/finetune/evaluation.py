"""One evaluation of a model on a task of any family: every seed of each arm (pretrained, and
random init when asked), each at its chosen rate, beside the family's baselines (classification:
the majority class, the bag of words, the linear probe; QA: the sliding window; tagging: the
majority tag); the result object of `bert-finetune --json`. Shared by the CLI and `--watch`.
Each family is a `Family` of hooks (families.py), so the selection, the seeds and the arms are
written once; classification's are here."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from commodity_bert.finetune import models, qa, tagging, tasks, trainer  # noqa: F401  (qa, tagging: their families)
from commodity_bert.finetune.families import FAMILIES, Family, register_family
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


def _encode_classification(task, tokenizer, hp, cache_dir):
    return trainer.encode(task, tokenizer, hp.max_seq_len, cache_dir)


def _classification_from_files(args) -> Task:
    if args.glue is not None:
        return tasks.from_glue(args.glue[0], Path(args.glue[1]), args.positive_label, args.metric)
    return tasks.from_files(args.train, args.validation, args.text_field, args.text_pair_field, args.label_field,
                            args.metric or "accuracy", args.positive_label)


CLASSIFICATION_ONLY = {"text_pair_field": "--text-pair-field", "metric": "--metric", "positive_label": "--positive-label",
                       "glue": "--glue"}


def _classification_flags(args) -> list[str]:
    given = [flag for name, flag in CLASSIFICATION_ONLY.items() if getattr(args, name, None) is not None]
    given += ["--head-init probe"] if getattr(args, "head_init", None) == "probe" else []
    return given + ([f"--pooling {args.pooling}"] if getattr(args, "pooling", "mean") != "mean" else [])


def _classification_texts(task: Task) -> list[list[str]]:
    return [[text] + ([pair] if pair else []) for text, pair in
            zip(task.train.texts, task.train.pairs or [None] * len(task.train.texts))]


def collapse_warning(result: dict) -> str | None:
    rep = result.get("representations") or {}
    if not rep.get("collapsed"):
        return None
    return (f"warning: the pretrained model tells its inputs apart no better than random weights (mean cosine "
            f"{rep['mean_cosine']:.3f} between the inputs' mean-pooled states; random init "
            f"{rep['random_init_mean_cosine']:.3f}): its pretraining looks collapsed onto the unigram plateau "
            f"(train.py's plateau warning names the likely causes)")


def _classification_report(result: dict) -> list[str]:
    bow = result["bag_of_words"]
    lines = [f"{'bag of words':<24}{100 * bow['value']:>7.1f}%   (logistic regression on word counts, C {bow['C']:g})"]
    probe = result.get("linear_probe")
    if probe:
        lines.append(f"{'linear probe (frozen)':<24}{100 * probe['pretrained']['value']:>7.1f}%   (logistic regression "
                     f"on the frozen mean-pooled features; random init's {100 * probe['random_init']['value']:.1f}%)")
    label = f"majority ({result['majority']['label']})"
    lines.append(f"{label[:24]:<24}{100 * result['majority']['value']:>7.1f}%")
    rep = result["representations"]
    lines.append(f"representations: mean cosine between inputs {rep['mean_cosine']:.3f} (random init "
                 f"{rep['random_init_mean_cosine']:.3f})")
    warning = collapse_warning(result)
    return lines + ([warning] if warning else [])


register_family(Family(
    "classification", "classification", _encode_classification, trainer.finetune, classification_baselines,
    from_files=_classification_from_files, sample_train=tasks.sample_train, embedded=tasks.EMBEDDED,
    own_flags=_classification_flags, min_steps=200, units="examples", stratified=True,
    head=lambda hp: f"{hp['pooling']} pooling", train_texts=_classification_texts,
    report_lines=_classification_report,
    no_model_baseline=lambda r: (r["bag_of_words"]["value"], "bag of words") if r.get("bag_of_words") else None))


def evaluate(pretrained: Pretrained, task, hp, seeds: list[int], device, cache_dir: Path | None,
             random_init: bool, progress: bool = True, lr_grid: list[float] | None = None, lr_folds: int = 1,
             steps_grid: list[int] | None = None, early_stopping: bool = False) -> dict:
    """Fine-tune over every seed (and the random-init baseline), each arm at its own chosen lr
    when hp.lr is None (auto), and with `early_stopping` its own number of steps, chosen with
    the rate from `steps_grid` (default: selection.default_lengths); the result object of
    --json."""
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
    full = trainer.total_steps(len(train.input_ids), hp)  # steps count units: rows, a QA family's windows
    lengths = (steps_grid or selection.default_lengths(full)) if early_stopping else [full]
    rows = {}
    for name, from_random in (("pretrained", False),) + ((("random_init", True),) if random_init else ()):
        lr, steps, trials = hp.lr, hp.steps, None
        if lr is None:
            lr, steps, trials = selection.select(pretrained, task, train, hp, grid, lengths, seeds[0], device,
                                                 from_random, progress, name, splits, family.finetune)
        chosen = replace(hp, lr=lr, steps=steps)
        per_seed = [family.finetune(pretrained, task, train, dev, seed, chosen, device, from_random, progress)
                    for seed in seeds]
        rows[name] = {**trainer.summarise(per_seed), "lr": lr, "steps": per_seed[0]["steps"],
                      "lr_selection": None if trials is None else
                      {f"{rate:g}": value for (rate, n), value in trials.items() if n == full} or None,
                      "selection_trials": None if trials is None else
                      [{"lr": rate, "steps": n, "value": value} for (rate, n), value in trials.items()]}
        if "exact_match" in per_seed[0]:  # QA: its second metric, summarised as the first
            rows[name]["exact_match"] = {k: v for k, v in trainer.summarise(
                [{"value": r["exact_match"]} for r in per_seed]).items() if k != "per_seed"}
    truncated = sum(len(ids) >= hp.max_seq_len for ids in train.input_ids) / max(len(train.input_ids), 1)
    return {"task": task.name, "family": task.family, "task_type": family.task_type, "metric": task.metric,
            **rows["pretrained"],
            "model": str(pretrained.path), "train_size": len(train),
            "train_examples": task.source.get("train_examples"), "dev_size": len(dev),
            "seconds": round(time.perf_counter() - started, 1),
            **family.baselines(pretrained, task, train, dev, fit_rows, held_rows, hp, seeds, device),
            # what was selected; a fixed rate selects nothing (folds 1, as results before the folds read)
            "selection": {"held_out": len(held_rows), "folds": lr_folds if hp.lr is None else 1,
                          "grid": grid if hp.lr is None else None,
                          "steps_grid": lengths if hp.lr is None else None,
                          "early_stopping": early_stopping and hp.lr is None,
                          "seed": seeds[0], "from": "training split"},
            "random_init": rows.get("random_init"),
            "hyperparameters": trainer.hyperparameters_dict(hp), "device": str(device),
            "threads": torch.get_num_threads(), "tokenized_from_cache": from_cache,
            "truncated_fraction": round(truncated, 4), "pretraining": pretrained.provenance, "source": task.source}
