"""What a reader compares a fine-tuned BERT against, besides the majority class: a bag-of-words
logistic regression (scikit-learn's, on word and word-pair counts), and a check that the
pretrained encoder still tells its inputs apart.

The bag of words shows at once whether the transformer learned anything a word count does not
know: on a lexical task such as polarity a linear model on counts is hard to beat with a small
BERT. Its regularisation C is chosen on the same held-out slice of the training data as the
fine-tuning lr (selection.py), never on dev.

The representation check catches a collapsed pretraining (a model stuck on the unigram plateau
answers every input alike): the mean cosine similarity between the mean-pooled final states of
different training inputs, pretrained beside random init."""
from __future__ import annotations

import numpy as np
import torch

BOW_C_GRID = (0.1, 1.0, 10.0)
COLLAPSE_INPUTS = 256  # training inputs the representation check encodes
COLLAPSED_COSINE = 0.99  # mean pairwise cosine at or above this: every input looks alike (RESULTS.md)


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
    best = max(trials.values())
    chosen = min(c for c, v in trials.items() if v == best)
    predict = fit(list(range(len(texts))), chosen)
    return {"value": score(predict(_documents(task.dev)), dev_labels), "C": chosen,
            "selection": {f"{c:g}": v for c, v in trials.items()}}


def mean_pairwise_cosine(model, data, pad_id: int, device, batch_size: int = 64) -> float:
    """Mean cosine similarity between the mean-pooled final hidden states of different inputs
    (the first COLLAPSE_INPUTS rows of `data`), through the classifier's encoder."""
    from commodity_bert.finetune.trainer import _collate
    rows = list(range(min(COLLAPSE_INPUTS, len(data))))
    pooled = []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = _collate(data, rows[start:start + batch_size], pad_id, device)
            hidden = model.bert(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                                attention_mask=batch["attention_mask"]).last_hidden_state.float()
            mask = batch["attention_mask"].unsqueeze(-1).float()
            pooled.append((hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0))
    vectors = torch.nn.functional.normalize(torch.cat(pooled), dim=-1)
    similarity = vectors @ vectors.T
    n = len(vectors)
    if n < 2:
        return float("nan")
    return float((similarity.sum() - similarity.diagonal().sum()) / (n * (n - 1)))
