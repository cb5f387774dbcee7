"""What mixed precision changes for the project's own code: the loss scale gradients carry,
DeepSpeed's priming step, and the fp32 master copies an optimizer steps (`MasterParams`).

DeepSpeed keeps the loss scale in its optimizer wrappers' `loss_scale_config` (0.19; older
wrappers had `cur_scale`), and reads it from there itself (`engine._get_optimizer_loss_scale`).
Reading `cur_scale` alone gave 1.0 under fp16, so the metric lied and bucket-wise clipping
measured norms 2^16 too large."""
from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from commodity_bert.run_config import RunConfig


def current_loss_scale(optimizer) -> float:
    """The factor the gradients on the model's parameters carry now (1.0 in fp32 and bf16)."""
    if getattr(optimizer, "custom_loss_scaler", False):
        return float(optimizer.external_loss_scale)
    config = getattr(optimizer, "loss_scale_config", None)
    if config is not None:
        return float(config.cur_scale) if getattr(config, "use_grad_scaling", True) else 1.0
    return float(getattr(optimizer, "cur_scale", 1.0))


@functools.cache
def deepspeed_scales_stage0_fp16_losses() -> bool:
    """Whether this DeepSpeed's engine.backward() multiplies the loss by the loss scale under fp16
    at ZeRO stage 0. 0.19's does not (it scales for ZeRO's optimizers only), while its
    FP16_Optimizer and FP16_UnfusedOptimizer still divide the gradients by the scale in step():
    DeepSpeed PR #8393, open as of 2026-11, adds the missing branch, naming `fp16_enabled()` in
    engine.backward, which 0.19.8's backward never calls. Read from the source so that a
    DeepSpeed with the fix is not scaled twice."""
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine
    return "fp16_enabled()" in inspect.getsource(DeepSpeedEngine.backward)


def loss_for_backward(engine) -> Callable[[torch.Tensor], torch.Tensor]:
    """What to apply to the loss before engine.backward(), decided once at set-up: under fp16 at
    ZeRO stage 0, where DeepSpeed leaves the loss unscaled (above), multiply it by the wrapper's
    current loss scale. Unscaled, the gradients reached the optimizer the scale (65,536 at the
    start) times too small, and fp16 lost the protection the scale gives small gradients: on an
    H200, `tiny` in fp16 logged a gradient norm of 3.0e-5 at step 10 where fp32 logs 1.9
    (benchmarks/RESULTS.md#fp16-loss-scale). Elsewhere the loss as it is."""
    config = getattr(engine.optimizer, "loss_scale_config", None)
    if (not engine.fp16_enabled() or engine.zero_optimization() or config is None or not config.use_grad_scaling
            or getattr(engine.optimizer, "custom_loss_scaler", False) or deepspeed_scales_stage0_fp16_losses()):
        return lambda loss: loss
    return lambda loss: loss * config.cur_scale  # read at every call: the dynamic scale moves


def is_priming_step(optimizer: torch.optim.Optimizer) -> bool:
    """DeepSpeed's fp16/bf16 wrappers call the inner optimizer's step() once at construction,
    with all-zero gradients, to create its state. For the project's optimizers that call must
    change nothing: counted as a step it shifts LAMB's bias correction and 1-bit LAMB's freeze
    by one step and puts a trust ratio of 1 into the frozen coefficient's mean."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return not any(bool(g.any()) for g in grads)


class MasterParams:
    """The fp32 tensors the inner optimizer updates, and how to copy them into the model.

    Without mixed precision they are the model's parameters. Under fp16/bf16 DeepSpeed's wrapper
    keeps fp32 copies: FP16_UnfusedOptimizer (client optimizers, LAMB) a list per group,
    FP16_Optimizer (FusedAdam on a GPU) one flat tensor per group."""

    def __init__(self, engine_optimizer):
        self.optimizer = engine_optimizer
        if hasattr(engine_optimizer, "fp32_groups_flat"):
            self.tensors = list(engine_optimizer.fp32_groups_flat)
            self.kind = "flat"
        elif hasattr(engine_optimizer, "fp32_groups"):
            self.tensors = [p for group in engine_optimizer.fp32_groups for p in group]
            self.kind = "unfused"
        else:
            self.tensors = [p for group in engine_optimizer.param_groups for p in group["params"]]
            self.kind = "plain"

    def model_params(self) -> list[list]:
        """For each master tensor, the model parameters it holds, in its order."""
        if self.kind == "plain":
            return [[t] for t in self.tensors]
        if self.kind == "unfused":
            return [[p] for group in self.optimizer.fp16_groups for p in group]
        return [list(group) for group in self.optimizer.fp16_groups]

    def rank_state(self) -> dict:
        """What is this rank's own in a round: its parameters and its inner optimizer's state (and,
        under fp16, its loss scale: each rank skips its own overflows)."""
        state = {"optimizer": self.optimizer.state_dict()}
        if self.kind == "plain":  # the wrappers' state holds their fp32 copies; a plain optimizer's does not
            state["params"] = [t.detach().clone() for t in self.tensors]
        return state

    def load_rank_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        for t, saved in zip(self.tensors, state.get("params", ())):
            t.data.copy_(saved)
        self.push_to_model()

    def push_to_model(self) -> None:
        if self.kind == "unfused":
            for master, low in zip(self.tensors, (p for g in self.optimizer.fp16_groups for p in g)):
                low.data.copy_(master.data)
        elif self.kind == "flat":
            for master, group in zip(self.tensors, self.optimizer.fp16_groups):
                offset = 0
                for low in group:
                    low.data.copy_(master.data[offset: offset + low.numel()].view_as(low))
                    offset += low.numel()


def native_cpu_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX); elsewhere torch emulates it,
    several times slower than fp32 (a 2-core AMD EPYC without AVX-512: `mini` had not logged step
    50 after 6 minutes in bf16, where fp32 logs it at 116 s)."""
    if cpuinfo is None:
        try:
            cpuinfo = open("/proc/cpuinfo").read()
        except OSError:  # not Linux: nothing to tell
            return True
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def cpu_bf16_warning(config_path: str, config: RunConfig | dict, cpuinfo: str | None = None) -> str | None:
    """One line for a bf16 config on a CPU without native bf16, naming the fp32 config to use."""
    if not RunConfig.of(config).bf16 or native_cpu_bf16(cpuinfo):
        return None
    path = Path(config_path)
    fp32 = path.with_name(path.name.replace("bf16", "fp32"))
    instead = f"use {fp32}" if "bf16" in path.name and fp32.is_file() else 'set "bf16": {"enabled": false}'
    return (f"warning: {path.name} trains in bf16, but this CPU has no native bf16 (no AVX-512 BF16 or AMX "
            f"in /proc/cpuinfo): torch emulates it, several times slower than fp32; {instead}")


