"""The model: a Hugging Face BERT with SDPA attention and a sparse masked-LM loss.

The MLM head (a hidden×hidden transform, then a hidden×vocab projection) is applied only to the
masked positions, ~15% of the tokens, instead of to every position as HF's dense loss does;
the loss is the same (tests/test_model.py checks it against HF's own).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, BertForMaskedLM, BertForPreTraining

PRESETS = {
    "tiny": {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "intermediate_size": 512},
    "mini": {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024},
    "base": {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072},
    "large": {"num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 4096},
}


class ModelConfigError(Exception):
    pass


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
    return cls._from_config(config, attn_implementation="sdpa")


def load_pretrained(source: str | os.PathLike, nsp: bool) -> nn.Module:
    """An exported model (RUN/hf_model) to start from, e.g. phase 2 from phase 1. HF's own
    loader ties the output embeddings and initialises a head the source lacks (NSP after an
    MLM-only phase)."""
    cls = BertForPreTraining if nsp else BertForMaskedLM
    try:
        return cls.from_pretrained(str(source), attn_implementation="sdpa")
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"--init-from {source}: not a loadable BERT model ({exc})") from exc


class PretrainingModel(nn.Module):
    """Wraps the HF model so that DeepSpeed's engine(batch) returns the loss and counts."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model
        self.nsp = isinstance(hf_model, BertForPreTraining)

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        bert, heads = self.hf_model.bert, self.hf_model.cls
        out = bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   token_type_ids=batch["token_type_ids"])
        hidden = out.last_hidden_state
        masked_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch["masked_index"])
        logits = heads.predictions(masked_hidden).float()
        labels = batch["masked_labels"]
        mlm_loss = F.cross_entropy(logits, labels)
        stats = {"mlm_correct": (logits.argmax(-1) == labels).sum().detach(),
                 "mlm_count": torch.tensor(labels.numel(), device=labels.device),
                 "mlm_loss": mlm_loss.detach()}
        loss = mlm_loss
        if self.nsp:
            nsp_logits = heads.seq_relationship(out.pooler_output).float()
            nsp_loss = F.cross_entropy(nsp_logits, batch["next_sentence_labels"])
            loss = loss + nsp_loss
            stats["nsp_correct"] = (nsp_logits.argmax(-1) == batch["next_sentence_labels"]).sum().detach()
            stats["nsp_count"] = torch.tensor(nsp_logits.shape[0], device=nsp_logits.device)
        return loss, stats


def training_flops(config: BertConfig, tokens: int, seq_len: int, masked: int, sequences: int) -> float:
    """FLOPs of forward + backward (3× forward) for a batch: dense matmuls on the computed
    tokens, attention scores on seq_len² per sequence, the MLM head on masked tokens only."""
    h, layers, inter = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    per_token = layers * (2 * 4 * h * h + 2 * 2 * h * inter)
    attention = layers * 2 * 2 * seq_len * seq_len * h * sequences
    head = masked * (2 * h * h + 2 * h * config.vocab_size)
    return 3.0 * (per_token * tokens + attention + head)
