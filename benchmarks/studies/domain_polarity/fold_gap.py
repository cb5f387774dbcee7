"""Why the folds read higher than dev: the same fold model scored on its held-out training rows
and on dev. Each of the judge's 3 folds of polarity's 1,000 training rows (selection.folds, the
judge's own), fitted at the rate each arm chose and the fold's steps (selection.fold_steps of
200), seed 1, bf16; the pretrained arm, random init, and a bag of words (unigrams and bigrams,
logistic regression) on the same rows.

    python benchmarks/studies/domain_polarity/fold_gap.py MODEL THREADS OUT.json [PRETRAINED_LR RANDOM_LR]
"""
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from commodity_bert.finetune import selection, trainer  # noqa: E402
from commodity_bert.finetune.evaluation import FAMILIES  # noqa: E402
from commodity_bert.finetune.models import load  # noqa: E402
from commodity_bert.finetune.tasks import embedded_polarity, sample_train  # noqa: E402


def bag_of_words(task, labels, folds) -> list[dict]:
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.linear_model import LogisticRegression
    dev_y = task.label_ids(task.dev)
    rows = []
    for k, (fit, held) in enumerate(folds):
        words = CountVectorizer(ngram_range=(1, 2))
        fitted = LogisticRegression(max_iter=2000).fit(words.fit_transform([task.train.texts[i] for i in fit]),
                                                       [labels[i] for i in fit])
        rows.append({"arm": "bag_of_words", "fold": k,
                     "held": fitted.score(words.transform([task.train.texts[i] for i in held]), [labels[i] for i in held]),
                     "dev": fitted.score(words.transform(task.dev.texts), dev_y)})
    return rows


def main() -> None:
    model_path, threads, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    rates = [float(r) for r in sys.argv[4:6]] or [1e-4, 3e-4]
    torch.set_num_threads(threads)
    task = sample_train(embedded_polarity(), 1000)
    pretrained = load(model_path)
    hp = trainer.Hyperparameters(precision="bf16", min_steps=200)
    train, dev, _ = FAMILIES[task.family].encode(task, pretrained.tokenizer, hp, None)
    folds = selection.folds(train.labels, 3)
    rows = bag_of_words(task, task.label_ids(task.train), folds)
    for name, random_init, lr in (("pretrained", False, rates[0]), ("random_init", True, rates[1])):
        for k, (fit_rows, held_rows) in enumerate(folds):
            fit = train.subset(fit_rows)
            fold_hp = replace(hp, lr=lr, steps=selection.fold_steps(200, len(fit), len(train)))
            fitted = trainer.finetune(pretrained, task, fit, dev, 1, fold_hp, torch.device("cpu"), random_init,
                                      False, keep_model=True)
            held = train.subset(held_rows)
            predicted = trainer.predict(fitted["model"], held, hp.batch_size, pretrained.tokenizer.pad_token_id or 0,
                                        torch.device("cpu"), hp.precision)
            rows.append({"arm": name, "lr": lr, "fold": k, "steps": fold_hp.steps,
                         "held": float(np.mean(np.array(predicted) == np.array(held.labels))), "dev": fitted["value"]})
    summary = {arm: {where: round(100 * float(np.mean([r[where] for r in rows if r["arm"] == arm])), 1)
                     for where in ("held", "dev")} for arm in ("pretrained", "random_init", "bag_of_words")}
    result = {"model": str(model_path), "threads": threads, "rows": rows, "mean_percent": summary}
    print(json.dumps(summary))
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
