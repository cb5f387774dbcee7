"""What `--model` names, read once: the encoder's configuration and weights and the tokenizer.

Accepted: a RUN directory (its hf_model, or while the run has exported nothing yet, its newest
checkpoint), an exported hf_model, any Hugging Face BERT directory with its tokenizer, or a
checkpoint directory RUN/checkpoints/step_N. Each fine-tuning seed then builds a fresh
classifier from these weights (`classifier`), so the weights are read from disk once."""
from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from commodity_bert.data import shard_format
from commodity_bert.run_dir import CHECKPOINTS, HF_MODEL, RUN_CONFIG, SUMMARY, read_run_config
from commodity_bert.train import checkpoint as ckpt

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")


class ModelError(Exception):
    """--model names nothing usable; the message is one line for the user."""


@dataclass
class Pretrained:
    path: Path  # what the weights were read from
    config: object  # transformers.BertConfig
    encoder_state: dict  # "bert.*" tensors; no pooler unless the source trained one
    tokenizer: object
    provenance: dict = field(default_factory=dict)  # step, samples, elapsed_s where known


def _quiet_transformers() -> None:
    """from_pretrained lists every head it initialises; the report says it once instead."""
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _hf_tokenizer(directory: Path, flag: str):
    from transformers import AutoTokenizer
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ModelError(f"{flag} {directory}: no tokenizer there (neither tokenizer.json nor vocab.txt); "
                         f"save one beside the weights with tokenizer.save_pretrained(DIR)")
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{flag} {directory}: cannot load its tokenizer ({str(exc).splitlines()[0]})") from exc


def _from_hf_directory(directory: Path, flag: str) -> Pretrained:
    from transformers import BertConfig, BertModel
    if not (directory / "config.json").is_file():
        raise ModelError(f"{flag} {directory}: no config.json; give a RUN directory, its hf_model, a Hugging Face "
                         f"BERT directory or a checkpoint directory (RUN/checkpoints/step_N)")
    from commodity_bert.model.bert import not_a_bert
    try:
        problem = not_a_bert(json.loads((directory / "config.json").read_text()))
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelError(f"{flag} {directory}: config.json cannot be read ({exc})") from None
    if problem:
        raise ModelError(f"{flag} {directory}: {problem}")
    tokenizer = _hf_tokenizer(directory, flag)
    from safetensors import SafetensorError
    try:
        config = BertConfig.from_pretrained(str(directory))
        # BertModel's loader strips a task model's prefix (bert.) and reports what it had to create
        # dtype: fine-tuning keeps fp32 weights; a config saying bfloat16 (an export of a bf16
        # run) would otherwise load bf16 weights, which lr 5e-5 updates cannot move
        encoder, info = BertModel.from_pretrained(str(directory), output_loading_info=True,
                                                  attn_implementation="sdpa", dtype=torch.float32)
    except (OSError, ValueError, KeyError, SafetensorError) as exc:  # a weights file cut short: SafetensorError
        raise ModelError(f"{flag} {directory}: not a loadable BERT model ({str(exc).splitlines()[0]})") from exc
    fresh = set(info.get("missing_keys", []))
    state = {f"bert.{k}": v for k, v in encoder.state_dict().items() if k not in fresh}
    if len(state) < 0.5 * len(encoder.state_dict()):
        raise ModelError(f"{flag} {directory}: its weights are not a BERT encoder's ({len(fresh)} of "
                         f"{len(encoder.state_dict())} tensors missing)")
    provenance = {}
    for record in (directory / "pretraining.json", directory.parent / SUMMARY):
        if record.is_file():  # a benchmark snapshot, or the RUN this hf_model was exported from
            known = json.loads(record.read_text())
            provenance = {"step": known.get("step"), "samples": known.get("samples"),
                          "elapsed_s": known.get("elapsed_s", known.get("trained_s"))}
            break
    return Pretrained(directory, config, state, tokenizer, provenance)