def one_pass_master_step(engine) -> bool:
    """Give the engine's FP16_UnfusedOptimizer (DeepSpeed's wrapper of a client optimizer under
    fp16 and bf16 at ZeRO stage 0: LAMB, 1-bit LAMB, 0/1 Adam, a CPU's AdamW) `ForeachMasterStep`'s
    step. Returns whether it did. DeepSpeed picks the wrapper inside `deepspeed.initialize` and
    takes no other, so the instance's class is changed to the subclass: the same object, state,
    checkpoints and loss scale, another step()."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    optimizer = engine.optimizer
    if type(optimizer) is not FP16_UnfusedOptimizer or optimizer.fused_lamb_legacy:
        return False
    optimizer.__class__ = _foreach_master_step_class()
    return True


@functools.cache
def _foreach_master_step_class():
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    class ForeachMasterStep(FP16_UnfusedOptimizer):
        """FP16_UnfusedOptimizer.step() with the work on all tensors at once. DeepSpeed's checks
        each gradient for inf/NaN with a host sync per tensor, sums the gradient norm tensor by
        tensor, and casts, unscales and copies back one tensor at a time: for `mini` 1,908
        operations and 79 host syncs a LAMB step, against 140 and 1 here
        (benchmarks/master_step_ops.py); on a GPU each is a kernel launch or a stall. Here: one
        `_foreach_norm` (in fp32, as DeepSpeed's `.float().norm()`) whose total, synced once, is
        both the overflow check (a non-finite gradient makes it non-finite) and the clipping
        norm; `_foreach_copy_` casts the gradients into the fp32 masters' and the masters back
        into the model; one `_foreach_mul_` unscales and clips where the factor is not 1. The
        same updates (tests/test_precision.py): bit for bit without clipping, within float
        rounding of the norm's summation order with it."""

        def agreed_overflow(self, local: torch.Tensor) -> torch.Tensor:
            """DeepSpeed's CheckOverflow.has_overflow agreement on this rank's flag, with its
            collectives: where each rank steps on its own gradient (1-bit LAMB after its freeze,
            0/1 Adam: the engine's backward allreduce is off), the ranks must skip together,
            before any exchange inside the step."""
            from deepspeed import comm as dist
            flag = local.to(torch.uint8).reshape(1)
            checker, engine = self.overflow_checker, self.overflow_checker.deepspeed
            own_gradients = engine is not None and engine.enable_backward_allreduce is False
            if checker.zero_reduce_scatter:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=dist.get_world_group())
            elif checker.mpu is not None:
                if own_gradients:
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=checker.mpu.get_data_parallel_group())
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=checker.mpu.get_model_parallel_group())
            elif own_gradients:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=dist.get_world_group())
            return flag

        @torch.no_grad()
        def step(self, closure=None):
            low = [p for group in self.fp16_groups for p in group]
            masters = [p for group in self.fp32_groups for p in group]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in low]
            squares = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()
            overflow = self.agreed_overflow(~torch.isfinite(squares))
            if self.mpu is not None:  # DeepSpeed's get_weight_norm sums over the model-parallel group
                from deepspeed import comm as dist
                dist.all_reduce(squares, group=self.mpu.get_model_parallel_group())
            # the one sync: an agreed overflow reads as an infinite norm
            norm = float(torch.where(overflow[0] > 0, torch.full_like(squares, float("inf")), squares)) ** 0.5
            if norm != norm or norm in (float("inf"), float("-inf")):
                return self._skip_invalid_grad_norm()
            self.overflow = False
            self._global_grad_norm = norm
            master_grads = [torch.empty_like(p) for p in masters]
            torch._foreach_copy_(master_grads, grads)
            for master, grad in zip(masters, master_grads):
                master.grad = grad
            self._update_scale(False)
            combined_scale = self.unscale_and_clip_grads(norm, apply_scale=False)
            if combined_scale != 1.0:
                torch._foreach_mul_(master_grads, 1.0 / combined_scale)
            self.optimizer.step()
            for master in masters:
                master.grad = None
            torch._foreach_copy_(low, masters)
            return self.overflow

    return ForeachMasterStep
