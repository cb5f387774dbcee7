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
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type != device.type or obj.is_meta:
                continue
            storage = obj.untyped_storage()
        except Exception:  # noqa: BLE001 - objects half torn down, tensor subclasses without storage
            continue
        storages.setdefault(storage.data_ptr(), storage.nbytes())
    storages.pop(0, None)  # empty tensors
    return sum(storages.values())


def peak_allocated_bytes(device: torch.device) -> int | None:
    """The CUDA caching allocator's peak since the process started (None off a GPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
