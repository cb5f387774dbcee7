"""What one GPU holds while it trains, from shapes: `bert-plan fit`'s memory model.

    peak = state + gradients + max(activations, the step's fp32 gradients) + context

state (held between steps; train.py's summary.json `tensor_mb` measures it on every rank)
    weights          the module's, 2 bytes a parameter in bf16/fp16, 4 in fp32
    master           DeepSpeed's fp32 copy: 4 bytes in bf16/fp16, and under ZeRO in fp32 too
                     (its partition); ZeRO 1/2 split it over the W ranks
    optimizer        fp32 moments: LAMB/AdamW 8 bytes (m, v); 1-bit LAMB 12 (m, v and the fresh
                     variance of its compression stage); 0/1 Adam 16 (m, v, Σ lr·m and the synced
                     parameters of its local steps); split over W under ZeRO
    exchange         the 1-bit modes' error feedback, 4 bytes a parameter for the worker's and 4/W
                     for the server's chunk (two levels: of the rank's slice); DiLoCo's outer state,
                     θ and the outer momentum, 8 bytes (0 on the GPU with outer_state_device
                     "cpu"), and with int8/int4/int2 error feedback 4 + 4/W more; sparse: its
                     residual, 4 (where it sends dense int-b instead, as that exchange)
gradients          the module's, the weights' dtype, held from the first backward to the step
                   (ZeRO 2: its partition and a reduce bucket)
step transient     bf16/fp16: the fp32 gradients the step makes from them, 4 bytes a parameter
activations        what autograd saves in one micro-batch's forward (memory_trace.py measures it),
                   per encoder layer for T real tokens of hidden size h, FFN size I, a heads and
                   b sequences padded to w, p bytes an activation (2 in bf16/fp16, 4 in fp32):
                       T·h·(8p + 2d) + 2·T·I·p + 4·T·s            linear inputs and outputs, the
                                                                  two residual sums, 2 dropout
                                                                  masks of d bytes, LayerNorm stats
                     + attention: on CUDA the memory-efficient kernel keeps the padded q, k, v and
                       output, 4·b·w·h·p, its log-sum-exp b·a·⌈w/32⌉·32·4, the key mask b·w·p;
                       on a CPU with dropout the math path keeps q, kᵀ, v in fp32, 3·b·w·h·4, and
                       the probabilities before and after dropout with their mask, 3·b·a·w²·4
                   plus the embeddings (T·h·(p + d) + 2·T·s + 32·T for the token ids) and the
                   MLM head on M masked tokens (4·M·h·p + 2·M·s + 4·M·V + 16·M; V the
                   vocabulary, its logits in fp32); d is 1 (CUDA's fused dropout mask) or p
                   (the CPU's), 0 without dropout; s, the stats' bytes, 4 (p on a CPU).
                   With activation checkpointing each layer keeps only its input (T·h·p) and
                   one layer is recomputed at a time: L·T·h·p + one layer's activations.
context            CONTEXT_BYTES: the CUDA context, cuBLAS workspaces and NCCL's buffers, which
                   torch.cuda.max_memory_allocated does not count; and FRAGMENTATION of the
                   allocations kept free for the caching allocator's fragmentation (stated, not
                   measured here)

The state is checked against every rank's live tensors in the mode tests (2 gloo ranks, every
mode); the activations against memory_trace.py's saved bytes on shapes none of the coefficients
were read from (tests/test_memory_model.py, benchmarks/memory_model.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from commodity_bert.collectives.lowbit import dense_bytes
from commodity_bert.collectives.sparse import sparse_bytes
from commodity_bert.comm.topology import hierarchy_setting
from commodity_bert.data.masking import MASK_PROB
from commodity_bert.run_config import RunConfig

GIB = 2**30
CONTEXT_BYTES = 1.0 * GIB
FRAGMENTATION = 0.10
HF_DROPOUT = 0.1  # BertConfig's hidden and attention dropout, unless the config's pretraining block sets one


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float  # what torch.cuda.get_device_properties reports as total memory
    capability: tuple[int, int]
    # dense fp16/bf16 tensor-core peak with fp32 accumulation, TFLOP/s (NVIDIA's architecture
    # whitepapers; GeForce cards accumulate fp32 at half their fp16 rate): what bert-plan
    # estimate --gpu prices a card at, times the MFU
    tflops: float = 0.0

    @property
    def bf16(self) -> bool:
        return self.capability >= (8, 0)


GPUS = {g.name: g for g in (
    Gpu("2080ti", 10.75, (7, 5), 53.8),   # 11 GB GDDR6
    Gpu("t4", 14.58, (7, 5), 65.0),       # 16 GB, 15 GiB visible
    Gpu("v100-16", 15.77, (7, 0), 125.0),  # SXM2 (PCIe: 112)
    Gpu("v100-32", 31.74, (7, 0), 125.0),
    Gpu("3090", 23.69, (8, 6), 71.0),
    Gpu("4090", 23.65, (8, 9), 165.2),
    Gpu("a100-40", 39.39, (8, 0), 312.0),
    Gpu("a100-80", 79.15, (8, 0), 312.0),
    Gpu("h100", 79.10, (9, 0), 989.4),     # SXM
)}


def gpu_named(name: str) -> Gpu | None:
    """A card by any common spelling: "RTX 3090", "rtx3090", "A100-80GB", "v100_32"."""
    key = name.lower().replace("rtx", "").replace("tesla", "").replace("nvidia", "").replace("gb", "")
    key = key.replace("_", "-").replace(" ", "").strip("-")
    return GPUS.get(key) or GPUS.get(key.replace("-", ""))


@dataclass(frozen=True)
class Shape:
    """The model's sizes."""
    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    params: int
    nsp: bool = True

    @classmethod
    def of(cls, config, nsp: bool = True) -> Shape:
        """From a BertConfig, its parameters counted on a meta model (no memory)."""
        import torch

        from commodity_bert.model.bert import build_model
        with torch.device("meta"):
            module = build_model(config, nsp=nsp)
        return cls(config.num_hidden_layers, config.hidden_size, config.intermediate_size,
                   config.num_attention_heads, config.vocab_size,
                   sum(p.numel() for p in module.parameters() if p.requires_grad), nsp)


