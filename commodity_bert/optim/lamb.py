"""LAMB, the project's own: a config's "Lamb" on every device (DeepSpeed's FusedLamb, CUDA-only,
is another formulation; `implementation` below says how it differs)."""
from __future__ import annotations

import torch

from commodity_bert.optim.precision import is_priming_step
from commodity_bert.optim.registry import OptimizerEntry, StepPlan, register_optimizer
from commodity_bert.run_config import RunConfig, register_section


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019) as the paper and NVIDIA's apex FusedLAMB compute it: Adam moments with
    bias correction, update u = m̂/(√v̂ + ε) + wd·p, per-tensor trust ratio ‖p‖/‖u‖ clipped to
    [min_coeff, max_coeff] (1 when either norm is 0), p ← p − lr·ratio·u. (DeepSpeed's FusedLamb
    takes the ratio before the bias correction: see `implementation` below.)

    Written here because DeepSpeed's LAMB is FusedLamb, a CUDA kernel of another formulation:
    this one runs wherever torch runs (CPU, any GPU) with `torch._foreach_*` ops, one launch per
    op for all tensors of a group, and the trust ratios as one vector.
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
            # every tensor's trust ratio in one vector: a handful of kernels, not a few per tensor
            w, u = torch.stack(torch._foreach_norm(params)), torch.stack(torch._foreach_norm(update))
            ratios = torch.where((w > 0) & (u > 0), (w / u).clamp(group["min_coeff"], group["max_coeff"]), 1.0)
            torch._foreach_mul_(update, ratios.unbind())
            torch._foreach_add_(params, update, alpha=-group["lr"])
        return loss


IMPLEMENTATIONS = ("deepspeed", "project")  # DeepSpeed's FusedLamb, or this module's


def check_section(settings: dict, config: RunConfig) -> str | None:
    if settings["implementation"] not in IMPLEMENTATIONS:
        return (f'"commodity_bert.lamb.implementation" {settings["implementation"]!r}: give "deepspeed" '
                f'(FusedLamb, CUDA only) or "project" (commodity_bert/optim/lamb.py)')
    return None


register_section("lamb", {"implementation": "project"}, check_section)


def implementation(config: RunConfig) -> str:
    """Which LAMB a config's "Lamb" runs: "commodity_bert.lamb.implementation" where given, else
    the project's own, on every device. DeepSpeed's FusedLamb ("deepspeed", CUDA only, no bf16
    kernel) is another formulation, not a faster kernel of this one: it takes the trust ratio of
    the update before bias correction and applies the correction to the step size after it; the
    ratio normalising the update's size, every step shrinks by sqrt(1 - beta2^t) / (1 - beta1^t)
    (0.18 at step 30, 0.8 at step 1,000 with beta2 0.999). The project's is the paper's, whose
    rates NVIDIA's recipe and this project's configs use."""
    return config.section("lamb")["implementation"] or "project"


register_optimizer(OptimizerEntry(
    "Lamb", frozenset({"lr", "betas", "eps", "weight_decay", "bias_correction", "max_coeff", "min_coeff"}),
    build=lambda groups, params, config: None if implementation(config) == "deepspeed" else Lamb(groups, **params),
    whole_tensors=True, plan=StepPlan("lamb")))
