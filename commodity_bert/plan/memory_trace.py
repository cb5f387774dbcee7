"""What autograd keeps for backward during one forward, measured: the bytes of every tensor saved
for backward (saved-tensor hooks, each storage once, the parameters left out). This is what the
memory model's activation term (memory.py) is checked against, on real CPU tensors for `tiny` and
`mini` and on meta tensors (shapes only, no data, no compute) for `base` and `large`.

Two kernel profiles, because what is saved depends on the kernels that run:
    "cpu"   what runs here: SDPA's math path (the attention probabilities kept, w² a head) and
            dropout as a multiplication by a noise tensor of the activations' dtype
    "cuda"  what a GPU runs: SDPA's memory-efficient kernel (an attention mask rules out Flash;
            it keeps q, k, v, the output and a log-sum-exp, no w² term) and fused dropout (a
            1-byte mask). Traced on meta tensors by calling those kernels' own ops, whose meta
            implementations give their outputs' shapes.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F

PROFILES = ("cpu", "cuda")


def synthetic_batch(batch: int, width: int, vocab: int, masked: int, device="cpu", lengths=None) -> dict:
    """A batch of the trainer's layout: `batch` sequences padded to `width`, `lengths` real tokens
    each (default: all `width`), `masked` masked positions in all."""
    lengths = lengths or [width] * batch
    attention_mask = torch.zeros(batch, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        attention_mask[row, :n] = 1
    real = attention_mask.reshape(-1).nonzero().squeeze(1)
    masked_index = real[torch.linspace(0, len(real) - 1, masked).long()]
    ids = torch.randint(5, vocab, (batch, width)) * attention_mask
    out = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": attention_mask,
           "masked_index": masked_index, "masked_labels": torch.randint(5, vocab, (masked,)),
           "next_sentence_labels": torch.zeros(batch, dtype=torch.long)}
    return {k: v.to(device) for k, v in out.items()}


def _efficient_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
    """SDPA as CUDA runs it with a key mask: the memory-efficient kernel with an additive bias."""
    bias = None
    if attn_mask is not None:
        bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attn_mask, float("-inf")).expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, True, dropout_p, is_causal, scale=scale)[0]


def _fused_dropout(x, p=0.5, training=True, inplace=False):
    if not training or p == 0.0:
        return x
    return torch.native_dropout(x, p, True)[0]


@contextlib.contextmanager
def kernels(profile: str):
    if profile not in PROFILES:
        raise ValueError(f"profile {profile!r}: give one of {', '.join(PROFILES)}")
    with contextlib.ExitStack() as stack:
        if profile == "cuda":
            stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention", _efficient_attention))
            stack.enter_context(mock.patch.object(F, "dropout", _fused_dropout))
        # every position of a meta batch is real (the traced batches have no padding)
        stack.enter_context(mock.patch.object(fx_config, "meta_nonzero_assume_all_nonzero", True))
        yield


def saved_bytes(model: torch.nn.Module, batch: dict, profile: str = "cpu") -> int:
    """Bytes autograd saves for backward in one forward of `model` (a PretrainingModel) on `batch`."""
    parameters = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in parameters:
            seen.setdefault(storage._cdata, storage.nbytes())
        return t

    with kernels(profile), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(batch)
    return sum(seen.values())


def traced_and_modelled(spec: str, sequences: int, width: int, dropout: float, device: str, profile: str,
                        precision: str, lengths: list[int] | None = None, nsp: bool = False,
                        vocab: int = 30522) -> dict:
    """One check of memory.py's activation term: model `spec` built on `device` ("cpu": real
    tensors, "meta": shapes only), one forward on a synthetic batch (15% of each width masked),
    the bytes autograd saved against the formula's."""
    from commodity_bert.model.bert import PretrainingModel, build_config, build_model, set_dropout
    from commodity_bert.plan.memory import Batch, Shape, activation_bytes
    config = build_config(spec, vocab)
    with torch.device(device):
        hf_model = build_model(config, nsp=nsp)
    hf_model = hf_model.to(torch.bfloat16 if precision == "bf16" else torch.float32)
    set_dropout(hf_model, dropout)
    model = PretrainingModel(hf_model).train()
    masked = sequences * round(0.15 * width)
    torch.manual_seed(0)
    traced = saved_bytes(model, synthetic_batch(sequences, width, vocab, masked, device, lengths), profile)
    tokens = sum(lengths) if lengths else sequences * width
    shape = Shape(config.num_hidden_layers, config.hidden_size, config.intermediate_size,
                  config.num_attention_heads, vocab, 0, nsp)
    modelled = activation_bytes(shape, Batch(sequences, width, tokens, masked), precision, dropout, profile)
    return {"model": spec, "sequences": sequences, "width": width, "tokens": tokens, "dropout": dropout,
            "tensors": device, "kernels": profile, "precision": precision, "nsp": nsp, "traced_bytes": traced,
            "modelled_bytes": modelled, "error": modelled / traced - 1}
