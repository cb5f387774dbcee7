"""Bytes this rank sends over the network, counted for every collective whoever calls it."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _world(group) -> int:
    return dist.get_world_size(group)


def _arg(args, kwargs, index: int, *names: str):
    """A collective's argument, given by position or by any of its keyword names."""
    if len(args) > index:
        return args[index]
    return next((kwargs[n] for n in names if n in kwargs), None)


def _ring(fraction_of, index: int, *names: str, all_but_self: bool = False):
    """Bytes sent by one rank of N: (N−1)/N of a tensor (reduce-scatter, all-to-all),
    2(N−1)/N (allreduce: reduce-scatter + all-gather) or (N−1)× a chunk (all-gather)."""
    def volume(args, kwargs):
        n = _world(kwargs.get("group"))
        size = _nbytes(_arg(args, kwargs, index, *names))
        return (n - 1) * size if all_but_self else fraction_of * (n - 1) * size // n
    return volume


_SENT = {
    "all_reduce": _ring(2, 0, "tensor"),
    "reduce_scatter_tensor": _ring(1, 1, "input"),
    "reduce_scatter": _ring(1, 1, "input_list"),
    "all_to_all_single": _ring(1, 1, "input"),
    "all_gather_into_tensor": _ring(1, 1, "input_tensor", all_but_self=True),
    "all_gather": _ring(1, 1, "tensor", all_but_self=True),
    "broadcast": lambda args, kwargs: _nbytes(_arg(args, kwargs, 0, "tensor")),
}


class BytesCounter:
    """Counts the bytes this rank's collectives send, whoever calls them (DeepSpeed's gradient
    allreduce, ZeRO's reduce-scatter, the 1-bit exchange), by wrapping torch.distributed's
    functions. Ring-algorithm volumes: allreduce 2(N−1)/N·size, reduce-scatter and all-to-all
    (N−1)/N·size, all-gather (N−1)·chunk."""

    def __init__(self):
        self.total = 0
        self._originals: dict = {}

    def install(self) -> BytesCounter:
        for name, volume in _SENT.items():
            original = getattr(dist, name, None)
            if original is None or name in self._originals:
                continue
            self._originals[name] = original

            @functools.wraps(original)
            def counted(*args, __original=original, __volume=volume, **kwargs):
                self.total += int(__volume(args, kwargs)) if _world(kwargs.get("group")) > 1 else 0
                return __original(*args, **kwargs)
            setattr(dist, name, counted)
        return self

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()
