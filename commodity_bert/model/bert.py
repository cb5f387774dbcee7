"""The model: a Hugging Face BERT run without padding, with a sparse masked-LM loss.

No work on padding: the batch's real tokens are concatenated into one row, so embeddings,
projections, feed-forward layers and LayerNorms see only real tokens (MLPerf BERT's "unpadding").
Attention alone is computed in the padded [batch, width] layout, with SDPA and a key mask,
or (`"commodity_bert": {"attention": {"layout": "jagged"}}`) on nested jagged tensors of the
real tokens, which SDPA runs without padding (FlashAttention's variable-length kernel on a GPU;
on a CPU its math path, slower than the padded one); it is the same HF module, chosen through
HF's own attention registry, so the weights, `save_pretrained` and `from_pretrained` are plain HF BERT.
The MLM head (a hidden×hidden transform, then a hidden×vocab projection) is applied only to the
masked positions, ~15% of the tokens, instead of to every position as HF's dense loss does;
the loss is the same as HF's padded, dense one (tests/test_model_data_optim.py checks it).
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    BertConfig,
    BertForMaskedLM,
    BertForPreTraining,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from commodity_bert.model import HEAD_PREFIX
from commodity_bert.model.sections import ATTENTION_LAYOUTS

# tiny, mini, small and medium are the compact BERTs of Turc et al. (arXiv 1908.08962) by their names
PRESETS = {
    "tiny": {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "intermediate_size": 512},
    "mini": {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024},
    "small": {"num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "intermediate_size": 2048},
    "medium": {"num_hidden_layers": 8, "hidden_size": 512, "num_attention_heads": 8, "intermediate_size": 2048},
    "base": {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072},
    "large": {"num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 4096},
}


class ModelConfigError(Exception):
    pass




@dataclass
class PaddedLayout:
    """Where the concatenated real tokens sit in the padded [batch, width] layout, and how
    attention sees them: "padded" scatters them into [batch, width] for SDPA with a key mask and
    gathers them back; "jagged" hands SDPA nested jagged tensors of the real tokens alone (each
    sequence's tokens between two offsets), which on a GPU reach FlashAttention's variable-length
    kernel without the scatter, the gather or the padded positions' work."""
    index: torch.Tensor      # [real tokens]: flat position in batch × width
    key_mask: torch.Tensor   # [batch, 1, 1, width], True on real tokens
    batch: int
    width: int
    offsets: torch.Tensor | None = None  # [batch + 1]: where each sequence starts among the real tokens (jagged)

    @classmethod
    def of(cls, attention_mask: torch.Tensor, attention: str = "padded") -> PaddedLayout:
        batch, width = attention_mask.shape
        index = attention_mask.reshape(-1).nonzero().squeeze(1)
        offsets = None
        if attention == "jagged":
            offsets = F.pad(attention_mask.sum(1).cumsum(0), (1, 0))
        return cls(index, attention_mask.bool()[:, None, None, :], batch, width, offsets)


def unpadded_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            padded_layout: PaddedLayout | None = None, **kwargs):
    """HF attention function: q/k/v arrive as [1, heads, real tokens, head_dim]; scattered into
    the padded layout for SDPA and gathered back, or given to SDPA as nested jagged tensors (the
    layout says which). Without a layout (a padded HF call) it is HF's SDPA."""
    if padded_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    layout = padded_layout
    heads, head_dim = query.shape[1], query.shape[3]
    if layout.offsets is not None:
        def jagged(x: torch.Tensor) -> torch.Tensor:  # [batch, heads, ragged length, head_dim]
            rows = x[0].transpose(0, 1)  # [tokens, heads, head_dim]
            return torch.nested.nested_tensor_from_jagged(rows, layout.offsets).transpose(1, 2)

        out = F.scaled_dot_product_attention(jagged(query), jagged(key), jagged(value), dropout_p=dropout,
                                             scale=scaling)
        return out.transpose(1, 2).values().unsqueeze(0), None

    def to_padded(x: torch.Tensor) -> torch.Tensor:
        rows = x[0].transpose(0, 1)  # [tokens, heads, head_dim]
        padded = rows.new_zeros(layout.batch * layout.width, heads, head_dim).index_copy(0, layout.index, rows)
        return padded.view(layout.batch, layout.width, heads, head_dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(to_padded(query), to_padded(key), to_padded(value),
                                         attn_mask=layout.key_mask, dropout_p=dropout, scale=scaling)
    out = out.transpose(1, 2).reshape(layout.batch * layout.width, heads, head_dim).index_select(0, layout.index)
    return out.unsqueeze(0), None


UNPADDED_ATTENTION = "commodity_bert_unpadded_sdpa"
AttentionInterface.register(UNPADDED_ATTENTION, unpadded_sdpa_attention)
AttentionMaskInterface.register(UNPADDED_ATTENTION, sdpa_mask)  # padded HF calls get SDPA's masks


def set_dropout(model: nn.Module, rate: float) -> None:
    """Every dropout of the model (embeddings, attention probabilities, hidden states) at `rate`.
    The modules' own rates change, not the config: an export still carries the config's rate,
    which is what fine-tuning a BERT expects (Cramming pretrains without dropout and
    fine-tunes with it)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = rate


def build_config(spec: str, vocab_size: int) -> BertConfig:
    """A preset name or a BertConfig JSON file; the vocabulary size comes from the data."""
    if spec in PRESETS:
        return BertConfig(vocab_size=vocab_size, max_position_embeddings=512, **PRESETS[spec])
    path = Path(spec)
    if not path.is_file():
        raise ModelConfigError(f"--model {spec}: not a preset ({', '.join(PRESETS)}) nor a config JSON file")
    try:
        config = BertConfig.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, ValueError) as exc:
        raise ModelConfigError(f"--model {spec}: not a BERT config JSON ({exc})") from exc
    if config.vocab_size != vocab_size:
        raise ModelConfigError(f"--model {spec} has vocab_size {config.vocab_size} but the data's vocabulary has "
                               f"{vocab_size} tokens; set vocab_size to {vocab_size} or use the matching data")
    return config


def build_model(config: BertConfig, nsp: bool) -> nn.Module:
    cls = BertForPreTraining if nsp else BertForMaskedLM
    return cls._from_config(config, attn_implementation=UNPADDED_ATTENTION)


def use_activation_checkpointing(hf_model: nn.Module) -> None:
    """Keep only each encoder layer's input in forward and recompute the layer in backward: the
    activations' memory falls to about one layer's, for about one more forward pass of time
    (what lets BERT-large train on 16-24 GB cards). HF's own switch: each BertLayer is a
    GradientCheckpointingLayer. Non-reentrant checkpointing passes the unpadded layout through as a
    keyword and restores the RNG state before recomputing, so dropout draws the same masks and
    the losses are those of a run without it."""
    kwargs = {"use_reentrant": False}
    if hasattr(hf_model, "activation_checkpointing_enable"):  # newer transformers: the old name is deprecated
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@contextmanager
def quiet_transformers():
    """from_pretrained prints a multi-line load report and a progress bar; the caller says what
    matters (a fresh head) in one line instead."""
    from transformers.utils import logging as hf_logging
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_pretrained(source: str | os.PathLike, nsp: bool) -> tuple[nn.Module, list[str]]:
    """An exported model (RUN/hf_model) or a Hugging Face BERT directory to start from, and the
    names of the head parameters its weights lacked. HF's own loader ties the output embeddings and
    initialises what the source lacks: NSP after an MLM-only phase, the whole masked-LM head under
    a `BertModel` (a sentence-transformers export). Missing encoder weights are refused: such a
    directory holds another model's weights."""
    from safetensors import SafetensorError
    cls = BertForPreTraining if nsp else BertForMaskedLM
    try:
        with quiet_transformers():
            model, info = cls.from_pretrained(str(source), attn_implementation=UNPADDED_ATTENTION,
                                              output_loading_info=True)
    except (OSError, ValueError, SafetensorError) as exc:  # a weights file cut short: SafetensorError
        raise ModelConfigError(f"--init-from {source}: not a loadable BERT model ({str(exc).splitlines()[0]})") from exc
    missing = sorted(info.get("missing_keys", ()))
    encoder = [name for name in missing if not name.startswith(HEAD_PREFIX)]
    if encoder:
        raise ModelConfigError(f"--init-from {source}: its weights are not a BERT encoder's ({len(encoder)} of "
                               f"{len(model.state_dict())} encoder tensors missing, e.g. {encoder[0]})")
    return model, missing


def not_a_bert(config: dict) -> str | None:
    """Why a model directory's config.json is not a BERT's (None: it is), for the loaders' one line."""
    if config.get("model_type") != "bert":
        return (f"a {config.get('model_type') or 'model without model_type'} model, not a BERT (config.json's "
                f"model_type must be \"bert\")")
    return None


def pretrained_config(source: str | os.PathLike) -> BertConfig:
    """The architecture of a model directory, without its weights."""
    try:
        return BertConfig.from_pretrained(str(source))
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"--init-from {source}: no readable BERT config.json ({str(exc).splitlines()[0]})") from exc


SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def shape_of(config: BertConfig) -> str:
    return (f"hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_attention_heads} heads, "
            f"feed-forward {config.intermediate_size}")


def init_shape_line(asked: str | None, asked_config: BertConfig, source, source_config: BertConfig) -> str | None:
    """--init-from and --model agree, or the launch refuses: the model asked for is the model
    trained. With no --model the source's shape is trained, and the line says so; None where
    --model names the source's own shape."""
    if asked is None:
        return f"--init-from {source}: training its shape ({shape_of(source_config)}), as no --model was given"
    if all(getattr(asked_config, f) == getattr(source_config, f) for f in SHAPE_FIELDS):
        return None
    raise ModelConfigError(f"--model {asked} is {shape_of(asked_config)} but --init-from {source} is "
                           f"{shape_of(source_config)}: leave out --model to go on in {source}'s shape, or start "
                           f"from a model of {asked}'s shape")


def fresh_head_line(source, missing: list[str]) -> str | None:
    """One line saying which pretraining head starts from random weights, or None."""
    heads = sorted({name.split(".")[1] for name in missing if name.startswith(HEAD_PREFIX)})
    if not heads:
        return None
    what = {"predictions": "the masked-LM head (its output layer is the word embeddings)",
            "seq_relationship": "the next-sentence head"}
    return (f"--init-from {source}: no weights for {' and '.join(what.get(h, h) for h in heads)}; "
            f"it starts fresh (a head warm-up, \"commodity_bert.head_warmup\", keeps the encoder still while it learns)")


