"""What a reader compares a fine-tuned BERT against, besides the majority class: a bag-of-words
logistic regression (scikit-learn's, on word and word-pair counts), a linear probe on the frozen
encoder's features, and a check that the pretrained encoder still tells its inputs apart.

The bag of words shows at once whether the transformer learned anything a word count does not
know: on a lexical task such as polarity a linear model on counts is hard to beat with a small
BERT. Its regularisation C is chosen on the same held-out slice of the training data as the
fine-tuning lr (selection.py), never on dev.

The representation check catches a collapsed pretraining (a model stuck on the unigram plateau
answers every input alike): the mean cosine similarity between the mean-pooled final states of
different training inputs, pretrained beside the same architecture at random init. Pretraining
that learned something spreads the inputs apart; one stuck on the plateau draws them together,
above random weights. Measured on both embedded tasks (RESULTS.md): random init
0.945 / 0.958 (polarity / party); `tiny` after 600 healthy LAMB steps (14.0% MLM accuracy) 0.77
/ 0.82; `tiny` and `mini` after 20-30 steps, still on the plateau, 0.97-0.99. So a model is
called collapsed when its inputs are at least as alike as random weights make them.

The linear probe is a logistic regression on the frozen encoder's mean-pooled final states,
pretrained beside random init. It has none of fine-tuning's seed noise and no lr to choose, so
it shows what pretraining put into the features on its own: fine-tuning at a well-chosen lr can
let random weights catch up on a small lexical task (the model learns a bag of words either
way), the probe cannot."""
from __future__ import annotations

import numpy as np
import torch

from commodity_bert.finetune.selection import choose  # the smaller setting on a tie, as for the lr

BOW_C_GRID = (0.1, 1.0, 10.0)
PROBE_C_GRID = (0.01, 0.1, 1.0, 10.0)  # on standardised features
COLLAPSE_INPUTS = 256  # training inputs the representation check encodes


def _documents(split) -> list[str]:
    if split.pairs is None:
        return list(split.texts)
    return [f"{a} ||| {b}" for a, b in zip(split.texts, split.pairs)]


def bag_of_words(task, fit_rows: list[int], held_rows: list[int], score) -> dict:
    """Logistic regression on unigram and bigram counts: C chosen on the held-out slice, then
    fitted on the whole training split and scored on dev with the task's metric
    (`score(predicted, gold)`)."""
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.linear_model import LogisticRegression

    texts = _documents(task.train)
    labels = np.array(task.label_ids(task.train))
    dev_labels = task.label_ids(task.dev)

    def fit(rows, c):
        vectorizer = CountVectorizer(ngram_range=(1, 2), min_df=1, lowercase=True)
        features = vectorizer.fit_transform([texts[i] for i in rows])
        model = LogisticRegression(C=c, max_iter=2000)
        model.fit(features, labels[rows])
        return lambda docs: model.predict(vectorizer.transform(docs)).tolist()

    trials = {}
    for c in BOW_C_GRID:
        predict = fit(fit_rows, c)
        trials[c] = score(predict([texts[i] for i in held_rows]), labels[held_rows].tolist())
    chosen = choose(trials)
    predict = fit(list(range(len(texts))), chosen)
    return {"value": score(predict(_documents(task.dev)), dev_labels), "C": chosen,
            "selection": {f"{c:g}": v for c, v in trials.items()}}


def pooled_features(model, data, pad_id: int, device, rows: list[int] | None = None, all_layers: bool = False,
                    batch_size: int = 64) -> torch.Tensor:
    """The mean-pooled final hidden states of `rows` of `data` (default: every row), through the
    classifier's encoder in eval mode (no dropout), in row order, fp32 on the CPU: [rows,
    hidden]; with all_layers, every layer's (0 = the embeddings): [layers + 1, rows, hidden]."""
    from commodity_bert.finetune.trainer import padded
    rows = list(range(len(data))) if rows is None else rows
    order = sorted(range(len(rows)), key=lambda k: -len(data.input_ids[rows[k]]))  # little padding
    config = model.bert.config
    pooled = torch.empty(config.num_hidden_layers + 1 if all_layers else 1, len(rows), config.hidden_size)
    model.eval()
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            at = order[start:start + batch_size]
            batch = padded(data, [rows[k] for k in at], pad_id, device)
            out = model.bert(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                             attention_mask=batch["attention_mask"], output_hidden_states=all_layers)
            mask = batch["attention_mask"].unsqueeze(-1).float()
            for layer, hidden in enumerate(out.hidden_states if all_layers else (out.last_hidden_state,)):
                pooled[layer, at] = ((hidden.float() * mask).sum(1) / mask.sum(1).clamp(min=1.0)).cpu()
    return pooled if all_layers else pooled[0]


def mean_cosine(vectors: torch.Tensor) -> float:
    """Mean cosine similarity between different rows of `vectors`."""
    n = len(vectors)
    if n < 2:
        return float("nan")
    unit = torch.nn.functional.normalize(vectors, dim=-1)
    similarity = unit @ unit.T
    return float((similarity.sum() - similarity.diagonal().sum()) / (n * (n - 1)))


def mean_pairwise_cosine(model, data, pad_id: int, device) -> float:
    """mean_cosine of the mean-pooled final hidden states of the first COLLAPSE_INPUTS rows."""
    return mean_cosine(pooled_features(model, data, pad_id, device, rows=list(range(min(COLLAPSE_INPUTS, len(data))))))


def linear_probe(features, labels, dev_features, dev_labels, fit_rows: list[int], held_rows: list[int],
                 score) -> dict:
    """Logistic regression on frozen features (one row per example, standardised): C chosen on
    the held-out slice, then fitted on the whole training split and scored on dev."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    features, dev_features, labels = np.asarray(features), np.asarray(dev_features), np.asarray(labels)

    def fit(rows, c):
        return make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000)).fit(features[rows], labels[rows])

    trials = {c: score(fit(fit_rows, c).predict(features[held_rows]).tolist(), labels[held_rows].tolist())
              for c in PROBE_C_GRID}
    chosen = choose(trials)
    predicted = fit(list(range(len(labels))), chosen).predict(dev_features).tolist()
    return {"value": score(predicted, list(dev_labels)), "C": chosen,
            "selection": {f"{c:g}": v for c, v in trials.items()}}


def collapsed(pretrained_cosine: float, random_init_cosine: float) -> bool:
    return pretrained_cosine >= random_init_cosine
