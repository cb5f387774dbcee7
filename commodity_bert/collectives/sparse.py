"""The mean of a flat fp32 tensor over a group's ranks, each rank sending only its largest values:
DiLoCo's `sparse` pseudo-gradients (diloco.py), after SparseLoCo (arXiv 2508.15706).

Per chunk of CHUNK values a rank keeps the k = round(density · CHUNK) of largest magnitude and
codes each in `bits` bits: a sign and a magnitude level m in 1..M (M = 2^(bits−1)), standing for
m · s / M with s the chunk's largest kept magnitude (one fp32 scale a chunk); 2 bits keep
{±s/2, ±s}. Where in its chunk each value lies travels as an offset of log2(CHUNK) bits (12).
What is not sent stays in the rank's residual and is added to the next call's input (error
feedback, always on): sent + new residual = input + old residual, so over rounds nothing is lost.

The payload has a fixed size (chunks · (k · (12 + bits) / 8 + 4) bytes, offsets and codes each one
bit stream), so one all-gather moves every rank's payload to every rank; each rank decodes them in
rank order and sums, so every rank rebuilds the same mean. Sparse payloads cannot be summed on
the way: a rank sends its payload to W − 1 peers (ring all-gather) and receives theirs, where the
dense low-bit exchange (lowbit.py) sends about 2 · (W − 1) / W of one low-bit copy whatever W is.
`sparse_bytes` and `lowbit.dense_bytes` price both; diloco.py takes the cheaper.

Written here because neither torch nor DeepSpeed has a top-k exchange, nor one that runs on gloo.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from commodity_bert.collectives.lowbit import pack_bits, unpack_bits

CHUNK = 4096  # values a chunk: offsets in 12 bits, one fp32 scale per 4,096 values
OFFSET_BITS = int(math.log2(CHUNK))
VALUE_BITS = (2, 4)


def kept_per_chunk(density: float) -> int:
    return max(1, round(density * CHUNK))


def sections(chunks: int, density: float, bits: int) -> tuple[int, int, int]:
    """The bytes of a payload's offsets, codes and scales for `chunks` chunks."""
    k = kept_per_chunk(density)
    return -(-chunks * k * OFFSET_BITS // 8), -(-chunks * k * bits // 8), 4 * chunks


def payload_bytes(numel: int, density: float, bits: int) -> int:
    """One rank's payload for a tensor of `numel` values: offsets, codes and scales."""
    return sum(sections(-(-numel // CHUNK), density, bits))


def sparse_bytes(numel: int, density: float, bits: int, world: int) -> int:
    """Bytes a rank sends in one sparse average: its payload to each of the W − 1 others."""
    return (world - 1) * payload_bytes(numel, density, bits)


def encode(x: torch.Tensor, density: float, bits: int, generator: torch.Generator | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the payload, the dense values it stands for) of x (numel a multiple of CHUNK): the top k of
    each chunk by magnitude, rounded to the nearest level (with a generator: stochastically)."""
    chunks = x.view(-1, CHUNK)
    k, top = kept_per_chunk(density), 2 ** (bits - 1)
    offsets = chunks.abs().topk(k, dim=1, sorted=False).indices
    kept = chunks.gather(1, offsets)
    scales = kept.abs().amax(dim=1).clamp_min(1e-30)
    scaled = kept.abs() / scales[:, None] * top
    if generator is None:
        level = torch.round(scaled)
    else:
        level = torch.floor(scaled + torch.rand(scaled.shape, generator=generator).to(scaled.device))
    level = level.clamp_(1, top)
    negative = kept < 0
    stands_for = torch.zeros_like(chunks).scatter_(
        1, offsets, torch.where(negative, -level, level) * (scales / top)[:, None]).reshape(-1)
    codes = negative.to(torch.int32) * top + (level.to(torch.int32) - 1)
    payload = torch.cat([pack_bits(offsets, OFFSET_BITS), pack_bits(codes, bits), scales.view(torch.uint8)])
    return payload, stands_for


def decode_into(out: torch.Tensor, payload: torch.Tensor, density: float, bits: int) -> None:
    """Adds the dense values of one payload to `out` (numel a multiple of CHUNK)."""
    rows = out.view(-1, CHUNK)
    chunks, k, top = rows.shape[0], kept_per_chunk(density), 2 ** (bits - 1)
    offset_bytes, code_bytes, _ = sections(chunks, density, bits)
    offsets = unpack_bits(payload[:offset_bytes], OFFSET_BITS, chunks * k).view(chunks, k)
    codes = unpack_bits(payload[offset_bytes: offset_bytes + code_bytes], bits, chunks * k).view(chunks, k)
    scales = payload[offset_bytes + code_bytes:].clone().view(torch.float32)  # a payload may start unaligned
    level = (codes % top + 1).float()
    values = torch.where(codes >= top, -level, level) * (scales / top)[:, None]
    rows.scatter_add_(1, offsets, values)  # a chunk's offsets are distinct: no two adds meet


class SparseAverage:
    def __init__(self, numel: int, density: float, bits: int, device, group=None, rounding: str = "nearest",
                 seed: int = 0):
        self.group = group
        self.world = dist.get_world_size(group)
        self.numel, self.density, self.bits = numel, density, bits
        self.padded = -(-numel // CHUNK) * CHUNK
        self.residual = torch.zeros(self.padded, device=device)
        self.sent_share = None  # of the last call: ‖sent‖² / ‖input + residual‖², this rank's (None: all zero)
        self.generator = None
        if rounding == "stochastic":
            self.generator = torch.Generator()  # on the CPU: the same draws on any device
            self.generator.manual_seed(seed * 1000003 + dist.get_rank())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        wanted = self.residual.clone()
        wanted[: self.numel] += x
        payload, sent = encode(wanted, self.density, self.bits, self.generator)
        torch.sub(wanted, sent, out=self.residual)
        pending = float(wanted.square().sum())
        self.sent_share = float(sent.square().sum()) / pending if pending > 0 else None  # None: nothing to send
        gathered = torch.empty(self.world * payload.numel(), dtype=torch.uint8, device=x.device)
        dist.all_gather_into_tensor(gathered, payload, group=self.group)
        total = torch.zeros(self.padded, device=x.device)
        for each in gathered.view(self.world, -1):  # in rank order: every rank sums alike
            decode_into(total, each, self.density, self.bits)
        return total[: self.numel].div_(self.world)

    def state_dict(self) -> dict:
        state = {"residual": self.residual.cpu(), "sent_share": self.sent_share}
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        if "residual" in state and state["residual"].shape == self.residual.shape:
            self.residual.copy_(state["residual"])
            self.sent_share = state.get("sent_share")
        if self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])
