"""DiLoCo (Douillard et al., arXiv 2311.08105; docs/ALGORITHMS.md, "DiLoCo"): ranks train alone
for H inner steps, then average how far they moved and take one outer step.

Each round starts from parameters θ that every rank holds alike. A rank takes `inner_steps`
steps with the inner optimizer (the config's own: LAMB, AdamW; its state stays local) on its own
gradients: the engine's gradient allreduce is off (`engine.no_sync()` around forward and
backward, which also keeps DeepSpeed's fp16/bf16 wrapper from allreducing its overflow flag every
step). At the round's end the ranks average the pseudo-gradient Δ = θ − θ_local with one
collective, and an outer SGD step with Nesterov momentum moves θ:

    b ← μ·b + Δ;   d = Δ + μ·b (Nesterov) or b;   θ ← θ − outer_lr·d

Every rank computes the same θ from the same averaged Δ, writes it into the fp32 parameters the
inner optimizer updates (DeepSpeed's master copies under fp16/bf16) and into the model, and
starts the next round. One parameter-sized exchange per H steps instead of one per step.

Written here because neither DeepSpeed nor torch has it. Selected by the project block of the
DeepSpeed config:
    "commodity_bert": {"diloco": {"inner_steps": 50, "outer_lr": 0.7, "outer_momentum": 0.9,
                                  "nesterov": true, "compression": "none"}}
`compression` is how Δ travels: "none" (fp32 allreduce, 4 bytes a parameter), "bf16" (bf16
allreduce, 2), "int8" (8-bit values with one fp32 scale per 256, reduced through an all-to-all and
an all-gather as the 1-bit allreduce is: about 1 byte a parameter each way).
`outer_state_device`: where θ and b live (2 × 4 bytes a parameter): "auto" (the accelerator if
it has room for them with a quarter to spare, else host memory), "cpu" or "accelerator".
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from commodity_bert.optim.precision import MasterParams

DEFAULTS = {"enabled": True, "inner_steps": 50, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True,
            "compression": "none", "outer_state_device": "auto"}
COMPRESSIONS = ("none", "bf16", "int8")
STATE_DEVICES = ("auto", "cpu", "accelerator")
INT8_BLOCK = 256  # elements per fp32 scale: 1/64 byte a parameter of overhead


def diloco_settings(ds_config: dict) -> dict | None:
    """The DiLoCo settings with defaults filled in, or None when the config does not enable it."""
    block = ds_config.get("commodity_bert", {}).get("diloco")
    if block is None:
        return None
    settings = {**DEFAULTS, **block}
    return settings if settings["enabled"] else None


def check_settings(settings: dict) -> str | None:
    """The problem with a diloco block, as one line, or None."""
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    steps = settings["inner_steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        return f"diloco inner_steps {steps!r}: give a positive number of steps, e.g. 50"
    if not number(settings["outer_lr"]) or settings["outer_lr"] <= 0:
        return f"diloco outer_lr {settings['outer_lr']!r}: give a positive number (the paper's: 0.7)"
    if not number(settings["outer_momentum"]) or not 0 <= settings["outer_momentum"] < 1:
        return f"diloco outer_momentum {settings['outer_momentum']!r}: give a number in [0, 1) (the paper's: 0.9)"
    if not isinstance(settings["nesterov"], bool):
        return f"diloco nesterov {settings['nesterov']!r}: give true or false"
    if settings["compression"] not in COMPRESSIONS:
        return f"diloco compression {settings['compression']!r}: give one of {', '.join(COMPRESSIONS)}"
    if settings["outer_state_device"] not in STATE_DEVICES:
        return f"diloco outer_state_device {settings['outer_state_device']!r}: give one of {', '.join(STATE_DEVICES)}"
    return None


def _state_device(choice: str, master_device: torch.device, numel: int) -> torch.device:
    if choice == "cpu" or master_device.type == "cpu":
        return torch.device("cpu")
    if choice == "accelerator":
        return master_device
    free, _ = torch.cuda.mem_get_info(master_device)
    return master_device if free > 1.25 * 2 * 4 * numel else torch.device("cpu")


class DiLoCo:
    def __init__(self, masters: MasterParams, settings: dict, hierarchy=None):
        self.masters = masters
        self.hierarchy = hierarchy  # two levels: comm/topology.py
        self.inner_steps = settings["inner_steps"]
        self.outer_lr = settings["outer_lr"]
        self.momentum = settings["outer_momentum"]
        self.nesterov = settings["nesterov"]
        self.compression = settings["compression"]
        tensors = masters.tensors
        self.numel = sum(t.numel() for t in tensors)
        self.device = tensors[0].device
        self.state_device = _state_device(settings["outer_state_device"], self.device, self.numel)
        # θ (the round's start) and b, flat fp32
        self.start = torch.cat([t.detach().reshape(-1).float() for t in tensors]).to(self.state_device)
        self.velocity = torch.zeros_like(self.start)
        self.rounds = 0

    def describe(self) -> str:
        masters = {"plain": "the model's own parameters", "unfused": "DeepSpeed's fp32 copies (per tensor)",
                   "flat": "DeepSpeed's fp32 copies (flat)"}[self.masters.kind]
        return (f"an outer step every {self.inner_steps} steps (lr {self.outer_lr}, momentum {self.momentum}"
                f"{', Nesterov' if self.nesterov else ''}), pseudo-gradient sent as "
                f"{'fp32' if self.compression == 'none' else self.compression}; {self.numel:,} parameters, "
                f"updated through {masters}; outer state on {self.state_device.type}, round {self.rounds}")

    def is_round_end(self, step: int) -> bool:
        return step % self.inner_steps == 0

    def _flat_masters(self) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).float() for t in self.masters.tensors])

    @torch.no_grad()
    def outer_step(self) -> None:
        """Average Δ over the ranks, step θ, and start every rank's next round from it."""
        delta = self.start.to(self.device) - self._flat_masters()
        if self.hierarchy is None:
            delta = average(delta, self.compression)
        else:
            delta = self.hierarchy.average(delta, lambda part: average(part, self.compression, self.hierarchy.cross))
        delta = delta.to(self.state_device)
        self.velocity.mul_(self.momentum).add_(delta)
        direction = delta.add_(self.velocity, alpha=self.momentum) if self.nesterov else self.velocity
        self.start.add_(direction, alpha=-self.outer_lr)
        self._write_masters(self.start.to(self.device))
        self.rounds += 1

    def _write_masters(self, flat: torch.Tensor) -> None:
        offset = 0
        for t in self.masters.tensors:
            t.data.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()
        self.masters.push_to_model()

    @contextlib.contextmanager
    def global_model(self):
        """The model as all ranks share it (θ, the last round's result) inside; the rank's own
        parameters back afterwards. For evaluation and export in the middle of a round."""
        kept = [t.detach().clone() for t in self.masters.tensors]
        self._write_masters(self.start.to(self.device))
        try:
            yield
        finally:
            for t, k in zip(self.masters.tensors, kept):
                t.data.copy_(k)
            self.masters.push_to_model()  # the model's parameters are the masters, cast

    # θ and b are the same on every rank: they travel in DeepSpeed's checkpoint (client state)
    def state_dict(self) -> dict:
        return {"start": self.start.cpu(), "velocity": self.velocity.cpu(), "rounds": self.rounds,
                "inner_steps": self.inner_steps}

    def load_state_dict(self, state: dict) -> None:
        if state["start"].numel() != self.numel:
            raise ValueError(f"the checkpoint's DiLoCo state has {state['start'].numel()} parameters, "
                             f"the model {self.numel}")
        self.start.copy_(state["start"])
        self.velocity.copy_(state["velocity"])
        self.rounds = state["rounds"]