@dataclass(frozen=True)
class Batch:
    """One micro-batch as the trainer sees it: b sequences padded to w, T real tokens, M masked."""
    sequences: int
    width: int
    tokens: int
    masked: int

    @classmethod
    def full(cls, sequences: int, seq_len: int, mask_prob: float = MASK_PROB) -> Batch:
        """Full-length sequences (presorted shards pad little: 2.8% on the quickstart corpus)."""
        return cls(sequences, seq_len, sequences * seq_len, sequences * round(mask_prob * seq_len))


def activation_bytes(shape: Shape, batch: Batch, precision: str, dropout: float, profile: str = "cuda",
                     checkpointing: bool = False) -> int:
    """What autograd keeps for backward in one micro-batch (the module docstring's formula)."""
    p = 4 if precision == "fp32" else 2
    d = 0 if dropout == 0 else (1 if profile == "cuda" else p)
    s = 4 if profile == "cuda" else p
    h, inner, heads, vocab = shape.hidden, shape.intermediate, shape.heads, shape.vocab
    b, w, tokens, masked = batch.sequences, batch.width, batch.tokens, batch.masked
    layer = tokens * h * (8 * p + 2 * d) + 2 * tokens * inner * p + 4 * tokens * s
    if profile == "cuda":
        layer += 4 * b * w * h * p + b * heads * math.ceil(w / 32) * 32 * 4 + b * w * p + 16
    elif dropout:
        layer += 3 * b * w * h * 4 + 3 * b * heads * w * w * 4
    else:  # SDPA's flash kernel for CPUs
        layer += 4 * b * w * h * p + b * heads * w * 4 + b * w * p
    embeddings = tokens * h * (p + d) + 2 * tokens * s + 32 * tokens
    head = 4 * masked * h * p + 2 * masked * s + 4 * masked * vocab + 16 * masked + 4
    if shape.nsp:  # the pooler on each sequence's first token and a 2-way classifier
        head += 2 * b * h * p + 8 * b + 24 * b + 4
    layers = shape.layers * layer if not checkpointing else shape.layers * tokens * h * p + layer
    return layers + embeddings + head


@dataclass
class Setup:
    """What the memory of a rank depends on in the DeepSpeed config."""
    precision: str                  # bf16 | fp16 | fp32
    zero_stage: int
    optimizer: str                  # the optimizer's one spelling: lamb, adamw, onebitlamb, zerooneadam
    diloco: dict | None = None      # the diloco section, where the mode is DiLoCo
    dropout: float = HF_DROPOUT
    checkpointing: bool = False

    @classmethod
    def of(cls, config: RunConfig | dict) -> Setup:
        from commodity_bert.comm.diloco import diloco_settings
        from commodity_bert.model.sections import activation_checkpointing, pretraining_recipe
        config = RunConfig.of(config)
        dropout = pretraining_recipe(config).get("dropout")
        return cls(config.precision, config.zero_stage, config.optimizer_name, diloco_settings(config),
                   HF_DROPOUT if dropout is None else dropout, activation_checkpointing(config))


OPTIMIZER_STATE = {"lamb": 8, "adamw": 8, "adam": 8, "onebitlamb": 12, "zerooneadam": 16}
ONE_BIT = ("onebitlamb", "zerooneadam")


@dataclass
class Memory:
    state: dict[str, float]
    gradients: float
    step_transient: float
    activations: float
    context: float = CONTEXT_BYTES
    notes: list[str] = field(default_factory=list)

    @property
    def state_total(self) -> float:
        return sum(self.state.values())

    @property
    def allocated(self) -> float:
        """What torch.cuda.max_memory_allocated would show at the peak."""
        return self.state_total + self.gradients + max(self.activations, self.step_transient)

    @property
    def total(self) -> float:
        return self.allocated * (1 + FRAGMENTATION) + self.context


