"""0/1 Adam (Lu et al., arXiv 2202.06009; docs/ALGORITHMS.md, "0/1 Adam"), with DeepSpeed's
parameter names: `var_freeze_step`, `var_update_scaler`, `local_step_scaler`, `local_step_clipper`.

Written here because DeepSpeed deleted its ZeroOneAdam in 2026 (it needed CUDA and CuPy or MPI,
refused ZeRO, and restarted its schedules and error feedback at every checkpoint load). This one
runs over any torch.distributed backend and its whole state is in its checkpoints.

Steps t = 1, 2, … (DeepSpeed's fp16/bf16 priming call is not one). Overflows under fp16/bf16:
in the variance stage a skipped step is not a step, on every rank alike (the engine's allreduce,
or on 1-bit steps the wrapper's overflow flag, makes the ranks agree). In the local-step stage the
ranks do not agree, which would cost a round trip at every local step: each rank's wrapper skips
its own overflows, and the step still counts on that rank (`skipped_local_step`: t, Λ and T_u
advance, the rank adds nothing to u and keeps its parameters, and it joins the sync of a step of
T_u), so every rank stays on one schedule; comm/mode.py keeps the lr schedule and, under fp16,
the loss scale in step.

Variance stage (t ≤ var_freeze_step). The variance is updated only on the steps of T_v, from the
gradient the engine allreduced in full precision there; T_v's gaps start at 1 and double after
every `var_update_scaler` updates (16 steps in a row, then 16 updates every second step, …). On
the other steps the engine's allreduce is off and the gradient travels 1-bit compressed with
error feedback (commodity_bert/collectives/onebit_allreduce.py). Every step: m ← β1·m + (1 − β1)·g,
p ← p − lr·(m/(√v + ε) + wd·p).

Local-step stage (t > var_freeze_step; v frozen, the error buffers restarted): each rank steps
alone with its local gradient, m ← β1·m + (1 − β1)·g, p ← p − lr·(m/(√v + ε) + wd·p), and keeps
u = Σ lr·m and Λ = Σ lr since the last sync. On the steps of T_u ("1-bit sync") the ranks average u
through the 1-bit allreduce, ū; every rank goes back to the parameters p₀ of the last sync and
takes the averaged step p ← p₀ − ū/(√v + ε) − wd·Λ·p₀, with m ← ū/Λ. T_u's gap starts at 1 and
doubles every `local_step_scaler` steps, up to `local_step_clipper` (the paper's H).

Where this departs from DeepSpeed's code (docs/ALGORITHMS.md says why): weight decay is applied
from p₀ at a sync rather than folded into u (there it re-entered the momentum, about 11× the
decay); no step is spent on an initialization call; a resume continues the schedules and the
error feedback instead of restarting them. Like DeepSpeed's, it has no bias correction.
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import torch

from commodity_bert.collectives.onebit_allreduce import CompressedAllreduce, compressed_allreduce
from commodity_bert.optim.precision import is_priming_step
from commodity_bert.optim.registry import OptimizerEntry, PlannedStep, StepPlan, register_optimizer
from commodity_bert.run_config import RunConfig


SCHEDULE_KEYS = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")


def fresh_schedule() -> dict:
    return {"step": 0, "var_interval": 1, "var_counter": 0, "local_interval": 1, "local_counter": 0, "lr_sum": 0.0}


def after_variance_step(schedule: dict, var_update_scaler: int) -> None:
    """T_v: the gap doubles after every `var_update_scaler` variance updates."""
    schedule["var_counter"] += 1
    if schedule["var_counter"] == var_update_scaler:
        schedule["var_counter"] = 0
        schedule["var_interval"] *= 2


def after_local_step(schedule: dict, local_step_scaler: int, local_step_clipper: int) -> None:
    """T_u: the gap doubles after every `local_step_scaler` local steps, up to the clipper."""
    schedule["local_counter"] += 1
    if schedule["local_counter"] == local_step_scaler:
        schedule["local_counter"] = 0
        schedule["local_interval"] = min(local_step_clipper, 2 * schedule["local_interval"])


def step_kinds(steps: int, var_freeze_step: int, var_update_scaler: int, local_step_scaler: int,
               local_step_clipper: int):
    """What each step t = 1 … `steps` sends, by the optimizer's own schedule rules: "full" (a
    variance step: the engine's full-precision allreduce), "onebit" (1-bit gradient), "local"
    (nothing) or "sync" (a local step, then the 1-bit sync). For bert-plan and the tests."""
    schedule = fresh_schedule()
    for t in range(1, steps + 1):
        if t <= var_freeze_step:
            if t % schedule["var_interval"] == 0:
                yield "full"
                after_variance_step(schedule, var_update_scaler)
            else:
                yield "onebit"
        else:
            yield "sync" if t % schedule["local_interval"] == 0 else "local"
            after_local_step(schedule, local_step_scaler, local_step_clipper)


def variance_updates(var_freeze_step: int, var_update_scaler: int) -> int:
    """How many steps of T_v come before the freeze."""
    return sum(kind == "full" for kind in step_kinds(var_freeze_step, var_freeze_step, var_update_scaler, 1, 1))


def check_params(params: dict) -> None:
    """The config's "params" for ZeroOneAdam (also checked before launch: train/launch_checks.py)."""
    for name in SCHEDULE_KEYS:
        value = params.get(name, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"ZeroOneAdam {name} {value!r}: give a positive integer")
    if params.get("bias_correction", False):
        raise ValueError('ZeroOneAdam has no bias correction (DeepSpeed\'s accepted the flag and ignored it); '
                         'set "bias_correction": false or leave it out')