def average(delta: torch.Tensor, compression: str, group=None) -> torch.Tensor:
    """The mean of `delta` (flat fp32) over the group's ranks, sent as `compression` says."""
    world = dist.get_world_size(group)
    if compression == "none":
        dist.all_reduce(delta, group=group)
        return delta.div_(world)
    if compression == "bf16":
        low = delta.to(torch.bfloat16).div_(world)
        dist.all_reduce(low, group=group)
        return low.float()
    return _int8_average(delta, world, group)


def _quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """Blocks of INT8_BLOCK values as bytes: the int8 values, then one fp32 scale per block."""
    blocks = x.view(-1, INT8_BLOCK)
    scales = blocks.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    values = torch.round(blocks / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return torch.cat([values.view(torch.uint8).reshape(-1), scales.view(torch.uint8)])


def _dequantize_int8(packed: torch.Tensor, blocks: int) -> torch.Tensor:
    values = packed[: blocks * INT8_BLOCK].view(torch.int8).float().view(blocks, INT8_BLOCK)
    scales = packed[blocks * INT8_BLOCK:].view(torch.float32)
    return (values * scales[:, None]).reshape(-1)


def _int8_average(delta: torch.Tensor, world: int, group=None) -> torch.Tensor:
    """Reduce-scatter by all-to-all (rank j averages chunk j of every rank), then all-gather the
    averaged chunks, each way as int8 with per-block scales: gloo and NCCL both have these."""
    numel = delta.numel()
    chunk_blocks = -(-numel // (INT8_BLOCK * world))
    chunk = chunk_blocks * INT8_BLOCK
    padded = torch.zeros(chunk * world, device=delta.device)
    padded[:numel] = delta
    sent = torch.cat([_quantize_int8(c) for c in padded.view(world, chunk)])
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    per_rank = received.view(world, -1)
    mine = torch.stack([_dequantize_int8(per_rank[r], chunk_blocks) for r in range(world)]).mean(dim=0)
    packed = _quantize_int8(mine)
    gathered = torch.empty(world * packed.numel(), dtype=torch.uint8, device=delta.device)
    dist.all_gather_into_tensor(gathered, packed, group=group)
    out = torch.cat([_dequantize_int8(g, chunk_blocks) for g in gathered.view(world, -1)])
    return out[:numel]
