"""Fine-tuning one classifier for one seed, the way GLUE fine-tuning is usually done (AdamW,
linear warmup and decay, dropout, gradient clipping at 1), with the same hyperparameters for
every task and every arm (pretrained, random init) unless told; the learning rate alone is
chosen per arm and task on a slice of the training data (selection.py).

A small task still gets `min_steps` optimizer steps (more epochs): 3 epochs of 300 examples
are 30 steps, which move a small model nowhere (27.8% against a majority of 24.9% on a
300-document task: RESULTS.md).

Fast on a CPU because no work is spent on padding: the task is tokenized once and cached,
batches are padded to their own longest sequence, and training batches group sentences of
similar length (sorted within pools of 50 batches, the pools and the batches shuffled by the
seed, as Hugging Face's LengthGroupedSampler does)."""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from commodity_bert.finetune import metrics
from commodity_bert.finetune.models import Pretrained, classifier
from commodity_bert.finetune.tasks import Split, Task

POOL_BATCHES = 50  # length-grouping pool, in batches


@dataclass
class Hyperparameters:
    epochs: float = 3.0
    lr: float | None = None  # None: chosen per arm (selection.py)
    batch_size: int = 32
    max_seq_len: int = 128
    warmup_fraction: float = 0.1
    weight_decay: float = 0.01
    dropout: float = 0.1
    max_grad_norm: float = 1.0
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast; fp16 with a loss scale)
    min_steps: int = 0  # at least this many optimizer steps, whatever the epochs give
    pooling: str = "mean"  # models.POOLINGS
    reinit_layers: int = 0  # the top N encoder layers start fresh (models.classifier)
    head_lr: float | None = None  # the classifier head's rate; None: lr, as the encoder's
    head_init: str = "fresh"  # fresh | probe: a logistic regression on the frozen features (fit_head_to_probe)
    layer_lr_decay: float = 1.0  # each encoder layer's rate this times the one above's (layer_depths); 1: one rate
    steps: int | None = None  # optimizer steps, whatever epochs and min_steps say (chosen by selection.py)
    stride: int | None = None  # extractive QA: tokens two windows of a context share (qa.py); None: a quarter


def total_steps(examples: int, hp: Hyperparameters) -> int:
    if hp.steps:
        return hp.steps
    return max(1, round(hp.epochs * math.ceil(examples / hp.batch_size)), hp.min_steps)


@dataclass
class Encoded:
    input_ids: list[list[int]]
    token_type_ids: list[list[int]]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, rows: list[int]) -> Encoded:
        return Encoded([self.input_ids[i] for i in rows], [self.token_type_ids[i] for i in rows],
                       [self.labels[i] for i in rows])


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "commodity_bert" / "finetune"


