"""The run's config: a DeepSpeed JSON and its "commodity_bert" block, read once into a `RunConfig`
whose fields every package reads, instead of each repeating `.get` chains over the JSON.

DeepSpeed's own keys (optimizer, scheduler, precision, ZeRO stage, clipping, batch sizes) become
fields here. The project's block, `"commodity_bert": {"head_warmup": {...}, ...}`, is made of
sections, each declared by the package that uses it (`register_section`, next to its code: its
keys, defaults and check); `RunConfig.section(name)` gives one with its defaults filled in, and
`problems()` names an unknown section or key and asks each owner to check its own. DeepSpeed gets
the JSON as the user wrote it, less the project's block (`for_deepspeed`), so that users' configs
stay DeepSpeed's.

Why our own and not DeepSpeed's `DeepSpeedConfig`: that one needs a world size and a device to
parse, and knows nothing of the project's block; this one is read by `bert-plan` and `bert-ablate`
too, on machines with no process group.
"""
from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_BLOCK = "commodity_bert"


def one_spelling(name: str) -> str:
    """A name in one spelling: lower case, without "_" ("OneBitLamb", "onebit_lamb": "onebitlamb")."""
    return str(name).lower().replace("_", "")


class ConfigError(ValueError):
    """A config that cannot be read; the message is the one line to print."""


@dataclass(frozen=True)
class Section:
    """One section of the project's block, declared by its owner: its keys with their defaults
    (a key whose default is None has none: it is absent unless given), and `check`, which gets the
    section as given (defaults filled in) and the whole RunConfig, and returns one line or None."""
    name: str
    defaults: dict
    check: Callable[[dict, "RunConfig"], str | None] = lambda settings, config: None
    # the section as given, for a rehearsal of a few steps (RunConfig.rehearsed): what it starts
    # late started within the first quarter of them; None: the section as it is
    rehearse: Callable[[dict, int], dict] | None = None


SECTIONS: dict[str, Section] = {}


def register_section(name: str, defaults: dict, check: Callable | None = None,
                     rehearse: Callable | None = None) -> Section:
    """Declare section `name` of the project's block (call it where the section's code lives)."""
    SECTIONS[name] = Section(name, defaults, check or (lambda settings, config: None), rehearse)
    return SECTIONS[name]


def _block(value, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f'{what} in the DeepSpeed config must be an object, not {value!r}')
    return value