def state_bytes(params: int, setup: Setup, world: int, slices: int = 1, among: int | None = None) -> dict[str, float]:
    """The tensors a rank holds between steps, by kind (the module docstring). In two levels the
    1-bit error feedback covers one of `slices` slices (the smallest node's ranks) and its server
    chunk is one of `among` (the nodes); flat, the whole buffer among all `world` ranks."""
    half = setup.precision in ("bf16", "fp16")
    partition = world if setup.zero_stage >= 1 else 1
    state = {"weights": params * (2 if half else 4),
             "master": params * 4 / partition if half or setup.zero_stage >= 1 else 0.0,
             "optimizer": params * OPTIMIZER_STATE.get(setup.optimizer, 8) / partition,
             "exchange": 0.0}
    between = among or world  # the ranks one compressed exchange runs among
    if setup.optimizer in ONE_BIT:
        state["exchange"] = params / slices * (4 + 4 / between)
    if setup.diloco:
        on_gpu = setup.diloco.get("outer_state_device", "auto") != "cpu"
        state["exchange"] = params * 8 * on_gpu
        compression = setup.diloco.get("compression")
        dense = compression in ("int8", "int4", "int2") and setup.diloco.get("error_feedback")
        if compression == "sparse":  # its residual, 4; or the dense exchange's errors where that is chosen
            density, bits = setup.diloco.get("density", 0.01), setup.diloco.get("value_bits", 2)
            dense = sparse_bytes(params / slices, density, bits, between) > dense_bytes(params / slices, bits, between)
            state["exchange"] += 0 if dense else params / slices * 4
        if dense:
            state["exchange"] += params / slices * (4 + 4 / between)
    return state


def exchange_split(topology, config) -> tuple[int, int]:
    """(slices, among) for state_bytes: in two levels, where train.py's topology chooses them for
    this config, slices of the smallest node's ranks among the nodes; flat, one among all ranks."""
    levels, _ = topology.choose(hierarchy_setting(config))
    return (min(topology.ranks_per_node), len(topology.nodes)) if levels else (1, len(topology.node_of))


def memory(shape: Shape, batch: Batch, setup: Setup, world: int = 1, slices: int = 1, among: int | None = None,
           checkpointing: bool | None = None) -> Memory:
    """A rank's memory at its peak for micro-batches like `batch`."""
    checkpointing = setup.checkpointing if checkpointing is None else checkpointing
    half = setup.precision in ("bf16", "fp16")
    gradients = shape.params * (2 if half else 4) / (world if setup.zero_stage >= 2 else 1)
    return Memory(state_bytes(shape.params, setup, world, slices, among), gradients,
                  shape.params * 4.0 if half else 0.0,
                  activation_bytes(shape, batch, setup.precision, setup.dropout, "cuda", checkpointing))


@dataclass
class Fit:
    gpu: Gpu
    precision: str
    micro: int | None               # the largest that fits without checkpointing (None: none does)
    micro_checkpointed: int | None  # with activation checkpointing
    asked_micro: int
    chosen: Memory | None

    @property
    def checkpointing(self) -> str:
        """"needed" (nothing fits without it), "recommended" (without it the micro-batch falls below
        half the config's, and with it is at least twice as large: far fewer, larger passes for
        about one more forward pass of compute), "optional" (it would allow a larger one) or "no"."""
        if self.micro_checkpointed is None:
            return "no"
        if self.micro is None:
            return "needed"
        if self.micro < self.asked_micro / 2 and self.micro_checkpointed >= 2 * self.micro:
            return "recommended"
        return "optional" if self.micro_checkpointed > self.micro else "no"


def largest_micro(shape: Shape, seq_len: int, setup: Setup, gpu: Gpu, up_to: int, world: int, slices: int,
                  among: int | None, checkpointing: bool) -> tuple[int | None, Memory | None]:
    """The largest micro-batch ≤ `up_to` whose peak fits the card."""
    for micro in range(up_to, 0, -1):
        need = memory(shape, Batch.full(micro, seq_len), setup, world, slices, among, checkpointing)
        if need.total <= gpu.memory_gib * GIB:
            return micro, need
    return None, None


def fit(shape: Shape, seq_len: int, setup: Setup, gpu: Gpu, asked_micro: int, world: int = 1,
        slices: int = 1, among: int | None = None) -> Fit:
    """The answer for `gpu` (memory.py's docstring; `slices` and `among` as state_bytes takes them)."""
    precision = setup.precision if setup.precision == "fp32" else ("bf16" if gpu.bf16 else "fp16")
    setup = replace(setup, precision=precision)
    micro, plain = largest_micro(shape, seq_len, setup, gpu, asked_micro, world, slices, among, False)
    checked, with_checkpoints = largest_micro(shape, seq_len, setup, gpu, asked_micro, world, slices, among, True)
    result = Fit(gpu, precision, micro, checked, asked_micro, plain)
    if result.checkpointing in ("needed", "recommended"):
        result.chosen = with_checkpoints
    return result