def _tokenizer_digest(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        described = json.dumps(tokenizer.get_vocab(), sort_keys=True)
    else:  # truncation and padding change with each call; what the ids depend on does not
        state = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
        described = json.dumps(state, sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()


def _split_digest(split: Split) -> bytes:
    digest = hashlib.sha256()
    for text in split.texts:
        digest.update(text.encode())
        digest.update(b"\0")
    digest.update(b"\1")
    for text in split.pairs or []:
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.digest()


def encode(task: Task, tokenizer, max_seq_len: int, cache_dir: Path | None) -> tuple[Encoded, Encoded, bool]:
    """Both splits as token ids, from the cache where this task, tokenizer and length were
    tokenized before. Returns (train, dev, whether it came from the cache)."""
    key = hashlib.sha256()
    for part in (_tokenizer_digest(tokenizer).encode(), str(max_seq_len).encode(),
                 _split_digest(task.train), _split_digest(task.dev)):
        key.update(part)
    cached = cache_dir / f"{key.hexdigest()[:32]}.pt" if cache_dir else None
    labels = {"train": task.label_ids(task.train), "dev": task.label_ids(task.dev)}
    if cached is not None and cached.is_file():
        try:
            ids = torch.load(cached, weights_only=True)
            return (Encoded(*ids["train"], labels["train"]), Encoded(*ids["dev"], labels["dev"]), True)
        except Exception:  # noqa: BLE001 - a damaged cache entry is re-made, not fatal
            pass
    out = {}
    for name, split in (("train", task.train), ("dev", task.dev)):
        enc = tokenizer(split.texts, split.pairs, truncation=True, max_length=max_seq_len,
                        return_token_type_ids=True, return_attention_mask=False)
        out[name] = (enc["input_ids"], enc["token_type_ids"])
    if cached is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
            torch.save(out, tmp)
            os.replace(tmp, cached)
        except OSError:
            pass  # a read-only cache only costs the next run the tokenizing
    return Encoded(*out["train"], labels["train"]), Encoded(*out["dev"], labels["dev"]), False


def padded(data, rows: list[int], pad_id: int, device) -> dict:
    """input_ids, token_type_ids and attention_mask of `rows` of `data` (any family's encoded
    split: lists of input_ids and token_type_ids), padded to the batch's longest."""
    width = max(len(data.input_ids[i]) for i in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    types = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, i in enumerate(rows):
        n = len(data.input_ids[i])
        ids[r, :n] = torch.tensor(data.input_ids[i])
        types[r, :n] = torch.tensor(data.token_type_ids[i])
        mask[r, :n] = 1
    return {"input_ids": ids.to(device), "token_type_ids": types.to(device), "attention_mask": mask.to(device)}


def _collate(data: Encoded, rows: list[int], pad_id: int, device) -> dict:
    return {**padded(data, rows, pad_id, device),
            "labels": torch.tensor([data.labels[i] for i in rows], device=device)}


def length_grouped_batches(lengths: list[int], batch_size: int, rng: np.random.Generator) -> list[list[int]]:
    order = rng.permutation(len(lengths))
    pool = batch_size * POOL_BATCHES
    batches = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start:start + pool].tolist(), key=lambda i: -lengths[i])
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def autocast(device, precision: str):
    return torch.autocast(device_type=torch.device(device).type, enabled=precision in ("bf16", "fp16"),
                          dtype=torch.float16 if precision == "fp16" else torch.bfloat16)


def predict(model, data: Encoded, batch_size: int, pad_id: int, device, precision: str) -> list[int]:
    """Class ids for every row, in row order (batched longest first, so little padding)."""
    order = sorted(range(len(data)), key=lambda i: -len(data.input_ids[i]))
    predicted = [0] * len(data)
    model.eval()
    with torch.no_grad(), autocast(device, precision):
        for start in range(0, len(order), batch_size * 2):
            rows = order[start:start + batch_size * 2]
            batch = _collate(data, rows, pad_id, device)
            logits = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                           attention_mask=batch["attention_mask"])
            for i, p in zip(rows, logits.argmax(-1).tolist()):
                predicted[i] = p
    return predicted


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


def layer_depths(names: list[str], num_layers: int) -> dict[str, int]:
    """Each parameter's depth for layer-wise learning-rate decay: the embeddings 0, encoder layer
    i (from 0) i + 1, the pooler and the task's head L + 1."""
    depths = {}
    for name in names:
        if name.startswith("bert.embeddings."):
            depths[name] = 0
        elif name.startswith("bert.encoder.layer."):
            depths[name] = int(name.split(".")[3]) + 1
        else:
            depths[name] = num_layers + 1
    return depths


