"""The dev metrics GLUE reports, as fractions: accuracy, F1 of the positive class, Matthews
correlation. Written out (a few lines each) rather than pulling in scikit-learn for them."""
from __future__ import annotations

import math

METRICS = ("accuracy", "f1", "mcc")


def accuracy(predicted: list[int], gold: list[int]) -> float:
    return sum(p == g for p, g in zip(predicted, gold)) / len(gold)


def f1(predicted: list[int], gold: list[int], positive: int) -> float:
    true_pos = sum(p == positive and g == positive for p, g in zip(predicted, gold))
    predicted_pos = sum(p == positive for p in predicted)
    gold_pos = sum(g == positive for g in gold)
    if true_pos == 0:
        return 0.0
    return 2 * true_pos / (predicted_pos + gold_pos)


def matthews(predicted: list[int], gold: list[int], classes: int) -> float:
    """Multiclass Matthews correlation (Gorodkin's R_K, as scikit-learn computes it); 0 when a
    side is constant."""
    confusion = [[0] * classes for _ in range(classes)]
    for p, g in zip(predicted, gold):
        confusion[g][p] += 1
    n = len(gold)
    correct = sum(confusion[k][k] for k in range(classes))
    gold_count = [sum(confusion[k]) for k in range(classes)]
    predicted_count = [sum(confusion[g][k] for g in range(classes)) for k in range(classes)]
    covariance = correct * n - sum(p * g for p, g in zip(predicted_count, gold_count))
    denominator = math.sqrt((n * n - sum(p * p for p in predicted_count)) * (n * n - sum(g * g for g in gold_count)))
    return covariance / denominator if denominator else 0.0


def score(metric: str, predicted: list[int], gold: list[int], classes: int, positive: int | None = None) -> float:
    if metric == "accuracy":
        return accuracy(predicted, gold)
    if metric == "f1":
        return f1(predicted, gold, positive)
    if metric == "mcc":
        return matthews(predicted, gold, classes)
    raise ValueError(f"unknown metric {metric}")
