"""Optimizers chosen by the DeepSpeed JSON: DeepSpeed builds Adam/AdamW (and FusedLamb where a
config asks for it); `"Lamb"` is this project's own LAMB."""
from __future__ import annotations

from torch import nn

from commodity_bert.model import HEAD_PREFIX
from commodity_bert.optim import lamb, onebit_lamb, zero_one_adam  # noqa: F401  (each registers itself)
from commodity_bert.optim.head_warmup import HEAD_GROUP, head_warmup_settings
from commodity_bert.optim.registry import OptimizerEntry, of_config, register_optimizer
from commodity_bert.run_config import RunConfig

# built by DeepSpeed from the config's own block (any params: DeepSpeed checks its own)
for name in ("Adam", "AdamW"):
    register_optimizer(OptimizerEntry(name, frozenset()))


def parameter_groups(model: nn.Module, weight_decay: float, heads_apart: bool = False) -> list[dict]:
    """BERT's convention: no weight decay on biases and LayerNorm weights. With `heads_apart`, the
    pretraining heads' parameters in groups of their own, after the encoder's two and marked
    (a head warm-up scales the others' rate: optim/head_warmup.py)."""
    groups = {(head, decay): [] for head in (False, True) for decay in (True, False)}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        head = heads_apart and name.removeprefix("hf_model.").startswith(HEAD_PREFIX)
        groups[head, not (name.endswith("bias") or "LayerNorm" in name)].append(param)
    return [{"params": params, "weight_decay": weight_decay if decay else 0.0, **({HEAD_GROUP: True} if head else {})}
            for (head, decay), params in groups.items() if params or not head]


def build_optimizer(config: RunConfig | dict, model: nn.Module):
    """(client optimizer or None, model parameters): None where DeepSpeed builds the optimizer
    (Adam/AdamW, and Lamb where "commodity_bert.lamb.implementation" says "deepspeed": FusedLamb,
    CUDA only); otherwise the registered one (optim/registry.py), and DeepSpeed gets the config
    without its optimizer block."""
    config = RunConfig.of(config)
    entry = of_config(config)
    if entry is None:
        raise ValueError(f"optimizer {config.optimizer_type!r} is not supported here")
    params = dict(config.optimizer_params)
    groups = parameter_groups(model, params.get("weight_decay", 0.0),
                              heads_apart=bool(head_warmup_settings(config)["steps"]))
    if entry.build is None:
        return None, groups
    if entry.regroup is not None:
        groups = entry.regroup(groups, model)
    return entry.build(groups, {k: v for k, v in params.items() if k in entry.params}, config), groups