def parameter_groups(model: torch.nn.Module, hp: Hyperparameters) -> list[dict]:
    """AdamW's groups: no weight decay on biases and LayerNorms; the classifier head at its own
    rate where --head-lr gives one (a fresh head beside a pretrained encoder that a small rate
    keeps: at the encoder's 3e-5 the head barely learns in a few hundred steps); with
    --layer-lr-decay d below 1, a parameter at depth k (layer_depths) of a model of L layers at
    lr * d ** (L + 1 - k): the top layer at d times the rate, the embeddings at d ** (L + 1)
    (ELECTRA, Clark et al. 2020, who count their task layer one deeper: the lower layers hold the
    general features fine-tuning should move least)."""
    no_decay = ("bias", "LayerNorm.weight", "LayerNorm.bias")
    named = list(model.named_parameters())
    layers = model.bert.config.num_hidden_layers if hasattr(model, "bert") else 0
    depths = layer_depths([n for n, _ in named], layers)
    top = layers + 1
    groups: dict[tuple, dict] = {}
    for name, param in named:
        head = name.startswith("classifier.")
        lr = hp.head_lr if head and hp.head_lr is not None else hp.lr
        if hp.layer_lr_decay != 1.0 and not head and lr is not None:
            lr = lr * hp.layer_lr_decay ** (top - depths[name])
        decay = 0.0 if name.endswith(no_decay) else hp.weight_decay
        key = (head, depths[name] if hp.layer_lr_decay != 1.0 else 0, decay)
        groups.setdefault(key, {"params": [], "weight_decay": decay, "lr": lr})["params"].append(param)
    return list(groups.values())


PROBE_CS = (0.001, 0.01, 0.1, 1.0)


def fit_head_to_probe(model, train: Encoded, pad_id: int, device, num_labels: int) -> None:
    """Linear probing, then fine-tuning (Kumar et al. 2022, "Fine-Tuning can Distort Pretrained
    Features"): the head starts as a logistic regression fitted on the frozen encoder's pooled
    features of the training rows, so the first steps move the encoder toward a head that
    already reads it, rather than a random head's gradients moving it away from what it knows.
    Measured here because a probe on the frozen features beat full fine-tuning of the same model
    (benchmarks/RESULTS.md). scikit-learn's LogisticRegression on standardised features, folded
    back into the linear layer (C, the regularisation, by 5-fold cross-validation on the training
    rows: an unregularised probe overfits 1,000 rows of 256 features and dropout then breaks it)
    (w / sigma, b - w . mu / sigma); a two-class fit's single logit is
    split as -z/2, +z/2 so the softmax equals its sigmoid."""
    from sklearn.linear_model import LogisticRegressionCV
    model.eval()
    features = []
    with torch.no_grad():
        for start in range(0, len(train), 64):
            batch = _collate(train, list(range(start, min(start + 64, len(train)))), pad_id, device)
            features.append(model.features(batch["input_ids"], batch["token_type_ids"],
                                           batch["attention_mask"]).float().cpu())
    x = torch.cat(features).double().numpy()
    mean, std = x.mean(0), x.std(0) + 1e-6
    labels = np.asarray(train.labels)
    folds = int(min(5, np.bincount(labels).min()))  # C by cross-validation on the training rows
    with warnings.catch_warnings():  # scikit-learn 1.8's notices of its coming attribute changes
        warnings.simplefilter("ignore", FutureWarning)
        fitted = LogisticRegressionCV(Cs=PROBE_CS, cv=folds, scoring="neg_log_loss", max_iter=2000).fit(
            (x - mean) / std, labels)
    coef, intercept = fitted.coef_ / std, fitted.intercept_ - (fitted.coef_ / std) @ mean
    if len(fitted.classes_) == 2:
        coef, intercept = np.concatenate([-coef / 2, coef / 2]), np.concatenate([-intercept / 2, intercept / 2])
    weight = torch.zeros(num_labels, x.shape[1], dtype=torch.float64)
    bias = torch.full((num_labels,), -1e4 if len(fitted.classes_) < num_labels else 0.0, dtype=torch.float64)
    for row, label in enumerate(fitted.classes_):  # a label absent from the rows keeps a very low logit
        weight[int(label)], bias[int(label)] = torch.from_numpy(coef[row]), float(intercept[row])
    with torch.no_grad():
        model.classifier.weight.copy_(weight.float())
        model.classifier.bias.copy_(bias.float())
    model.train()


