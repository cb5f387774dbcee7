"""Bucket-wise gradient clipping before allreduce (MLPerf BERT; docs/ALGORITHMS.md).

Clipping after the allreduce needs the reduced gradient, clipping before it needs the whole
local norm: either way communication waits for the end of backward. Here the gradients are
grouped into B buckets in the order backward produces them; as soon as a bucket is complete
on the last micro-batch, it is clipped locally to c/√B (its norm taken without the loss
scale), divided by the world size and allreduced asynchronously, overlapping the rest of
backward. Each rank's clipped gradient has norm ≤ c, so the average does too. DeepSpeed's own
allreduce and clipping are switched off.

Enabled by the project block of the DeepSpeed config:
    "commodity_bert": {"bucketwise_clipping": {"enabled": true, "bucket_mb": 25, "max_norm": 1.0}}
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from commodity_bert.run_config import RunConfig, register_section


DEFAULTS = {"enabled": False, "bucket_mb": 25, "max_norm": 1.0}


def check_settings(settings: dict, config: RunConfig) -> str | None:
    if not isinstance(settings["enabled"], bool):
        return f'"commodity_bert.bucketwise_clipping.enabled" must be true or false, not {settings["enabled"]!r}'
    for key in ("bucket_mb", "max_norm"):
        value = settings[key]
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            return f'"commodity_bert.bucketwise_clipping.{key}" {value!r}: give a number above 0'
    return None


register_section("bucketwise_clipping", DEFAULTS, check_settings)


def bucket_mb(config: RunConfig | dict) -> float:
    """The buckets' size, whether or not the config enables the clipping (bert-plan prices it)."""
    return RunConfig.of(config).section("bucketwise_clipping")["bucket_mb"]


def bucketwise_settings(config: RunConfig | dict) -> dict | None:
    """The section with its defaults where it is enabled, else None."""
    settings = RunConfig.of(config).section("bucketwise_clipping")
    return settings if settings["enabled"] else None


class BucketwiseClipAllreduce:
    def __init__(self, params: list[torch.nn.Parameter], bucket_mb: float, max_norm: float,
                 loss_scale: Callable[[], float]):
        self.world = dist.get_world_size()
        self.max_norm = max_norm
        self.loss_scale = loss_scale
        # backward produces gradients roughly in reverse order of the parameters
        params = [p for p in params if p.requires_grad]
        self.buckets: list[list[torch.nn.Parameter]] = [[]]
        size, limit = 0, bucket_mb * 2**20
        for p in reversed(params):
            if size and size + p.numel() * p.element_size() > limit:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.pending = [0] * len(self.buckets)
        self.in_flight: list[tuple[object, torch.Tensor, int]] = []
        self.boundary = False
        self.clip_factors: list[torch.Tensor] = []
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def start_boundary_backward(self) -> None:
        """Call before the backward of the last micro-batch: its gradients are communicated."""
        self.boundary = True
        self.pending = [len(bucket) for bucket in self.buckets]
        self.clip_factors = []

    def _grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self.boundary:
            return
        b = self.bucket_of[id(param)]
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self._launch(b)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        flat = torch.cat([p.grad.reshape(-1).float() for p in bucket])
        norm = flat.norm() / self.loss_scale()
        limit = self.max_norm / math.sqrt(len(self.buckets))
        factor = 1.0 / torch.clamp(norm / limit, min=1.0)
        self.clip_factors.append(factor)
        flat.mul_(factor / self.world)
        self.in_flight.append((dist.all_reduce(flat, async_op=True), flat, b))

    def finish(self) -> None:
        """Wait for every bucket and write the averaged, clipped gradients back."""
        for b, remaining in enumerate(self.pending):
            if remaining:  # parameters that got no gradient this step: nothing to wait for
                raise RuntimeError(f"bucket {b}: {remaining} parameters produced no gradient; "
                                   f"bucket-wise clipping needs every parameter in the graph")
        for handle, flat, b in self.in_flight:
            handle.wait()
            offset = 0
            for p in self.buckets[b]:
                p.grad.copy_(flat[offset: offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.in_flight.clear()
        self.boundary = False
