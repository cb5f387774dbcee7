"""The error-compensated 1-bit allreduce of 1-bit LAMB, and its sign packing.

Only collectives that gloo (CPU) and NCCL (GPU) both provide are used, and any world size
works (no power-of-two assumption).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_nonnegative(nonneg: torch.Tensor) -> torch.Tensor:
    """A bool tensor as bits, 8 per byte, first element in the high bit; numel a multiple of 8."""
    if nonneg.device.type == "cpu":
        # numpy's C loop: the tensor expression below makes several full-size passes, which on
        # a CPU cost seconds a step for BERT-base's 110M momenta
        return torch.from_numpy(np.packbits(nonneg.numpy()))
    bits = nonneg.to(torch.uint8).view(-1, 8)
    return (bits * _BIT_WEIGHTS.to(nonneg.device)).sum(dim=1, dtype=torch.uint8)


def unpack_nonnegative(packed: torch.Tensor) -> torch.Tensor:
    """The bool tensor that pack_nonnegative packed."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy())).view(torch.bool)
    return packed.view(-1, 1).bitwise_and(_BIT_WEIGHTS.to(packed.device)).ne(0).view(-1)


class CompressedAllreduce:
    """Error-compensated 1-bit allreduce (1-bit Adam/LAMB papers; docs/ALGORITHMS.md).

    Each rank adds its worker error to the buffer, sends signs (1 bit per element) and its
    scales; rank j averages chunk j of every rank ("server"), adds its server error, and sends
    back signs and scales for its chunk. Both errors are kept across calls (and saved in
    checkpoints), so the compression error is fed back rather than lost: the running average
    of the outputs converges to the exact average.

    `scale_block` is the number of elements that share one scale. The default (None) is one
    scale per chunk, the papers' choice. A smaller block (e.g. 256, one embedding row) costs
    32 / scale_block extra bits per element and keeps small-magnitude blocks from being
    quantized to the chunk's average magnitude, which is what hurts at small batch sizes.
    """

    def __init__(self, numel: int, device, group=None, scale_block: int | None = None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.numel = numel
        if scale_block is None:
            multiple = 8 * self.world
            self.padded = -(-numel // multiple) * multiple
            self.block = self.padded // self.world
        else:
            self.block = -(-max(scale_block, 8) // 8) * 8
            multiple = self.block * self.world
            self.padded = -(-numel // multiple) * multiple
        self.chunk = self.padded // self.world
        self.worker_error = torch.zeros(self.padded, device=device)
        self.server_error = torch.zeros(self.chunk, device=device)

    def state_dict(self) -> dict:
        return {"worker_error": self.worker_error, "server_error": self.server_error}

    def load_state_dict(self, state: dict) -> None:
        if state["worker_error"].shape != self.worker_error.shape or \
                state["server_error"].shape != self.server_error.shape:
            # saved with other ranks or nodes: its errors belong to another split of the tensor
            self.reset()
            if dist.get_rank() == 0:
                print("1-bit allreduce: the checkpoint's error feedback was saved with another number of ranks "
                      "or nodes; starting it from zero", flush=True)
            return
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])

    def reset(self) -> None:
        self.worker_error.zero_()
        self.server_error.zero_()

    def _quantize(self, x: torch.Tensor):
        """Signs (packed), one scale per block keeping the block's L2 norm, and the values they
        stand for (sign × scale), from which the caller's error feedback is computed."""
        scales = x.view(-1, self.block).norm(dim=1) / self.block ** 0.5
        nonneg = x >= 0
        return pack_nonnegative(nonneg), scales, self._signed(nonneg, scales)

    def _signed(self, nonneg: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        # in-place ±1 then × scale: on a CPU, torch.where broadcasting the scales is ~2× slower
        signed = nonneg.to(scales.dtype).mul_(2).sub_(1)
        signed.view(-1, self.block).mul_(scales.view(-1, 1))
        return signed

    def _dequantize(self, signs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return self._signed(unpack_nonnegative(signs), scales)

    def __call__(self, buffer: torch.Tensor) -> torch.Tensor:
        """The (approximate) average of `buffer` over ranks; `buffer` is flat, fp32."""
        x = self.worker_error.clone()
        x[: self.numel] += buffer
        signs, scales, sent = self._quantize(x)
        torch.sub(x, sent, out=self.worker_error)

        # worker → server: chunk j of every rank's signs and scales goes to rank j
        received_signs = torch.empty_like(signs)
        dist.all_to_all_single(received_signs, signs, group=self.group)
        received_scales = torch.empty_like(scales)
        dist.all_to_all_single(received_scales, scales, group=self.group)
        server = self._dequantize(received_signs, received_scales).view(self.world, self.chunk).mean(dim=0)
        server += self.server_error
        server_signs, server_scales, server_sent = self._quantize(server)
        torch.sub(server, server_sent, out=self.server_error)

        # server → every rank: all chunks' signs and scales
        all_signs = torch.empty(self.padded // 8, dtype=torch.uint8, device=buffer.device)
        dist.all_gather_into_tensor(all_signs, server_signs, group=self.group)
        all_scales = torch.empty(self.padded // self.block, device=buffer.device)
        dist.all_gather_into_tensor(all_scales, server_scales, group=self.group)
        return self._dequantize(all_signs, all_scales)[: self.numel]


class TwoLevelCompressedAllreduce:
    """The 1-bit allreduce between nodes only: the node's ranks sum in full precision first, and
    each local rank that holds a slice runs the compressed exchange on it with the same local rank
    of every other node (topology.py). Its error feedback covers this rank's slice only; a rank
    that holds none (on a node larger than the smallest) has none."""

    def __init__(self, numel: int, device, hierarchy, scale_block: int | None = None):
        self.hierarchy = hierarchy
        self.between = CompressedAllreduce(hierarchy.slice_numel(numel), device, group=hierarchy.cross,
                                           scale_block=scale_block) if hierarchy.holds_slice else None

    def __call__(self, buffer: torch.Tensor) -> torch.Tensor:
        return self.hierarchy.average(buffer, self.between)

    def state_dict(self) -> dict:
        if self.between is None:
            return {"worker_error": torch.zeros(0), "server_error": torch.zeros(0)}
        return self.between.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.between is None:
            return
        self.between.load_state_dict(state)

    def reset(self) -> None:
        if self.between is not None:
            self.between.reset()


def compressed_allreduce(numel: int, device, scale_block: int | None,
                        hierarchy=None) -> CompressedAllreduce | TwoLevelCompressedAllreduce:
    """Flat over all ranks, or in two levels where the mode found several ranks per node."""
    if hierarchy is None:
        return CompressedAllreduce(numel, device, scale_block=scale_block)
    return TwoLevelCompressedAllreduce(numel, device, hierarchy, scale_block)
