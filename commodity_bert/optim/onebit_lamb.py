"""1-bit LAMB (Li et al., arXiv 2104.06069), following docs/ALGORITHMS.md ("1-bit LAMB").

Written here because DeepSpeed deleted its OneBitLamb in 2026; before that it needed CUDA and
CuPy, refused ZeRO and reset its error feedback whenever a checkpoint was loaded. This one
runs over any torch.distributed backend (gloo, NCCL), for any world size, and its error
buffers, frozen variance and coefficients are part of its state_dict.

Warmup stage (step ≤ freeze_step): LAMB on the gradients DeepSpeed allreduced, keeping each
tensor's running mean trust ratio (bias-corrected). After step freeze_step the variance is
frozen and the engine's gradient allreduce is switched off (`on_freeze`); from then on each rank
updates its momentum from its local gradient and the momenta are averaged by the
error-compensated 1-bit allreduce (1 bit per element instead of 16–32), with a fresh variance
estimate from the reconstructed gradient to scale the frozen LAMB coefficient.

When to freeze: `freeze_step` N, or "auto". Every `freeze_window` steps of warmup the optimizer
measures how much the bias-corrected variance estimate v̂ moved since the last window,
‖v̂_t − v̂_{t−W}‖ / ‖v̂_t‖ over all parameters (logged as `variance_change`). With "auto" it
freezes at the first window whose change is below `freeze_threshold`, no earlier than
`freeze_min_step` and at `freeze_max_step` at the latest. Frozen too early the variance still
describes the start of training (on a short run the stage where the model predicts the most
frequent token) and the compressed stage never leaves it: see benchmarks/RESULTS.md#onebit-freeze.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from commodity_bert.collectives.onebit_allreduce import CompressedAllreduce, compressed_allreduce
from commodity_bert.optim.precision import is_priming_step
from commodity_bert.optim.registry import OptimizerEntry, PlannedStep, StepPlan, register_optimizer
from commodity_bert.run_config import RunConfig


def check_params(params: dict) -> None:
    """The config's "params" for OneBitLamb's freeze (also checked before launch:
    train/launch_checks.py)."""
    freeze, cap = params.get("freeze_step", 100000), params.get("freeze_max_step")

    def positive(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    if freeze == "auto":
        if not positive(cap):
            raise ValueError('OneBitLamb "freeze_step": "auto" needs "freeze_max_step" (a positive step number, '
                             'the latest step to freeze at), e.g. half of total_num_steps')
    elif not positive(freeze):
        raise ValueError(f'OneBitLamb freeze_step {freeze!r}: give a positive step number or "auto"')
    window = params.get("freeze_window", 10)
    if not positive(window):
        raise ValueError(f"OneBitLamb freeze_window {window!r}: give a positive number of steps")


class OneBitLamb(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 freeze_step: int | str = 100000, coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1, scale_block: int | None = 256,
                 freeze_window: int = 10, freeze_threshold: float = 0.1, freeze_min_step: int = 0,
                 freeze_max_step: int | None = None):
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "max_coeff": max_coeff, "min_coeff": min_coeff, "coeff_beta": coeff_beta,
                    "factor_max": factor_max, "factor_min": factor_min, "factor_threshold": factor_threshold,
                    "row_masked": False}
        super().__init__(params, defaults)
        check_params({"freeze_step": freeze_step, "freeze_max_step": freeze_max_step,
                      "freeze_window": freeze_window})
        self.auto_freeze = freeze_step == "auto"
        if self.auto_freeze:
            freeze_step = freeze_max_step
        self.freeze_step = freeze_step
        self.freeze_window = freeze_window
        self.freeze_threshold = freeze_threshold
        self.freeze_min_step = freeze_min_step
        self.variance_change: float | None = None  # at the last window; None before the first
        self.scale_block = scale_block  # elements per scale in the 1-bit allreduce (onebit_allreduce.py)
        self.step_count = 0
        self.compressor: CompressedAllreduce | None = None
        self.hierarchy = None  # two levels (comm/topology.py), set by the communication mode
        self.on_freeze: Callable[[], None] | None = None  # turns the engine's allreduce off
        # A param group with "row_masked": True holds tensors whose rows may get no gradient in
        # warmup (position embeddings past the sequence length, tokens not seen yet): their
        # momentum is masked to the rows seen in warmup. 1-bit quantization gives every element
        # the same magnitude, and divided by the ~0 frozen variance of an unseen row it would be
        # a huge step.

    @property
    def frozen(self) -> bool:
        return self.step_count >= self.freeze_step

    def _params(self):
        for group in self.param_groups:
            for p in group["params"]:
                yield group, p

    @staticmethod
    def _trust_ratio(weight_norm, update_norm, group):
        ratio = (weight_norm / update_norm).clamp(group["min_coeff"], group["max_coeff"])
        return torch.where((weight_norm > 0) & (update_norm > 0), ratio, torch.ones_like(ratio))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if self.step_count == 0 and is_priming_step(self):
            return loss
        if self.frozen:
            self._compression_step()
        else:
            self._warmup_step()
        self.step_count += 1
        if not self.frozen and self.step_count % self.freeze_window == 0:
            self._measure_variance_change()
        if self.step_count == self.freeze_step:
            self._freeze()
        return loss

    def _measure_variance_change(self) -> None:
        """‖v̂_t − v̂_{t−W}‖ / ‖v̂_t‖, and with "auto" the decision to freeze now."""
        moved, size, compared = [], [], False  # summed on the device, read once: one host sync
        for group, p in self._params():
            state = self.state[p]
            if not state:
                continue
            v_hat = state["exp_avg_sq"] / (1 - group["betas"][1] ** self.step_count)
            if "exp_avg_sq_window" in state:  # in the checkpoint too: a resumed run decides alike
                moved.append((v_hat - state["exp_avg_sq_window"]).pow(2).sum())
                state["exp_avg_sq_window"].copy_(v_hat)
                compared = True
            else:
                state["exp_avg_sq_window"] = v_hat
            size.append(v_hat.pow(2).sum())
        total = float(torch.stack(size).sum()) if size else 0.0
        self.variance_change = (float(torch.stack(moved).sum()) / total) ** 0.5 if compared and total else None
        if not (self.auto_freeze and self.variance_change is not None):
            return
        settle = self.variance_change < self.freeze_threshold and self.step_count >= self.freeze_min_step
        if dist.is_initialized():  # the ranks' variances are equal; the decision must be, whatever happens
            flag = torch.tensor([float(settle)], device=self.state[next(p for _, p in self._params())]["exp_avg"].device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            settle = bool(flag.item())
        if settle and self.step_count < self.freeze_step:
            self.freeze_step = self.step_count
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"1-bit LAMB: the variance has settled (relative change {self.variance_change:.3g} over the "
                      f"last {self.freeze_window} steps, below {self.freeze_threshold}): freezing at step "
                      f"{self.step_count}", flush=True)

    def _warmup_step(self) -> None:
        for group, p in self._params():
            if p.grad is None:
                continue
            g = p.grad.float()
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                # running mean of the trust ratio, from zero as in DeepSpeed's, divided by the sum
                # of its weights (1 - coeff_beta^k) when used: a mean started at 1, or left biased,
                # is far from the ratios seen when the freeze comes early (started at 1 it was 35x
                # the ratio after a freeze at step 10, and the tiny model's loss went from 11 to 300)
                state["coeff"] = torch.zeros((), device=p.device)
                state["coeff_weight"] = torch.zeros((), device=p.device)
                if group["row_masked"]:
                    # float 0/1, not bool: Optimizer.load_state_dict casts state to the param dtype
                    state["row_seen"] = torch.zeros(p.shape[0], device=p.device)
            beta1, beta2 = group["betas"]
            state["exp_avg"].lerp_(g, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            if "row_seen" in state:
                state["row_seen"].copy_(torch.maximum(state["row_seen"], g.flatten(1).ne(0).any(dim=1).float()))
            update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"]:
                update.add_(p.float(), alpha=group["weight_decay"])
            ratio = self._trust_ratio(p.float().norm(), update.norm(), group)
            state["coeff"].mul_(group["coeff_beta"]).add_(ratio, alpha=1 - group["coeff_beta"])
            state["coeff_weight"].mul_(group["coeff_beta"]).add_(1 - group["coeff_beta"])
            p.add_((-group["lr"] * ratio * update).to(p.dtype))

    def _freeze(self) -> None:
        moments = [self.state[p]["exp_avg"] for _, p in self._params() if self.state[p]]
        rms = [m.norm() / m.numel() ** 0.5 for m in moments]
        mean_rms = torch.stack(rms).mean()
        for _, p in self._params():
            state = self.state[p]
            if not state:
                continue
            m_rms = state["exp_avg"].norm() / state["exp_avg"].numel() ** 0.5
            # one scale per chunk of the 1-bit allreduce then fits every tensor
            state["momentum_scale"] = torch.where(m_rms > 0, mean_rms / m_rms, torch.ones_like(m_rms))
            state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
            state.pop("exp_avg_sq_window", None)  # only the freeze decision needed it
        self._ensure_compressor()
        if self.on_freeze is not None:
            self.on_freeze()

    def _ensure_compressor(self) -> None:
        if self.compressor is None:
            tensors = [p for _, p in self._params() if self.state[p]]
            self.compressor = compressed_allreduce(sum(p.numel() for p in tensors), tensors[0].device,
                                                   self.scale_block, self.hierarchy)

    def _compression_step(self) -> None:
        entries = [(group, p, self.state[p]) for group, p in self._params() if self.state[p]]
        previous = [s["exp_avg"].clone() for _, _, s in entries]
        for group, p, state in entries:
            beta1 = group["betas"][0]
            g = p.grad.float() if p.grad is not None else torch.zeros_like(state["exp_avg"])
            state["exp_avg"].lerp_(g, 1 - beta1).mul_(state["momentum_scale"])
        flat = torch.cat([s["exp_avg"].view(-1) for _, _, s in entries])
        self._ensure_compressor()
        averaged = self.compressor(flat)
        offset = 0
        for (group, p, state), m_prev in zip(entries, previous):
            m = state["exp_avg"]
            m.copy_(averaged[offset: offset + m.numel()].view_as(m)).div_(state["momentum_scale"])
            offset += m.numel()
            if "row_seen" in state:
                m.mul_(state["row_seen"].view(-1, *([1] * (m.dim() - 1))))
            beta1, beta2 = group["betas"]
            reconstructed = (m - beta1 * m_prev) / (1 - beta1)
            state["exp_avg_sq_fresh"].mul_(beta2).addcmul_(reconstructed, reconstructed, value=1 - beta2)
            denom_frozen = state["exp_avg_sq"].sqrt() + group["eps"]
            update_pre = m / denom_frozen
            update = update_pre + group["weight_decay"] * p.float() if group["weight_decay"] else update_pre
            factor = (denom_frozen / (state["exp_avg_sq_fresh"].sqrt() + group["eps"])).max()
            if group["weight_decay"]:
                rho = (update_pre.norm() / update.norm()).clamp(max=1.0)
                factor = factor * rho + (1 - rho)
            factor = factor.clamp(group["factor_min"], group["factor_max"])
            # change at most ±factor_threshold per step, starting from 1 at the freeze
            last = state.get("last_factor", torch.ones_like(factor))
            factor = factor.clamp(last * (1 - group["factor_threshold"]), last * (1 + group["factor_threshold"]))
            state["last_factor"] = factor
            frozen_coeff = state["coeff"] / state["coeff_weight"]
            p.add_((-group["lr"] * frozen_coeff * factor * update).to(p.dtype))

    # The state shared by all ranks travels with DeepSpeed's checkpoint (written by rank 0);
    # the error buffers differ per rank and go to each rank's own file (rank_state_dict).
    def state_dict(self) -> dict:
        state = super().state_dict()
        state["onebit"] = {"step_count": self.step_count, "freeze_step": self.freeze_step,
                           "variance_change": self.variance_change}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        onebit = state_dict.pop("onebit", None)
        super().load_state_dict(state_dict)
        if onebit is None:
            return
        self.step_count = onebit["step_count"]
        self.freeze_step = onebit.get("freeze_step", self.freeze_step)  # "auto" decided it
        self.variance_change = onebit.get("variance_change")
        if self.frozen and self.on_freeze is not None:
            self.on_freeze()

    def rank_state_dict(self) -> dict:
        return {"compressor": self.compressor.state_dict() if self.compressor else None}

    def load_rank_state_dict(self, state: dict) -> None:
        if state.get("compressor") is not None:
            self._ensure_compressor()
            self.compressor.load_state_dict(state["compressor"])


def embeddings_apart(groups: list[dict], model) -> list[dict]:
    """The embedding tables in a group of their own, marked for the row mask: a group option,
    unlike parameter identities, survives DeepSpeed's fp16/bf16 wrapper, which replaces the groups'
    tensors by fp32 copies."""
    embeddings = {id(p) for n, p in model.named_parameters() if n.endswith("embeddings.weight")}
    decay = groups[0]
    return [{**decay, "params": [p for p in decay["params"] if id(p) not in embeddings]},
            {**decay, "params": [p for p in decay["params"] if id(p) in embeddings], "row_masked": True},
            *groups[1:]]


def planned_freeze(phase: str, config: RunConfig, steps: int, override: int | None, notes: list[str]) -> dict:
    """The freeze step bert-plan counts: --freeze-step, the config's, or the auto rule's latest."""
    if override is not None:
        return {"freeze_step": override}
    params = config.optimizer_params
    freeze = params.get("freeze_step")
    if freeze == "auto":
        latest = int(params.get("freeze_max_step", steps))
        notes.append(f"1-bit LAMB: the config freezes by the auto rule; counted at its latest step, {latest} "
                     f"(--freeze-step to assume another)")
        return {"freeze_step": latest}
    if isinstance(freeze, int):
        return {"freeze_step": freeze}
    guess = round(0.2 * steps)
    notes.append(f"1-bit LAMB: no freeze step in the config; assumed at 20% of the steps ({guess})")
    return {"freeze_step": guess}


def warmup_then_compressed(steps: int, schedule: dict) -> list[tuple[str, int]]:
    warm = min(schedule["freeze_step"], steps)
    return [("full", warm), ("compressed", steps - warm)]


STEP_PLAN = StepPlan(
    "onebit_lamb", schedule=planned_freeze,
    # after the freeze no gradient allreduce: the momenta's 1-bit exchange in its own flatten
    kinds={"full": PlannedStep(),
           "compressed": PlannedStep(gradient_allreduce=False, onebit_exchange=True, overflow_flag=True)},
    sequence=lambda steps, schedule: [kind for kind, n in warmup_then_compressed(steps, schedule) for _ in range(n)],
    by_arithmetic=warmup_then_compressed)  # phases run to 10⁵ steps

# DeepSpeed's OneBitLamb parameter names
register_optimizer(OptimizerEntry(
    "OneBitLamb", frozenset({"lr", "betas", "eps", "weight_decay", "max_coeff", "min_coeff", "freeze_step",
                             "coeff_beta", "factor_max", "factor_min", "factor_threshold", "scale_block",
                             "freeze_window", "freeze_threshold", "freeze_min_step", "freeze_max_step"}),
    build=lambda groups, params, config: OneBitLamb(groups, **params), check_params=check_params,
    compresses=True, plan=STEP_PLAN, regroup=embeddings_apart))
