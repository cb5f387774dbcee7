"""What a reader compares a fine-tuned BERT against, besides the majority class: a bag-of-words
logistic regression (scikit-learn's, on word and word-pair counts), and a check that the
pretrained encoder still tells its inputs apart.

The bag of words shows at once whether the transformer learned anything a word count does not
know: on a lexical task such as polarity a linear model on counts is hard to beat with a small
BERT. Its regularisation C is chosen on the same held-out slice of the training data as the
fine-tuning lr (selection.py), never on dev.

The representation check catches a collapsed pretraining (a model stuck on the unigram plateau
answers every input alike): the mean cosine similarity between the mean-pooled final states of
different training inputs, pretrained beside the same architecture at random init. Pretraining
that learned something spreads the inputs apart; one stuck on the plateau draws them together,
above random weights. Measured on both embedded tasks (RESULTS.md, issue 30): random init
0.945 / 0.958 (polarity / party); `tiny` after 600 healthy LAMB steps (14.0% MLM accuracy) 0.77
/ 0.82; `tiny` and `mini` after 20-30 steps, still on the plateau, 0.97-0.99. So a model is
called collapsed when its inputs are at least as alike as random weights make them."""
from __future__ import annotations

import numpy as np
import torch

BOW_C_GRID = (0.1, 1.0, 10.0)
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


def collapsed(pretrained_cosine: float, random_init_cosine: float) -> bool:
    return pretrained_cosine >= random_init_cosine
