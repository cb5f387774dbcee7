"""Task families by name. A family is one registration (`register_family`) that `bert-finetune`'s
flags, its evaluation (selection, seeds, arms, baselines), its report, the results table and the
model card read; none of them names a family of its own. classification registers in
evaluation.py, extractive QA in qa.py, tagging in tagging.py.

A family gives its evaluation hooks, how its tasks are read (its files, its embedded tasks, the
flags only it takes) and how its results are reported; a task object names its family in
`task.family`."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Family:
    name: str                      # as --family and the results say it
    description: str               # in messages: "this flag is for <description>"
    # evaluation: encode(task, tokenizer, hp, cache_dir) -> (train, dev, from cache), whose splits have
    # `labels` (selection's strata) and `subset(rows)`; finetune(pretrained, task, train, dev, seed, hp,
    # device, random_init, progress, label) -> {seed, value, ...}; baselines(pretrained, task, train, dev,
    # fit_rows, held_rows, hp, seeds, device) -> the result's baseline entries
    encode: Callable
    finetune: Callable
    baselines: Callable
    # reading: from_files(args) -> task (--train, --validation and the family's own flags);
    # sample_train(task, n) -> task with n training examples
    from_files: Callable
    sample_train: Callable
    embedded: dict = field(default_factory=dict)         # --task name -> a function that makes the task
    detects: Callable[[Path], bool] | None = None        # the --train file's layout is this family's
    own_flags: Callable = lambda args: []                # the flags given that only this family takes
    min_steps: int = 200           # --min-steps' default
    units: str = "examples"        # what the dev split counts
    stratified: bool = False       # --train-examples samples by label
    head: Callable = lambda hp: ""                       # the head, in the report (hp: the result's dict)
    train_texts: Callable = lambda task: []              # the training texts as documents (lists of lines)
    report_lines: Callable = lambda result: []           # the baselines, in the report
    no_model_baseline: Callable = lambda result: None    # (value, name) for the results table, or None
    task_type: str = "text-classification"               # its Hugging Face task, in the results and the model card


FAMILIES: dict[str, Family] = {}
DEFAULT = "classification"  # where neither --family nor the --train file's layout says


def register_family(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def families() -> list[Family]:
    """Every family, by name (the order in which flags are checked and files recognised)."""
    return sorted(FAMILIES.values(), key=lambda family: family.name)


def embedded_tasks() -> dict[str, Family]:
    """--task name -> its family, over every family."""
    return {name: family for family in families() for name in family.embedded}
