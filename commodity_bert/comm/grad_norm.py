"""The gradient norm of the metrics, before any clipping, without the loss scale, and with no
communication of its own.

Where DeepSpeed has averaged the gradients by the time backward returns (its allreduce at ZeRO
0; under ZeRO 1/2 DeepSpeed's own `engine.get_global_grad_norm()`, the same quantity), it is the
L2 norm of the gradient averaged over ranks. Where backward leaves each rank its own gradient
(bucket-wise clipping, whose clipped buckets are in flight; 1-bit LAMB after its freeze, which
sends 1-bit momenta; 0/1 Adam; DiLoCo), each rank takes its own gradient's norm and the metrics
row combines them, as the root mean square over ranks, in its own small allreduce
(bookkeeping.py). That is not the norm of the average, which no rank holds: averaging the
gradient in full precision just to log it sent 57% more than 1-bit LAMB's compressed stage at
log-every 50, and a whole extra allreduce at every logged step under bucket-wise clipping. By
the triangle inequality it is at least the norm of the average, equal when the ranks'
gradients agree, and √N times it at most."""
from __future__ import annotations

import torch


def gradient_norm(params, loss_scale: float) -> torch.Tensor | None:
    """The norm of the gradients this rank holds. On the device, no host sync; None when no
    parameter holds a gradient (DeepSpeed's own fp16/bf16 optimizers keep them in flat buffers
    of their own)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    # measured every step on some paths: one fused launch for all tensors, fp32 even for bf16
    norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
    return torch.linalg.vector_norm(norms) / loss_scale
