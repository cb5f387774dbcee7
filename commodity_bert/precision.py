"""What mixed precision changes for the project's own code: the loss scale gradients carry, and
DeepSpeed's priming step.

DeepSpeed keeps the loss scale in its optimizer wrappers' `loss_scale_config` (0.19; older
wrappers had `cur_scale`), and reads it from there itself (`engine._get_optimizer_loss_scale`).
Reading `cur_scale` alone gave 1.0 under fp16, so the metric lied and bucket-wise clipping
measured norms 2^16 too large."""
from __future__ import annotations

import torch


def current_loss_scale(optimizer) -> float:
    """The factor the gradients on the model's parameters carry now (1.0 in fp32 and bf16)."""
    if getattr(optimizer, "custom_loss_scaler", False):
        return float(optimizer.external_loss_scale)
    config = getattr(optimizer, "loss_scale_config", None)
    if config is not None:
        return float(config.cur_scale) if getattr(config, "use_grad_scaling", True) else 1.0
    return float(getattr(optimizer, "cur_scale", 1.0))


def is_priming_step(optimizer: torch.optim.Optimizer) -> bool:
    """DeepSpeed's fp16/bf16 wrappers call the inner optimizer's step() once at construction,
    with all-zero gradients, to create its state. For the project's optimizers that call must
    change nothing: counted as a step it shifts LAMB's bias correction and 1-bit LAMB's freeze
    by one step and puts a trust ratio of 1 into the frozen coefficient's mean."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return not any(bool(g.any()) for g in grads)