class ZeroOneAdam(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, var_freeze_step: int = 100000, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16, scale_block: int | None = 256):
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        check_params({"var_freeze_step": var_freeze_step, "var_update_scaler": var_update_scaler,
                      "local_step_scaler": local_step_scaler, "local_step_clipper": local_step_clipper})
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.scale_block = scale_block
        self.schedule = fresh_schedule()
        self.compressor: CompressedAllreduce | None = None
        self.hierarchy = None  # two levels (comm/topology.py), set by the communication mode
        # switches the engine's full-precision gradient allreduce for the next step (train.py)
        self.engine_allreduce: Callable[[bool], None] | None = None
        self.synced_last_step = True  # whether the last step ended with the ranks' parameters equal

    def short_variance_warning(self) -> str | None:
        """Without bias correction the frozen v holds 1 − β2^k of the gradients' scale after k
        updates, and every later step is 1/√(1 − β2^k) times larger: say so when that is over √2."""
        beta2 = self.param_groups[0]["betas"][1]
        k = variance_updates(self.var_freeze_step, self.var_update_scaler)
        held = 1 - beta2 ** k
        if held >= 0.5:
            return None
        return (f"warning: ZeroOneAdam freezes the variance after {k} updates with beta2 {beta2}: it then holds "
                f"{held:.0%} of the gradients' scale (0/1 Adam has no bias correction), so steps are "
                f"{held ** -0.5:.1f}x larger than Adam's; raise var_freeze_step or lower beta2")

    # ---- the schedules
    @property
    def frozen(self) -> bool:
        return self.schedule["step"] >= self.var_freeze_step

    def is_variance_step(self, t: int) -> bool:
        return t <= self.var_freeze_step and t % self.schedule["var_interval"] == 0

    def next_step_allreduced(self) -> bool:
        """Whether the engine must allreduce the next step's gradients (a step of T_v)."""
        return self.is_variance_step(self.schedule["step"] + 1)

    def _tell_engine(self) -> None:
        if self.engine_allreduce is not None:
            self.engine_allreduce(self.next_step_allreduced())

    def _params(self):
        for group in self.param_groups:
            for p in group["params"]:
                yield group, p

    def _ensure_compressor(self) -> CompressedAllreduce:
        if self.compressor is None:
            tensors = [p for _, p in self._params()]
            self.compressor = compressed_allreduce(sum(p.numel() for p in tensors), tensors[0].device,
                                                   self.scale_block, self.hierarchy)
        return self.compressor

    def _compressed_average(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        averaged = self._ensure_compressor()(flat)
        out, offset = [], 0
        for t in tensors:
            out.append(averaged[offset: offset + t.numel()].view_as(t))
            offset += t.numel()
        return out

    @staticmethod
    def _mask(state: dict, x: torch.Tensor) -> torch.Tensor:
        """What came through the 1-bit exchange, zeroed where v = 0: an element that no variance
        step gave a gradient (an embedding row not seen yet, an unused weight) has an exact average
        of 0 there, and the quantization noise the exchange puts in its place, divided by √0 + ε,
        would be a huge step. (DeepSpeed left this to a mask the training script had to supply.)"""
        return x.mul_(state["exp_avg_sq"].ne(0))

    # ---- the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if self.schedule["step"] == 0 and is_priming_step(self):
            self._tell_engine()
            return loss
        t = self.schedule["step"] + 1
        self.schedule["step"] = t
        for group, p in self._params():
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        if t <= self.var_freeze_step:
            self._variance_stage_step(t)
        else:
            self._local_stage_step(t)
        if t == self.var_freeze_step:
            self._freeze()
        self._tell_engine()
        return loss

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
                for _, p in self._params()]

    def _variance_stage_step(self, t: int) -> None:
        grads = self._grads()
        variance_step = self.is_variance_step(t)
        if not variance_step:
            grads = self._compressed_average(grads)
        for (group, p), g in zip(self._params(), grads):
            state = self.state[p]
            beta1, beta2 = group["betas"]
            if variance_step:
                state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            else:
                self._mask(state, g)
            state["exp_avg"].lerp_(g, 1 - beta1)
            update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"]:
                update.add_(p.float(), alpha=group["weight_decay"])
            p.add_((-group["lr"] * update).to(p.dtype))
        if variance_step:
            after_variance_step(self.schedule, self.var_update_scaler)

    def _freeze(self) -> None:
        """v is final; the error feedback restarts, since it will carry another quantity (u)."""
        self._ensure_compressor().reset()
        for _, p in self._params():
            state = self.state[p]
            state["momentum_sum"] = torch.zeros_like(state["exp_avg"])  # u = Σ lr·m
            # the parameters of the last sync, alike on every rank: kept, not rebuilt by subtracting
            # what this rank applied since, whose rounding differs from rank to rank
            state["sync_params"] = p.detach().float().clone()

    def _local_stage_step(self, t: int) -> None:
        grads = self._grads()
        for (group, p), g in zip(self._params(), grads):
            state = self.state[p]
            state["exp_avg"].lerp_(g * state["exp_avg_sq"].ne(0), 1 - group["betas"][0])  # see _mask
            state["momentum_sum"].add_(state["exp_avg"], alpha=group["lr"])
            update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"]:
                update.add_(p.float(), alpha=group["weight_decay"])
            p.add_((-group["lr"] * update).to(p.dtype))
        self._end_local_step(t)

    @torch.no_grad()
    def skipped_local_step(self) -> None:
        """This rank's fp16/bf16 wrapper skipped a local-stage step for an overflow in its own
        gradients (the other ranks may have stepped): the step counts all the same, with no update
        from this rank (see the module's docstring)."""
        if not self.frozen:
            raise RuntimeError("skipped_local_step outside the local-step stage: there the ranks agree on overflows")
        t = self.schedule["step"] + 1
        self.schedule["step"] = t
        self._end_local_step(t)
        self._tell_engine()

    def _end_local_step(self, t: int) -> None:
        """What every rank does at every local-stage step, stepped or skipped: Λ and T_u advance,
        and the ranks sync on the steps of T_u."""
        self.schedule["lr_sum"] += self.param_groups[0]["lr"]
        sync = t % self.schedule["local_interval"] == 0
        if sync:
            self._one_bit_sync()
        self.synced_last_step = sync
        after_local_step(self.schedule, self.local_step_scaler, self.local_step_clipper)

    def _one_bit_sync(self) -> None:
        entries = [(group, p, self.state[p]) for group, p in self._params()]
        averaged = self._compressed_average([s["momentum_sum"] for _, _, s in entries])
        lr_sum = self.schedule["lr_sum"]
        for (group, p, state), u in zip(entries, averaged):
            u = self._mask(state, u)
            start = state["sync_params"]
            new = start - u / (state["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"]:  # decoupled, from the shared point: the decay of Λ = Σ lr
                new.add_(start, alpha=-group["weight_decay"] * lr_sum)
            p.copy_(new.to(p.dtype))
            start.copy_(new)
            if lr_sum > 0:
                state["exp_avg"].copy_(u / lr_sum)
            state["momentum_sum"].zero_()
        self.schedule["lr_sum"] = 0.0

    @contextlib.contextmanager
    def shared_params(self, push_to_model: Callable[[], None]):
        """Between two syncs each rank has parameters of its own; inside, the parameters of the last
        sync, which every rank shares (for evaluation and export). `push_to_model` copies the
        optimizer's tensors into the model (DeepSpeed's fp16/bf16 master copies)."""
        if self.synced_last_step:
            yield
            return
        kept = []
        for _, p in self._params():
            kept.append(p.detach().clone())
            p.data.copy_(self.state[p]["sync_params"])
        push_to_model()
        try:
            yield
        finally:
            for (_, p), k in zip(self._params(), kept):
                p.data.copy_(k)
            push_to_model()

    # ---- checkpoints: the schedules travel with the optimizer state; the error buffers are the rank's
    def state_dict(self) -> dict:
        state = super().state_dict()
        state["zero_one"] = {**self.schedule, "synced_last_step": self.synced_last_step}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        schedule = state_dict.pop("zero_one", None)
        super().load_state_dict(state_dict)
        if schedule is not None:
            self.synced_last_step = schedule.pop("synced_last_step", True)
            self.schedule.update(schedule)
        self._tell_engine()

    def rank_state_dict(self) -> dict:
        return {"compressor": self.compressor.state_dict() if self.compressor else None}

    def load_rank_state_dict(self, state: dict) -> None:
        if state.get("compressor") is not None:
            self._ensure_compressor().load_state_dict(state["compressor"])


def planned_schedule(phase: str, config: RunConfig, steps: int, freeze_override: int | None,
                     notes: list[str]) -> dict:
    """The four schedule numbers bert-plan counts: the config's, ZeroOneAdam's defaults where it
    has none; --freeze-step sets var_freeze_step."""
    defaults = inspect.signature(ZeroOneAdam).parameters
    params = config.optimizer_params if config.optimizer_name == "zerooneadam" else {}
    if not params:
        notes.append(f"{phase}: the config's optimizer is not ZeroOneAdam; 0/1 Adam's defaults assumed "
                     f"(var_freeze_step {defaults['var_freeze_step'].default}, local_step_clipper "
                     f"{defaults['local_step_clipper'].default}; --freeze-step sets var_freeze_step)")
    schedule = {k: int(params.get(k, defaults[k].default)) for k in SCHEDULE_KEYS}
    if freeze_override is not None:
        schedule["var_freeze_step"] = freeze_override
    return schedule


STEP_PLAN = StepPlan(
    "zero_one_adam", schedule=planned_schedule,
    # off its variance steps the engine's allreduce is off: under fp16/bf16 DeepSpeed's wrapper
    # agrees on overflows at a 1-bit step, and at a sync the ranks agree on fp16's loss scale
    kinds={"full": PlannedStep(),
           "onebit": PlannedStep(gradient_allreduce=False, onebit_exchange=True, overflow_flag=True),
           "local": PlannedStep(gradient_allreduce=False),
           "sync": PlannedStep(gradient_allreduce=False, onebit_exchange=True, loss_scale_agreement=True)},
    sequence=lambda steps, schedule: step_kinds(steps, *(schedule[k] for k in SCHEDULE_KEYS)))

# DeepSpeed's ZeroOneAdam parameter names (bias_correction: accepted when false, as it never had any)
register_optimizer(OptimizerEntry(
    "ZeroOneAdam", frozenset({"lr", "betas", "eps", "weight_decay", "var_freeze_step", "var_update_scaler",
                              "local_step_scaler", "local_step_clipper", "scale_block"}),
    build=lambda groups, params, config: ZeroOneAdam(groups, **params), check_params=check_params,
    compresses=True, plan=STEP_PLAN))