def fit(model, lengths: list[int], loss_of, total: int, seed: int, hp: Hyperparameters, progress: bool,
        label: str) -> list[float]:
    """`total` optimizer steps of AdamW with linear warmup and decay and gradient clipping, over
    length-grouped batches of the training units (`lengths`: each unit's tokens), epoch after
    epoch; `loss_of(rows)` is the family's loss on a batch of unit indices. Shared by every task
    family (classification here, qa.py, tagging.py). Returns each step's loss."""
    optimizer = torch.optim.AdamW(parameter_groups(model, hp), lr=hp.lr, betas=(0.9, 0.999), eps=1e-8)
    warmup = round(hp.warmup_fraction * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else max(0.0, (total - s) / max(1, total - warmup)))
    rng = np.random.default_rng(seed)
    # fp16's narrow range: the loss scaled up for backward and the gradients back down before the
    # clipping, a step skipped where they overflow (torch's GradScaler); bf16 and fp32 need none
    scaler = torch.amp.GradScaler(next(model.parameters()).device.type, enabled=hp.precision == "fp16")
    model.train()
    step = 0
    losses = []
    bar = tqdm(total=total, desc=label, leave=False, disable=None if progress else True)
    while step < total:
        for rows in length_grouped_batches(lengths, hp.batch_size, rng):
            if step >= total:
                break
            loss = loss_of(rows)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), hp.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            step += 1
            bar.update(1)
            if step % 20 == 0:
                bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
    bar.close()
    return losses


def finetune(pretrained: Pretrained, task: Task, train: Encoded, dev: Encoded, seed: int, hp: Hyperparameters,
             device, random_init: bool = False, progress: bool = True, label: str | None = None,
             keep_model: bool = False) -> dict:
    """Fine-tune from `pretrained` (or its architecture, randomly initialised) with one seed;
    returns the dev metric and the seconds it took (and, with keep_model, the fitted classifier
    as "model", for scoring it on other rows without fitting it again)."""
    started = time.perf_counter()
    seed_everything(seed)
    model = classifier(pretrained, len(task.label_names), random_init, hp.dropout, hp.pooling,
                       hp.reinit_layers).to(device)
    pad_id = pretrained.tokenizer.pad_token_id or 0
    if hp.head_init == "probe":
        fit_head_to_probe(model, train, pad_id, device, len(task.label_names))
    lengths = [len(ids) for ids in train.input_ids]
    total = total_steps(len(train), hp)

    def loss_of(rows):
        batch = _collate(train, rows, pad_id, device)
        with autocast(device, hp.precision):
            logits = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                           attention_mask=batch["attention_mask"])
        return F.cross_entropy(logits.float(), batch["labels"])
    losses = fit(model, lengths, loss_of, total, seed, hp, progress, label or f"seed {seed}")
    predicted = predict(model, dev, hp.batch_size, pad_id, device, hp.precision)
    positive = task.label_names.index(task.positive_label) if task.positive_label is not None else None
    value = metrics.score(task.metric, predicted, dev.labels, len(task.label_names), positive)
    return {"seed": seed, "value": value, "seconds": round(time.perf_counter() - started, 2), "steps": total,
            "lr": hp.lr,
            "final_train_loss": float(np.mean(losses[-20:])) if losses else None,
            **({"model": model} if keep_model else {})}


def majority(task: Task, dev: Encoded, label) -> float:
    """The dev metric of always answering `label`."""
    index = task.label_names.index(label)
    positive = task.label_names.index(task.positive_label) if task.positive_label is not None else None
    return metrics.score(task.metric, [index] * len(dev), dev.labels, len(task.label_names), positive)


def summarise(per_seed: list[dict]) -> dict:
    values = [row["value"] for row in per_seed]
    return {"median": float(np.median(values)), "min": min(values), "max": max(values), "per_seed": per_seed}


def hyperparameters_dict(hp: Hyperparameters) -> dict:
    return {**asdict(hp), "lr": "auto" if hp.lr is None else hp.lr}
