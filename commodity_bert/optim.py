"""Optimizers chosen by the DeepSpeed JSON: DeepSpeed builds Adam/AdamW (and FusedLamb on
CUDA); elsewhere `"Lamb"` is this project's own LAMB."""
from __future__ import annotations

import torch
from torch import nn

from commodity_bert.precision import is_priming_step

DEEPSPEED_BUILT = {"adam", "adamw"}
PROJECT_OPTIMIZERS = {"lamb", "onebitlamb", "zerooneadam"}
LAMB_PARAMS = {"lr", "betas", "eps", "weight_decay", "bias_correction", "max_coeff", "min_coeff"}
# DeepSpeed's OneBitLamb parameter names
ONEBIT_LAMB_PARAMS = {"lr", "betas", "eps", "weight_decay", "max_coeff", "min_coeff", "freeze_step",
                      "coeff_beta", "factor_max", "factor_min", "factor_threshold", "scale_block",
                      "freeze_window", "freeze_threshold", "freeze_min_step", "freeze_max_step"}
# DeepSpeed's ZeroOneAdam parameter names (bias_correction: accepted when false, as it never had any)
ZERO_ONE_ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "var_freeze_step", "var_update_scaler",
                        "local_step_scaler", "local_step_clipper", "scale_block"}


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019) with the math of DeepSpeed's FusedLamb: Adam moments with bias
    correction, update u = m̂/(√v̂ + ε) + wd·p, per-tensor trust ratio ‖p‖/‖u‖ clipped to
    [min_coeff, max_coeff] (1 when either norm is 0), p ← p − lr·ratio·u.

    Written here because DeepSpeed's "Lamb" is FusedLamb, a CUDA kernel: this one runs
    wherever torch runs (CPU, any GPU) with `torch._foreach_*` ops, one launch per op for
    all tensors of a group.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, bias_correction: bool = True, max_coeff: float = 10.0,
                 min_coeff: float = 0.01):
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bias_correction, "max_coeff": max_coeff, "min_coeff": min_coeff}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if not self.state and is_priming_step(self):
            return loss
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            for p in params:
                if not self.state[p]:
                    self.state[p] = {"step": 0, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            states = [self.state[p] for p in params]
            step = states[0]["step"] + 1
            for s in states:
                s["step"] = step
            beta1, beta2 = group["betas"]
            exp_avg = [s["exp_avg"] for s in states]
            exp_avg_sq = [s["exp_avg_sq"] for s in states]
            torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sq, beta2)
            torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
            correction1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
            correction2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
            denom = torch._foreach_sqrt(exp_avg_sq)
            torch._foreach_div_(denom, correction2 ** 0.5)
            torch._foreach_add_(denom, group["eps"])
            update = torch._foreach_div(exp_avg, denom)
            torch._foreach_div_(update, correction1)
            if group["weight_decay"]:
                torch._foreach_add_(update, params, alpha=group["weight_decay"])
            weight_norms = torch._foreach_norm(params)
            update_norms = torch._foreach_norm(update)
            ratios = []
            for w, u in zip(weight_norms, update_norms):
                ratio = (w / u).clamp(group["min_coeff"], group["max_coeff"])
                ratios.append(torch.where((w > 0) & (u > 0), ratio, torch.ones_like(ratio)))
            torch._foreach_mul_(update, ratios)
            torch._foreach_add_(params, update, alpha=-group["lr"])
        return loss


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """BERT's convention: no weight decay on biases and LayerNorm weights."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def optimizer_name(ds_config: dict) -> str:
    return str(ds_config.get("optimizer", {}).get("type", "")).lower()


def build_optimizer(ds_config: dict, model: nn.Module, on_cuda: bool):
    """(client optimizer or None, model parameters, DeepSpeed config to use).

    DeepSpeed builds Adam/AdamW, and Lamb on CUDA (FusedLamb), from the config; for our own
    LAMB the optimizer block is taken out of the config and the optimizer passed in."""
    block = ds_config.get("optimizer", {})
    params = dict(block.get("params", {}))
    groups = parameter_groups(model, params.get("weight_decay", 0.0))
    name = optimizer_name(ds_config)
    if name in DEEPSPEED_BUILT or (name == "lamb" and on_cuda):
        return None, groups, ds_config
    if name == "lamb":
        config = {k: v for k, v in ds_config.items() if k != "optimizer"}
        return Lamb(groups, **{k: v for k, v in params.items() if k in LAMB_PARAMS}), groups, config
    if name == "zerooneadam":
        from commodity_bert.zero_one_adam import ZeroOneAdam
        config = {k: v for k, v in ds_config.items() if k != "optimizer"}
        return ZeroOneAdam(groups, **{k: v for k, v in params.items() if k in ZERO_ONE_ADAM_PARAMS}), groups, config
    if name == "onebitlamb":
        from commodity_bert.onebit_lamb import OneBitLamb
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
