"""Optimizers by name. An optimizer is one module that registers itself here: its name as configs
write it (DeepSpeed's `type`), the params it takes, how to build it (or None where DeepSpeed
builds it), the check of its params, whether it sends its own compressed exchange, and its name
for `bert-plan --optimizer`. The launch checks, `build_optimizer`, the communication modes and
bert-plan read it; none of them lists optimizers of its own.

A name is looked up in any spelling of one word: "OneBitLamb", "onebitlamb" and "onebit_lamb" are
the same optimizer (configs keep DeepSpeed's spelling, bert-plan its snake case).

    register_optimizer(OptimizerEntry("Sgd", params=frozenset({"lr", "momentum"}),
                                      build=lambda groups, params, config: torch.optim.SGD(groups, **params)))
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from commodity_bert.run_config import RunConfig, one_spelling


def no_check(params: dict) -> None:
    return None


@dataclass(frozen=True)
class OptimizerEntry:
    type: str                      # as configs write it and messages say it: DeepSpeed's "type"
    params: frozenset              # the params it takes; others in the config are not passed to it
    # (parameter groups, its params, the config) -> the optimizer, or None where DeepSpeed builds it
    build: Callable | None = None
    check_params: Callable[[dict], None] = no_check  # raises ValueError with one line
    compresses: bool = False       # it replaces the gradient allreduce with its own compressed one
    whole_tensors: bool = False    # its step needs whole tensors (a per-layer trust ratio): no ZeRO partitions
    plan_name: str = ""            # bert-plan --optimizer's name; "" where bert-plan has no model of it
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


def of_config(config: RunConfig) -> OptimizerEntry | None:
    return registered(config.optimizer_type) if config.optimizer_type else None
