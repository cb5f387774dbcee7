"""The mean of a flat fp32 tensor over a group's ranks, sent as 8-, 4- or 2-bit integers with one
fp32 scale per block of values: DiLoCo's `int8`, `int4` and `int2` pseudo-gradients (diloco.py).

Reduce-scatter by all-to-all (rank j averages chunk j of every rank), then an all-gather of the
averaged chunks, each way quantized: gloo and NCCL both have these collectives, and each rank
sends about one quantized copy of the tensor in all, as a ring allreduce would in fp32.

Quantization, per block of BLOCK values: scale = max |x| / L with L = 2^(bits−1) − 1 (127, 7 or 1),
q = round(x / scale) in [−L, L] (int2: L = 1, the levels −1, 0 and 1). `rounding` "nearest" rounds to the nearest level (halves to
even), "stochastic" rounds up with probability equal to the fraction (unbiased: E[q·scale] = x),
from a generator seeded by rank, kept in the state so a resumed run draws what it would have.
int4 packs two values per byte (q + 8, the first value in the high nibble), int2 four (q + 1, a
little-endian bit stream: `pack_bits`).

With `error_feedback` what quantization dropped is added to the next call's input: the worker's
error over its whole tensor and the server's over its chunk, as the 1-bit allreduce does
(onebit_allreduce.py), so over calls the running mean of the outputs converges to the exact mean.
The errors are this rank's own (saved in its own checkpoint file).

Written here because neither torch nor DeepSpeed has a low-bit allreduce that runs on gloo.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

BLOCK = 256  # values per fp32 scale: 4/256 byte a value of overhead (int4: 4.125 bits a value)
ROUNDINGS = ("nearest", "stochastic")


def levels(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def dense_bytes(numel: int, bits: int, world: int) -> int:
    """Bytes a rank sends in one average of `numel` values: its all-to-all of W − 1 of the W packed
    chunks, then its averaged chunk to each of the W − 1 others."""
    chunk = -(-numel // (BLOCK * world)) * BLOCK
    packed = chunk * bits // 8 + 4 * chunk // BLOCK
    return 2 * (world - 1) * packed


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers below 2^width as one little-endian bit stream of ⌈n · width / 8⌉ bytes."""
    codes = codes.reshape(-1).to(torch.int32)
    bits = torch.stack([(codes >> j) & 1 for j in range(width)], dim=1).to(torch.uint8).reshape(-1)
    bits = torch.cat([bits, bits.new_zeros(-bits.numel() % 8)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32, device=codes.device)
    return (bits.view(-1, 8).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The `count` integers `pack_bits` packed, as int64."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = ((packed[:, None] >> shifts) & 1).reshape(-1)[: count * width].view(count, width).to(torch.int64)
    return (bits << torch.arange(width, device=packed.device)).sum(dim=1)




def quantize(x: torch.Tensor, bits: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the packed bytes, the values they stand for) of x (numel a multiple of BLOCK). With a
    generator, stochastic rounding; without, to the nearest level."""
    top = levels(bits)
    blocks = x.view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1).clamp_min(1e-30) / top
    scaled = blocks / scales[:, None]
    if generator is None:
        q = torch.round(scaled)
    else:
        noise = torch.rand(scaled.shape, generator=generator, device="cpu").to(scaled.device)
        q = torch.floor(scaled + noise)
    q = q.clamp_(-top, top)
    stands_for = (q * scales[:, None]).reshape(-1)
    q = q.to(torch.int8)
    if bits == 8:
        values = q.view(torch.uint8).reshape(-1)
    elif bits == 2:
        values = pack_bits(q + 1, 2)
    else:
        nibbles = (q + 8).to(torch.uint8).reshape(-1, 2)
        values = nibbles[:, 0] * 16 + nibbles[:, 1]
    return torch.cat([values, scales.view(torch.uint8)]), stands_for


def dequantize(packed: torch.Tensor, values: int, bits: int) -> torch.Tensor:
    """The fp32 values that `quantize` packed (`values` of them)."""
    body = values * bits // 8
    scales = packed[body:].view(torch.float32)
    if bits == 8:
        q = packed[:body].view(torch.int8).float()
    elif bits == 2:
        q = unpack_bits(packed[:body], 2, values).float() - 1
    else:
        high, low = packed[:body] // 16, packed[:body] % 16
        q = torch.stack([high, low], dim=1).reshape(-1).float() - 8
    return (q.view(-1, BLOCK) * scales[:, None]).reshape(-1)


class LowBitAverage:
    def __init__(self, numel: int, bits: int, device, group=None, rounding: str = "nearest",
                 error_feedback: bool = False, seed: int = 0):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.numel, self.bits = numel, bits
        self.chunk = -(-numel // (BLOCK * self.world)) * BLOCK
        self.padded = self.chunk * self.world
        self.error_feedback = error_feedback
        self.worker_error = torch.zeros(self.padded, device=device) if error_feedback else None
        self.server_error = torch.zeros(self.chunk, device=device) if error_feedback else None
        self.generator = None
        if rounding == "stochastic":
            self.generator = torch.Generator()  # on the CPU: the same draws on any device
            self.generator.manual_seed(seed * 1000003 + dist.get_rank())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(self.padded, device=x.device)
        padded[: self.numel] = x
        if self.error_feedback:
            padded += self.worker_error
        chunks = [quantize(c, self.bits, self.generator) for c in padded.view(self.world, self.chunk)]
        sent = torch.cat([packed for packed, _ in chunks])
        if self.error_feedback:
            torch.sub(padded, torch.cat([stands for _, stands in chunks]), out=self.worker_error)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)
        mine = torch.stack([dequantize(r, self.chunk, self.bits) for r in received.view(self.world, -1)]).mean(dim=0)
        if self.error_feedback:
            mine += self.server_error
        packed, stands_for = quantize(mine, self.bits, self.generator)
        if self.error_feedback:
            torch.sub(mine, stands_for, out=self.server_error)
        gathered = torch.empty(self.world * packed.numel(), dtype=torch.uint8, device=x.device)
        dist.all_gather_into_tensor(gathered, packed, group=self.group)
        out = torch.cat([dequantize(g, self.chunk, self.bits) for g in gathered.view(self.world, -1)])
        return out[: self.numel]

    def state_dict(self) -> dict:
        state = {}
        if self.error_feedback:
            state.update(worker_error=self.worker_error.cpu(), server_error=self.server_error.cpu())
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.error_feedback and "worker_error" in state and state["worker_error"].shape == self.worker_error.shape:
            self.worker_error.copy_(state["worker_error"])
            self.server_error.copy_(state["server_error"])
        if self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])