def _run_tokenizer(run_dir: Path, run_config: dict, flag: str):
    """The run's tokenizer: its hf_model's if exported, else the vocabulary of its data."""
    if (run_dir / HF_MODEL).is_dir():
        return _hf_tokenizer(run_dir / HF_MODEL, flag)
    from transformers import BertTokenizerFast
    data = Path(run_config.get("args", {}).get("data", ""))
    vocab = data / shard_format.VOCAB_NAME
    if not vocab.is_file():
        raise ModelError(f"{flag}: the run's data directory {data} (for its vocabulary) is not on this machine; "
                         f"run where the data is, or wait for RUN/hf_model")
    lowercase = shard_format.load_manifest(data)["vocab"].get("lowercase", True)
    # vocab=, not vocab_file=: with transformers 5 the latter silently builds a 5-token vocabulary
    return BertTokenizerFast(vocab=str(vocab), do_lower_case=lowercase)


def from_checkpoint(step_dir: Path, flag: str = "--model") -> Pretrained:
    """A DeepSpeed checkpoint train.py wrote: the module's weights (in the training precision)
    and the run's clocks, without starting DeepSpeed."""
    from transformers import BertConfig
    run_dir = step_dir.parent.parent
    run_config = read_run_config(run_dir)
    if run_config is None or "model_config" not in run_config:
        raise ModelError(f"{flag} {step_dir}: a checkpoint, but {run_dir / RUN_CONFIG} (its model's configuration) "
                         f"is missing or unreadable; give the RUN directory's checkpoint or its hf_model")
    try:
        # mmap: under ZeRO 0 the file also holds the optimizer's state, read only where touched
        saved = torch.load(step_dir / ckpt.MODEL_FILE, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - a checkpoint still being written or cut short
        raise ModelError(f"{flag} {step_dir}: cannot read {ckpt.MODEL_FILE} ({str(exc).splitlines()[0]})") from exc
    state = {k.removeprefix("hf_model."): v.float() for k, v in saved["module"].items()}
    state = {k: v for k, v in state.items() if k.startswith("bert.")}
    config = BertConfig.from_dict(run_config["model_config"])
    clocks = saved.get("clocks") or {}
    provenance = {"step": saved.get("global_steps"), "samples": saved.get("samples"),
                  "elapsed_s": clocks.get("trained_s")}
    return Pretrained(step_dir, config, state, _run_tokenizer(run_dir, run_config, flag), provenance)


def load(path: Path, flag: str = "--model") -> Pretrained:
    _quiet_transformers()
    if not path.exists():
        raise ModelError(f"{flag} {path}: no such directory")
    if (path / ckpt.MODEL_FILE).is_file():
        if why := ckpt.weights_damage(path.parent, path.name):
            raise ModelError(f"{flag} {path}: a damaged checkpoint ({why}); give another step_N, or the RUN "
                             f"directory for its newest intact one")
        return from_checkpoint(path, flag)
    if (path / HF_MODEL).is_dir():
        return _from_hf_directory(path / HF_MODEL, flag)
    if (path / "config.json").is_file():
        return _from_hf_directory(path, flag)
    if ckpt.latest(path / CHECKPOINTS):
        tag, line = ckpt.newest_intact_weights(path / CHECKPOINTS)
        if tag is None:
            raise ModelError(f"{flag} {path}: {line}")
        if line:
            print(f"bert-finetune: warning: {line}", file=sys.stderr, flush=True)
        return from_checkpoint(path / CHECKPOINTS / tag, flag)
    raise ModelError(f"{flag} {path}: neither a RUN directory (hf_model/ or checkpoints/), a Hugging Face BERT "
                     f"directory (config.json) nor a checkpoint (step_N/{ckpt.MODEL_FILE})")


POOLINGS = ("mean", "pooler", "cls")


class PooledClassifier(torch.nn.Module):
    """BERT's encoder, a pooling of its last hidden states, dropout and a linear layer.

    `pooler` is Hugging Face's BertForSequenceClassification (BertPooler's dense + tanh on the
    first token, then the classifier); an MLM-only pretraining never trains that dense layer, so
    for such a model it starts fresh. `mean` averages the real tokens' states and `cls` takes
    the first token's state as it is, both straight into the classifier: no untrained layer
    between the pretrained states and the head (benchmarks/RESULTS.md measures the three).
    Written here because transformers' classifier offers only the pooler."""

    def __init__(self, config, pooling: str):
        from transformers import BertModel
        super().__init__()
        self.pooling = pooling
        self.bert = BertModel(config, add_pooling_layer=pooling == "pooler")
        self.dropout = torch.nn.Dropout(config.hidden_dropout_prob)
        self.classifier = torch.nn.Linear(config.hidden_size, config.num_labels)
        self.bert.post_init()  # BERT's own initialisation (normal, std initializer_range)
        self.classifier.weight.data.normal_(0.0, config.initializer_range)
        self.classifier.bias.data.zero_()

    def features(self, input_ids, token_type_ids, attention_mask):
        out = self.bert(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
        if self.pooling == "pooler":
            return out.pooler_output
        hidden = out.last_hidden_state
        if self.pooling == "cls":
            return hidden[:, 0]
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)

    def forward(self, input_ids, token_type_ids, attention_mask):
        return self.classifier(self.dropout(self.features(input_ids, token_type_ids, attention_mask)))


def task_config(pretrained: Pretrained, num_labels: int, dropout: float):
    """The pretrained model's configuration with the task's label count and dropout; sdpa."""
    settings = {k: v for k, v in pretrained.config.to_dict().items() if k not in ("id2label", "label2id")}
    config = pretrained.config.__class__.from_dict({**settings, "hidden_dropout_prob": dropout,
                                                    "attention_probs_dropout_prob": dropout})
    config.num_labels = num_labels  # the setter rebuilds id2label; a from_dict key would lose to it
    config._attn_implementation = "sdpa"
    return config


def with_encoder(model: torch.nn.Module, pretrained: Pretrained, random_init: bool, reinit_layers: int = 0):
    """`model` (any head over a `bert` encoder, in fp32 whatever dtype the source's config names:
    see _from_hf_directory; bf16 is autocast's job) with the pretrained encoder's weights, or
    none of them (`random_init`). `reinit_layers`: the top N encoder layers keep BERT's
    initialisation instead (Zhang et al. 2020, "Revisiting few-sample BERT fine-tuning": the top
    layers specialise in the pretraining task)."""
    model = model.float()
    layers = model.bert.config.num_hidden_layers
    if not 0 <= reinit_layers <= layers:
        raise ModelError(f"--reinit-layers {reinit_layers}: the model {pretrained.path} has {layers} layers; "
                         f"give 0 to {layers}")
    fresh = tuple(f"bert.encoder.layer.{i}." for i in range(layers - reinit_layers, layers))
    if not random_init:
        kept = {k: v for k, v in pretrained.encoder_state.items() if not k.startswith(fresh)}
        missing, unexpected = model.load_state_dict(kept, strict=False)
        missing = [k for k in missing if not k.startswith(fresh)]
        # a trained pooler is only of use to a head that reads it
        unexpected = [k for k in unexpected if not k.startswith("bert.pooler.")]
        assert not unexpected, unexpected  # the state was filtered to the encoder's names
        if any(k.startswith("bert.") and not k.startswith("bert.pooler.") for k in missing):
            raise ModelError(f"--model {pretrained.path}: the weights lack {missing[0]}")
    return model


def classifier(pretrained: Pretrained, num_labels: int, random_init: bool, dropout: float = 0.1,
               pooling: str = "mean", reinit_layers: int = 0) -> PooledClassifier:
    """A classifier with a fresh head (and pooler, where the source had none), drawn from
    torch's generator: seed it first. `random_init`: the same architecture with none of the
    pretrained weights."""
    model = PooledClassifier(task_config(pretrained, num_labels, dropout), pooling)
    return with_encoder(model, pretrained, random_init, reinit_layers)
