"""Optimizers by name. An optimizer is one module that registers itself here: its name as configs
write it (DeepSpeed's `type`), the params it takes, how to build it (or None where DeepSpeed
builds it), the check of its params, whether it sends its own compressed exchange, and its
step-time model for `bert-plan` (a `StepPlan`: which kind each step is and what each kind sends;
plan/step_model.py prices the sends). The launch checks, `build_optimizer`, the communication
modes and bert-plan read it; none of them lists optimizers of its own.

A name is looked up in any spelling of one word: "OneBitLamb", "onebitlamb" and "onebit_lamb" are
the same optimizer (configs keep DeepSpeed's spelling, bert-plan its snake case).

    register_optimizer(OptimizerEntry("Sgd", params=frozenset({"lr", "momentum"}),
                                      build=lambda groups, params, config: torch.optim.SGD(groups, **params)))
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn

from commodity_bert.run_config import RunConfig, one_spelling


def no_check(params: dict) -> None:
    return None


@dataclass(frozen=True)
class PlannedStep:
    """What one kind of an optimizer's steps sends besides forward + backward and its update, as
    bert-plan's step-time model prices it (plan/step_model.py)."""
    gradient_allreduce: bool = True     # DeepSpeed's allreduce of the gradients, with its memory passes
    onebit_exchange: bool = False       # its own 1-bit exchange (a sign per element, a scale per block:
    #                                     4 collectives) and the compression stage's work
    overflow_flag: bool = False         # under fp16/bf16, DeepSpeed's wrapper agrees on overflows (1 byte)
    loss_scale_agreement: bool = False  # under fp16's dynamic loss scale, the ranks agree on it (16 bytes)


def no_schedule(phase: str, config: RunConfig, steps: int, freeze_override: int | None, notes: list[str]) -> dict:
    return {}


def every_step_full(steps: int, schedule: dict) -> Iterable[str]:
    return ["full"] * steps


@dataclass(frozen=True)
class StepPlan:
    """An optimizer's model for `bert-plan estimate`."""
    name: str                           # bert-plan --optimizer's name
    kinds: dict = field(default_factory=lambda: {"full": PlannedStep()})  # kind -> PlannedStep
    # (the phase's name, its config, its steps, --freeze-step or None, notes to add to) -> the
    # schedule's numbers that `sequence` reads
    schedule: Callable[[str, RunConfig, int, int | None, list[str]], dict] = no_schedule
    sequence: Callable[[int, dict], Iterable[str]] = every_step_full  # (steps, schedule) -> each step's kind
    # (steps, schedule) -> [(kind, steps of it)] by arithmetic, where counting `sequence` is not wanted
    by_arithmetic: Callable[[int, dict], list[tuple[str, int]]] | None = None

    def counts(self, steps: int, schedule: dict) -> list[tuple[str, int]]:
        """How many of the steps are of each kind, in order of first appearance."""
        if self.by_arithmetic:
            return self.by_arithmetic(steps, schedule)
        return list(Counter(self.sequence(steps, schedule)).items())


@dataclass(frozen=True)
class OptimizerEntry:
    type: str                      # as configs write it and messages say it: DeepSpeed's "type"
    params: frozenset              # the params it takes; others in the config are not passed to it
    # (parameter groups, its params, the config) -> the optimizer, or None where DeepSpeed builds it
    build: Callable | None = None
    check_params: Callable[[dict], None] = no_check  # raises ValueError with one line
    compresses: bool = False       # it replaces the gradient allreduce with its own compressed one
    whole_tensors: bool = False    # its step needs whole tensors (a per-layer trust ratio): no ZeRO partitions
    plan: StepPlan | None = None   # bert-plan's model of it; None where bert-plan has none
    # the model's parameter groups rearranged for it (1-bit LAMB: the embeddings apart), or None
    regroup: Callable[[list[dict], nn.Module], list[dict]] | None = None

    @property
    def key(self) -> str:
        return key(self.type)


OPTIMIZERS: dict[str, OptimizerEntry] = {}


key = one_spelling


def register_optimizer(entry: OptimizerEntry) -> OptimizerEntry:
    OPTIMIZERS[entry.key] = entry
    return entry


def registered(name: str) -> OptimizerEntry | None:
    """The optimizer called `name` in any spelling, or None."""
    return OPTIMIZERS.get(key(name))


def supported() -> str:
    """The registered names as configs write them, for messages."""
    return ", ".join(sorted(entry.type for entry in OPTIMIZERS.values()))


def planned() -> dict[str, StepPlan]:
    """bert-plan's models of the registered optimizers, by their --optimizer names."""
    return {entry.plan.name: entry.plan for entry in OPTIMIZERS.values() if entry.plan}


def of_config(config: RunConfig) -> OptimizerEntry | None:
    return registered(config.optimizer_type) if config.optimizer_type else None
