"""What a rank's memory holds at the end of a run, for summary.json and for checking the planner's
memory model (plan/memory.py) against the engine's real tensors: every tensor alive on the rank's
device, each storage once, and on a GPU the allocator's peak."""
from __future__ import annotations

import gc

import torch


def live_tensor_bytes(device: torch.device) -> int:
    """Bytes of the tensors alive in this process on `device`'s type, each storage counted once.
    Between steps that is the weights, gradients, master copies and optimizer state, and the
    communication mode's own (error feedback, DiLoCo's outer state); activations are freed."""
    # no gc.collect() first (0.8 s in a trainer's process): between steps the activations are
    # freed by their reference counts, and what a cycle still holds is held all the same
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        # by exact type: torch.compile's fake tensors have no data, and isinstance would ask
        # every object, deprecated module attributes included, for its class
        kind = type(obj)
        if (kind is not torch.Tensor and kind is not torch.nn.Parameter) or obj.device.type != device.type \
                or obj.is_meta:
            continue
        try:
            storage = obj.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage.nbytes())
        except RuntimeError:  # a tensor without storage
            continue
    storages.pop(0, None)  # empty tensors
    return sum(storages.values())


def peak_allocated_bytes(device: torch.device) -> int | None:
    """The CUDA caching allocator's peak since the process started (None off a GPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