@dataclass(frozen=True)
class RunConfig:
    """The config as the project reads it. `given` is the JSON as written (never changed)."""
    given: dict
    optimizer_type: str            # as written ("Lamb", "OneBitLamb"), "" when there is no optimizer block
    optimizer_params: dict
    scheduler_type: str | None
    scheduler_params: dict
    precision: str                 # "fp32", "bf16" or "fp16"
    zero_stage: object             # an int when well formed (launch checks refuse the others)
    gradient_clipping: object      # a number when well formed
    micro_batch: object            # train_micro_batch_size_per_gpu, None where not given
    train_batch_size: object
    accumulation: object           # gradient_accumulation_steps, None where not given
    block: dict = field(repr=False)  # the "commodity_bert" block as written

    @classmethod
    def parse(cls, config: dict) -> RunConfig:
        if not isinstance(config, dict):
            raise ConfigError(f"the DeepSpeed config must hold a JSON object, not {type(config).__name__}")
        optimizer = _block(config.get("optimizer"), '"optimizer"')
        scheduler = _block(config.get("scheduler"), '"scheduler"')
        precisions = [name for name, keys in (("bf16", ("bf16", "bfloat16")), ("fp16", ("fp16",)))
                      if any(_block(config.get(key), f'"{key}"').get("enabled") for key in keys)]
        return cls(given=config, optimizer_type=str(optimizer.get("type", "")),
                   optimizer_params=optimizer.get("params", {}) if optimizer.get("params") is not None else {},
                   scheduler_type=scheduler.get("type"),
                   scheduler_params=scheduler.get("params", {}) if scheduler.get("params") is not None else {},
                   precision="+".join(precisions) or "fp32",
                   zero_stage=_block(config.get("zero_optimization"), '"zero_optimization"').get("stage", 0),
                   gradient_clipping=config.get("gradient_clipping", 0.0),
                   micro_batch=config.get("train_micro_batch_size_per_gpu"),
                   train_batch_size=config.get("train_batch_size"),
                   accumulation=config.get("gradient_accumulation_steps"),
                   block=_block(config.get(PROJECT_BLOCK), f'"{PROJECT_BLOCK}"'))

    @classmethod
    def of(cls, config: RunConfig | dict) -> RunConfig:
        """`config` itself, or a JSON dict read (the libraries' callers and tests pass dicts)."""
        return config if isinstance(config, RunConfig) else cls.parse(config)

    @classmethod
    def load(cls, path: str | Path | None, flag: str = "--deepspeed_config") -> RunConfig:
        """The config in `path`, or a ConfigError that names `flag` (the option that gave it)."""
        if not path:
            raise ConfigError(f"{flag} is required: a DeepSpeed JSON config, e.g. ds_configs/cpu_tiny_lamb.json")
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{flag} {path} not found; see ds_configs/ for the shipped configs")
        try:
            config = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{flag} {path} is not valid JSON ({exc})") from exc
        if not isinstance(config, dict):
            raise ConfigError(f"{flag} {path} must hold a JSON object")
        return cls.parse(config)

    # ---- DeepSpeed's keys
    @property
    def optimizer_name(self) -> str:
        """The optimizer's type in one spelling: lower case, without "_" ("OneBitLamb": "onebitlamb")."""
        return one_spelling(self.optimizer_type)

    @property
    def has_scheduler(self) -> bool:
        return self.given.get("scheduler") is not None

    @property
    def total_num_steps(self):
        return self.scheduler_params.get("total_num_steps")

    @property
    def warmup_num_steps(self):
        return self.scheduler_params.get("warmup_num_steps", 0)

    @property
    def bf16(self) -> bool:
        return "bf16" in self.precision

    @property
    def fp16(self) -> bool:
        return "fp16" in self.precision

    @property
    def static_loss_scale(self):
        """fp16's "loss_scale" (0 or absent: dynamic)."""
        return (self.given.get("fp16") or {}).get("loss_scale", 0)

    @property
    def initial_scale_power(self) -> int:
        """fp16's dynamic loss scale starts at 2 to this power (DeepSpeed's default 16)."""
        return (self.given.get("fp16") or {}).get("initial_scale_power", 16)

    # ---- the project's block
    def given_section(self, name: str) -> dict | None:
        """Section `name` as written, None where the block has none."""
        value = self.block.get(name)
        return value if isinstance(value, dict) else None

    def section(self, name: str) -> dict:
        """Section `name` with its owner's defaults filled in (keys defaulting to None left out)."""
        defaults = SECTIONS[name].defaults if name in SECTIONS else {}
        given = self.given_section(name) or {}
        return {**{k: v for k, v in defaults.items() if v is not None}, **given}

    def problems(self) -> str | None:
        """The first problem of the project's block, as one line: a section or key no owner
        declared (a misspelt `bucketwise_clipping` would train without it), then each owner's check.
        The owners must be imported (train/launch_checks.py imports them all)."""
        for name, value in self.block.items():
            if name not in SECTIONS:
                return (f'unknown key "{PROJECT_BLOCK}.{name}" in the DeepSpeed config; '
                        f'the known ones are {", ".join(sorted(SECTIONS))}')
            if not isinstance(value, dict):
                return f'"{PROJECT_BLOCK}.{name}" must be an object, not {value!r}'
            for key in value:
                if key not in SECTIONS[name].defaults:
                    return (f'unknown key "{PROJECT_BLOCK}.{name}.{key}" in the DeepSpeed config; '
                            f'the known ones are {", ".join(sorted(SECTIONS[name].defaults))}')
        for name in self.block:
            if problem := SECTIONS[name].check(self.section(name), self):
                return problem
        return None

    # ---- what DeepSpeed and other runs get
    def for_deepspeed(self, without_optimizer: bool = False, node_local_checkpoints: bool = False,
                      batch: tuple[int, int, int] | None = None) -> dict:
        """The JSON for DeepSpeed: as written, less the project's block (DeepSpeed rejects keys it
        does not know), less the optimizer block where the project builds the optimizer, with
        node-local checkpoints where the run directory is not shared (every node keeps a whole
        checkpoint of its own), and with `batch` (global, micro, accumulation) where the launch
        resolved the sizes for its world size (launch_checks.resolve_batch_sizes)."""
        config = copy.deepcopy({k: v for k, v in self.given.items()  # DeepSpeed's own changes stay its own
                                if k != PROJECT_BLOCK and not (without_optimizer and k == "optimizer")})
        if batch is not None:
            config.update(zip(("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"),
                              batch))
        if node_local_checkpoints:
            config["checkpoint"] = {**config.get("checkpoint", {}), "use_node_local_storage": True}
        return config

    def with_schedule(self, total_num_steps: int) -> dict:
        """The JSON with its scheduler spanning `total_num_steps` (its warm-up in proportion, at
        least 1 step), for a run of another length than the config's; as written where the
        scheduler has no total_num_steps."""
        config = copy.deepcopy(self.given)
        if self.total_num_steps is None:
            return config
        params = config["scheduler"]["params"]
        old_total = params["total_num_steps"]
        if "warmup_num_steps" in params and old_total:
            params["warmup_num_steps"] = max(1, min(total_num_steps, math.ceil(params["warmup_num_steps"] *
                                                                               total_num_steps / old_total)))
        params["total_num_steps"] = total_num_steps
        return config

    def rehearsed(self, steps: int) -> dict:
        """The JSON of a rehearsal of `steps` steps (commodity_bert/plan/rehearsal.py): the same
        micro-batch with accumulation 1, the scheduler over `steps` in its proportion
        (with_schedule), and what the job starts late started within the first quarter of them:
        an optimizer's freeze (its `freeze_step` / `var_freeze_step`), and each section's own
        (its registered `rehearse`: DiLoCo's rounds, a head warm-up), so every kind of step runs."""
        config = self.with_schedule(steps)
        config.pop("train_batch_size", None)
        config["gradient_accumulation_steps"] = 1
        quarter = max(1, steps // 4)
        params = config.get("optimizer", {}).get("params", {})
        for key in ("freeze_step", "var_freeze_step"):
            if key in params:
                params[key] = quarter
        params.pop("freeze_max_step", None)  # "auto" needs it; a step number does not
        block = config.get("commodity_bert", {})
        for name, settings in block.items():
            section = SECTIONS.get(name)
            if section and section.rehearse and isinstance(settings, dict):
                block[name] = section.rehearse(copy.deepcopy(settings), steps)
        return config

    def sized(self, steps: int, lr: float, micro_batch: int, warmup_fraction: float) -> dict:
        """The JSON at this rate and micro-batch, its scheduler a WarmupDecayLR warmed up over the
        first `warmup_fraction` of `steps` and decayed linearly to 0 at the last (a schedule sized
        to a time budget: commodity_bert.train.schedule)."""
        config = copy.deepcopy(self.given)
        config["train_micro_batch_size_per_gpu"] = micro_batch
        config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = lr
        config["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": max(1, round(warmup_fraction * steps)),
            "total_num_steps": steps, "warmup_type": "linear"}}
        return config