class PretrainingModel(nn.Module):
    """Wraps the HF model so that DeepSpeed's engine(batch) returns the loss and counts."""

    def __init__(self, hf_model: nn.Module, attention: str = "padded"):
        super().__init__()
        if attention not in ATTENTION_LAYOUTS:
            raise ModelConfigError(f"attention {attention!r}: give one of {', '.join(ATTENTION_LAYOUTS)}")
        self.attention = attention
        # forward hands attention the unpadded layout; any other attention function would
        # attend across the concatenated sequences
        if hf_model.config._attn_implementation != UNPADDED_ATTENTION:
            hf_model.set_attn_implementation(UNPADDED_ATTENTION)
        self.hf_model = hf_model
        self.nsp = isinstance(hf_model, BertForPreTraining)

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        bert, heads = self.hf_model.bert, self.hf_model.cls
        attention_mask = batch["attention_mask"]
        layout = PaddedLayout.of(attention_mask, self.attention)
        width = layout.width
        positions = torch.arange(width, device=attention_mask.device).repeat(layout.batch)

        def unpad(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(-1).index_select(0, layout.index).unsqueeze(0)

        embedded = bert.embeddings(input_ids=unpad(batch["input_ids"]), token_type_ids=unpad(batch["token_type_ids"]),
                                   position_ids=unpad(positions))
        hidden = bert.encoder(embedded, attention_mask=None, padded_layout=layout).last_hidden_state[0]
        # padded flat position -> row among the real tokens
        real_row = attention_mask.reshape(-1).cumsum(0) - 1
        masked_hidden = hidden.index_select(0, real_row.index_select(0, batch["masked_index"]))
        logits = heads.predictions(masked_hidden).float()
        labels = batch["masked_labels"]
        mlm_loss = F.cross_entropy(logits, labels)
        stats = {"mlm_correct": (logits.argmax(-1) == labels).sum().detach(),
                 "mlm_count": torch.tensor(labels.numel(), device=labels.device),
                 "mlm_loss": mlm_loss.detach()}
        loss = mlm_loss
        if self.nsp:
            first_tokens = real_row.view(layout.batch, width)[:, 0]  # [CLS] of each sequence
            pooled = bert.pooler.activation(bert.pooler.dense(hidden.index_select(0, first_tokens)))
            nsp_logits = heads.seq_relationship(pooled).float()
            nsp_loss = F.cross_entropy(nsp_logits, batch["next_sentence_labels"])
            loss = loss + nsp_loss
            stats["nsp_correct"] = (nsp_logits.argmax(-1) == batch["next_sentence_labels"]).sum().detach()
            stats["nsp_count"] = torch.tensor(nsp_logits.shape[0], device=nsp_logits.device)
        return loss, stats


def training_flops(config: BertConfig, tokens: int, attention_pairs: int, head_tokens: int) -> float:
    """FLOPs of forward + backward (3× forward): the encoder's matmuls on `tokens`, attention
    scores and their weighted sum on `attention_pairs` query-key pairs, the MLM head on
    `head_tokens`. Embedding lookups, LayerNorms and softmax are left out, as is usual."""
    h, layers, inter = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    per_token = layers * (2 * 4 * h * h + 2 * 2 * h * inter)
    attention = layers * 2 * 2 * h * attention_pairs
    head = head_tokens * (2 * h * h + 2 * h * config.vocab_size)
    return 3.0 * (per_token * tokens + attention + head)


def executed_training_flops(config: BertConfig, batch: dict) -> float:
    """What PretrainingModel computes for a batch: real tokens only, attention on the padded
    width, the head on masked tokens."""
    sequences, width = batch["attention_mask"].shape
    return training_flops(config, int(batch["real_tokens"]), sequences * width * width,
                          int(batch["masked_index"].numel()))
