"""Optimizers chosen by the DeepSpeed JSON: DeepSpeed builds Adam/AdamW (and FusedLamb where a
config asks for it); `"Lamb"` is this project's own LAMB."""
from __future__ import annotations

from torch import nn

from commodity_bert.model import HEAD_PREFIX
from commodity_bert.optim.head_warmup import HEAD_GROUP, head_warmup_settings
from commodity_bert.optim.lamb import Lamb
from commodity_bert.project_block import section

DEEPSPEED_BUILT = {"adam", "adamw"}
LAMB_IMPLEMENTATIONS = ("deepspeed", "project")  # DeepSpeed's FusedLamb, or optim/lamb.py
PROJECT_OPTIMIZERS = {"lamb", "onebitlamb", "zerooneadam"}
LAMB_PARAMS = {"lr", "betas", "eps", "weight_decay", "bias_correction", "max_coeff", "min_coeff"}
# DeepSpeed's OneBitLamb parameter names
ONEBIT_LAMB_PARAMS = {"lr", "betas", "eps", "weight_decay", "max_coeff", "min_coeff", "freeze_step",
                      "coeff_beta", "factor_max", "factor_min", "factor_threshold", "scale_block",
                      "freeze_window", "freeze_threshold", "freeze_min_step", "freeze_max_step"}
# DeepSpeed's ZeroOneAdam parameter names (bias_correction: accepted when false, as it never had any)
ZERO_ONE_ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "var_freeze_step", "var_update_scaler",
                        "local_step_scaler", "local_step_clipper", "scale_block"}


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


def optimizer_name(ds_config: dict) -> str:
    return str(ds_config.get("optimizer", {}).get("type", "")).lower()


def bf16_enabled(ds_config: dict) -> bool:
    return any(ds_config.get(key, {}).get("enabled", False) for key in ("bf16", "bfloat16"))


def lamb_implementation(ds_config: dict) -> str:
    """Which LAMB a config's "Lamb" runs: "commodity_bert.lamb.implementation" where given, else
    the project's own, on every device. DeepSpeed's FusedLamb ("deepspeed", CUDA only, no bf16
    kernel) is another formulation, not a faster kernel of this one: it takes the trust ratio of
    the update before bias correction and applies the correction to the step size after it; the
    ratio normalising the update's size, every step shrinks by sqrt(1 - beta2^t) / (1 - beta1^t)
    (0.18 at step 30, 0.8 at step 1,000 with beta2 0.999). The project's is the paper's, whose
    rates NVIDIA's recipe and this project's configs use."""
    return section(ds_config, "lamb").get("implementation") or "project"


def build_optimizer(ds_config: dict, model: nn.Module):
    """(client optimizer or None, model parameters, DeepSpeed config to use).

    DeepSpeed builds Adam/AdamW, and Lamb where the config's "commodity_bert.lamb.implementation"
    says "deepspeed" (FusedLamb, CUDA only); for our own LAMB the optimizer block is taken out of
    the config and the optimizer passed in."""
    block = ds_config.get("optimizer", {})
    params = dict(block.get("params", {}))
    groups = parameter_groups(model, params.get("weight_decay", 0.0),
                              heads_apart=bool(head_warmup_settings(ds_config)["steps"]))
    name = optimizer_name(ds_config)
    if name in DEEPSPEED_BUILT or (name == "lamb" and lamb_implementation(ds_config) == "deepspeed"):
        return None, groups, ds_config
    if name == "lamb":
        config = {k: v for k, v in ds_config.items() if k != "optimizer"}
        return Lamb(groups, **{k: v for k, v in params.items() if k in LAMB_PARAMS}), groups, config
    if name == "zerooneadam":
        from commodity_bert.optim.zero_one_adam import ZeroOneAdam
        config = {k: v for k, v in ds_config.items() if k != "optimizer"}
        return ZeroOneAdam(groups, **{k: v for k, v in params.items() if k in ZERO_ONE_ADAM_PARAMS}), groups, config
    if name == "onebitlamb":
        from commodity_bert.optim.onebit_lamb import OneBitLamb
        config = {k: v for k, v in ds_config.items() if k != "optimizer"}
        # embedding tables get a group of their own, marked for the row mask (onebit_lamb.py): a
        # group option, unlike parameter identities, survives DeepSpeed's fp16/bf16 wrapper, which
        # replaces the groups' tensors by fp32 copies
        embeddings = {id(p) for n, p in model.named_parameters() if n.endswith("embeddings.weight")}
        decay = groups[0]
        groups = [{**decay, "params": [p for p in decay["params"] if id(p) not in embeddings]},
                  {**decay, "params": [p for p in decay["params"] if id(p) in embeddings], "row_masked": True},
                  *groups[1:]]
        optimizer = OneBitLamb(groups, **{k: v for k, v in params.items() if k in ONEBIT_LAMB_PARAMS})
        return optimizer, groups, config
    raise ValueError(f"optimizer {block.get('type')!r} is not supported here")
