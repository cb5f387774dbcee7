"""The variants of an ablation: whole config files, or one base config with dotted keys varied
over a grid. Each variant is a complete DeepSpeed config, fitted to the ablation's budget."""
from __future__ import annotations

import copy
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from commodity_bert.run_config import RunConfig
from commodity_bert.train.launch_checks import LaunchError, load_deepspeed_config


class GridError(Exception):
    pass


@dataclass
class Variant:
    name: str
    config: dict
    changes: dict = field(default_factory=dict)  # dotted key → value, against the base
    source: str = ""  # the file it came from


def load_config(path: Path, flag: str) -> dict:
    try:
        return load_deepspeed_config(str(path), flag).given  # a variant's JSON, changed key by key
    except LaunchError as exc:
        raise GridError(str(exc)) from exc


def split_values(text: str) -> list[str]:
    """'1e-3,5e-3' → ['1e-3', '5e-3']; commas inside [...] or {...} stay (betas=[0.9,0.98],[0.9,0.999])."""
    values, depth, current = [], 0, ""
    for char in text:
        if char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        if char == "," and depth == 0:
            values.append(current)
            current = ""
        else:
            current += char
    values.append(current)
    return [v.strip() for v in values]


def parse_value(text: str):
    """JSON where it parses (numbers, true/false, null, lists), else the text as a string ('auto')."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_vary(spec: str) -> tuple[str, list[str]]:
    key, sep, values = spec.partition("=")
    if not sep or not key.strip() or not values.strip():
        raise GridError(f"--vary {spec!r}: write KEY=V1,V2 with a dotted key, e.g. optimizer.params.lr=1e-3,5e-3")
    texts = split_values(values)
    if any(not t for t in texts):
        raise GridError(f"--vary {spec!r}: an empty value; separate values by single commas")
    if len(set(texts)) != len(texts):
        raise GridError(f"--vary {spec!r}: a value is given twice")
    return key.strip(), texts


def set_dotted(config: dict, key: str, value) -> None:
    """config['a']['b'][0] = value for 'a.b.0'; null deletes the key. Missing objects are made."""
    parts = key.split(".")
    node = config
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = node[int(part)]
            continue
        if part not in node:
            node[part] = {}
        elif not isinstance(node[part], (dict, list)):
            raise GridError(f"--vary {key}: {'.'.join(parts[:i + 1])} is {node[part]!r}, not an object")
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    elif value is None:
        node.pop(last, None)
    else:
        node[last] = value


def get_dotted(config: dict, key: str, default=None):
    node = config
    for part in key.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return default
    return node


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "-", text).strip("-")


def from_configs(paths: list[Path]) -> list[Variant]:
    variants = [Variant(safe_name(p.stem), load_config(p, "--configs"), source=str(p)) for p in paths]
    names = [v.name for v in variants]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise GridError(f"--configs: two files are named {repeated[0]}.json; variants are named by file, rename one")
    return variants


LR_KEY, SCHEDULED_LR_KEY = "optimizer.params.lr", "scheduler.params.warmup_max_lr"


def from_vary(base_path: Path, specs: list[str]) -> list[Variant]:
    base = load_config(base_path, "--base")
    axes = [parse_vary(spec) for spec in specs]
    keys = [k for k, _ in axes]
    if len(set(keys)) != len(keys):
        raise GridError("--vary: the same key is given twice; put all its values in one --vary")
    # name each axis by the key's last part, or the whole key where last parts collide
    short = [k.split(".")[-1] for k in keys]
    labels = [s if short.count(s) == 1 else k for s, k in zip(short, keys)]
    variants = []
    for combination in itertools.product(*(texts for _, texts in axes)):
        config = copy.deepcopy(base)
        changes = {}
        for key, text in zip(keys, combination):
            value = parse_value(text)
            set_dotted(config, key, value)
            changes[key] = value
            if key == LR_KEY and SCHEDULED_LR_KEY not in keys and get_dotted(config, SCHEDULED_LR_KEY) is not None:
                # DeepSpeed's warmup schedulers set the lr themselves: varied alone, the
                # optimizer's lr would change nothing
                set_dotted(config, SCHEDULED_LR_KEY, value)
        name = safe_name(base_path.stem + "__" + "__".join(f"{label}={text}"
                                                           for label, text in zip(labels, combination)))
        variants.append(Variant(name, config, changes, str(base_path)))
    return variants


def fit_to_budget(config: dict, steps: int) -> dict:
    """The lr schedule spans the run: DeepSpeed's total_num_steps (and, in proportion, its warmup)
    set to the budget's steps, so every variant decays to its end whatever its batch size."""
    return RunConfig.parse(config).with_schedule(steps)
