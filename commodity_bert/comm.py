"""Communication: bytes on the wire, and the error-compensated 1-bit allreduce.

Only collectives that gloo (CPU) and NCCL (GPU) both provide are used, and any world size
works (no power-of-two assumption).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

# ---------------------------------------------------------------------------- bytes on the wire


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


# ------------------------------------------------------------------------- 1-bit compression

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Signs of x (sign(0) = +1) as bits, 8 per byte; x.numel() must be a multiple of 8."""
    bits = (x >= 0).to(torch.uint8).view(-1, 8)
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """±1 values from packed sign bits."""
    bits = packed.view(-1, 1).bitwise_and(_BIT_WEIGHTS.to(packed.device)).ne(0)
    return bits.view(-1).to(dtype) * 2 - 1


class CompressedAllreduce:
    """Error-compensated 1-bit allreduce (1-bit Adam/LAMB papers; ALGORITHMS.md).

    Each rank adds its worker error to the buffer, sends signs (1 bit per element) and one
    scale; rank j averages chunk j of every rank ("server"), adds its server error, and sends
    back signs and one scale for its chunk. Both errors are kept across calls (and saved in
    checkpoints), so the compression error is fed back rather than lost: the running average
    of the outputs converges to the exact average.
    """

    def __init__(self, numel: int, device, group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        multiple = 8 * self.world
        self.numel = numel
        self.padded = -(-numel // multiple) * multiple
        self.chunk = self.padded // self.world
        self.worker_error = torch.zeros(self.padded, device=device)
        self.server_error = torch.zeros(self.chunk, device=device)

    def state_dict(self) -> dict:
        return {"worker_error": self.worker_error, "server_error": self.server_error}

    def load_state_dict(self, state: dict) -> None:
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])

    def __call__(self, buffer: torch.Tensor) -> torch.Tensor:
        """The (approximate) average of `buffer` over ranks; `buffer` is flat, fp32."""
        x = torch.zeros(self.padded, device=buffer.device)
        x[: self.numel] = buffer
        x += self.worker_error
        scale = x.norm() / self.padded ** 0.5
        signs = pack_signs(x)
        self.worker_error = x - scale * unpack_signs(signs)

        # worker → server: chunk j of every rank's signs goes to rank j, with every scale
        received = torch.empty_like(signs)
        dist.all_to_all_single(received, signs, group=self.group)
        scales = [torch.empty_like(scale.view(1)) for _ in range(self.world)]
        dist.all_gather(scales, scale.view(1), group=self.group)
        chunk_bytes = self.chunk // 8
        server = torch.zeros(self.chunk, device=buffer.device)
        for i in range(self.world):
            server += scales[i] * unpack_signs(received[i * chunk_bytes:(i + 1) * chunk_bytes])
        server = server / self.world + self.server_error
        server_scale = server.norm() / self.chunk ** 0.5
        server_signs = pack_signs(server)
        self.server_error = server - server_scale * unpack_signs(server_signs)

        # server → every rank: all chunks' signs and scales
        all_signs = [torch.empty_like(server_signs) for _ in range(self.world)]
        dist.all_gather(all_signs, server_signs, group=self.group)
        all_scales = [torch.empty_like(server_scale.view(1)) for _ in range(self.world)]
        dist.all_gather(all_scales, server_scale.view(1), group=self.group)
        out = torch.cat([s * unpack_signs(p) for s, p in zip(all_scales, all_signs)])
        return out[: self.numel]
