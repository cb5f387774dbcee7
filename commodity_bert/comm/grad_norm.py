"""The gradient norm of the metrics: the L2 norm of the gradient averaged over ranks, without the
loss scale, before any clipping (where ranks step on their own gradients, see below).

Where DeepSpeed has averaged the gradients by the time backward returns (its allreduce, ZeRO 0)
the norm costs no communication. Where the ranks' gradients are never averaged in full
precision (bucket-wise clipping sends clipped buckets; 1-bit LAMB after the freeze sends 1-bit
momenta), they are averaged here once, at logged steps only, and the caller leaves that
traffic out of `bytes_sent`. Where each rank steps on its own gradient (DiLoCo; 0/1 Adam's
1-bit and local steps) the caller asks for this rank's own norm (`averaged=True` on unaveraged gradients: no communication)
and the metrics row combines the ranks' norms. Under ZeRO 1/2 the gradients are partitioned and DeepSpeed's own
norm (`engine.get_global_grad_norm()`: averaged, unscaled, before clipping) is the same
quantity."""
from __future__ import annotations

import torch
import torch.distributed as dist


def gradient_norm(params, loss_scale: float, averaged: bool) -> torch.Tensor | None:
    """On the device, no host sync; None when no parameter holds a gradient (DeepSpeed's own
    fp16/bf16 optimizers keep them in flat buffers of their own)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    if averaged:
        # measured every step on this path: one fused launch for all tensors, fp32 even for bf16
        norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
        return torch.linalg.vector_norm(norms) / loss_scale
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    return torch.linalg.vector_norm(flat) / (dist.get_world_size() * loss_scale)
