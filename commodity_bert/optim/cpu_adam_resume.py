"""DeepSpeed's CPU Adam keeps part of its state where no checkpoint reaches: replay it on resume.

DeepSpeed builds `FusedAdam` for `"AdamW"`/`"Adam"` configs; on the CPU accelerator its step is
a C++ op (ops/csrc/cpu/adam) with one process-wide optimizer object per AdamW/Adam mode. That
object keeps β1^t and β2^t for the bias correction and updates them by multiplying by β once per
step (float32), but computes them with pow(β, t) when a process starts at step t > 1. After a
resume the two differ in the last bit at some steps (β1 = 0.9: t = 9, 12, 14, 16, …; β2 = 0.999:
t = 3, 6, 19, …), so a resumed run's updates, and every loss after them, drift from the
uninterrupted run's (measured: 3.8e-4 in the loss of the shipped `cpu_tiny_adamw_zero2_bf16.json`
from step 17 when resumed at 15). The optimizer's own state (moments, per-tensor steps) is
restored exactly; only this chain is not. Replaying the chain's calls on a throwaway tensor, as
the uninterrupted process made them, puts the object where it was. The CUDA kernel computes
β^t from the step at every call and needs nothing.
"""
from __future__ import annotations

import torch


def replay_bias_correction(optimizer) -> int:
    """Bring DeepSpeed's CPU Adam op to the step `optimizer`'s restored state says; returns the
    number of steps replayed (0 where the optimizer is not DeepSpeed's FusedAdam on the CPU)."""
    try:
        from deepspeed.ops.adam.fused_adam import FusedAdam, multi_tensor_applier
    except ImportError:
        return 0
    if not isinstance(optimizer, FusedAdam):
        return 0
    states = [optimizer.state[p] for g in optimizer.param_groups for p in g["params"] if p in optimizer.state]
    steps = max((int(s["step"]) for s in states if "step" in s), default=0)
    if not steps or states[0]["exp_avg"].device.type != "cpu":
        return 0
    throwaway = [[torch.zeros(1)] for _ in range(4)]  # gradient, parameter, exp_avg, exp_avg_sq
    for step in range(1, steps + 1):
        for group in optimizer.param_groups:  # the calls each step makes, group by group
            beta1, beta2 = group["betas"]
            multi_tensor_applier(optimizer.multi_tensor_adam, optimizer._dummy_overflow_buf, throwaway,
                                 group["lr"], beta1, beta2, group["eps"], step, optimizer.adam_w_mode,
                                 1 if group.get("bias_correction", True) else 0, group["weight_decay"])
    return steps
