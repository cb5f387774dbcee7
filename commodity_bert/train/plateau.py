"""Is the run still on the unigram plateau?

A BERT first learns to answer every mask with the most frequent tokens; its masked-LM accuracy
sits near that of always answering the single most frequent masked token (the "unigram"
accuracy) until it starts to use the context. A run that stays there, from a learning rate too
large for its batch, too short a warm-up or a vocabulary too large for its text, gives a model
that fine-tunes no better than random weights (RESULTS.md: `mini` at LAMB 1e-2 with 64 sequences
a step ended at 4.6% against 9.7% at 2e-3). So once the run has seen `after_samples` samples and
its warm-up is over, every evaluation compares the validation accuracy with `factor` times the
unigram accuracy; the first that finds the run below it prints one warning line, and the
metrics say it at every evaluation from then on (`unigram_acc`, `on_plateau`), so a run that
leaves the plateau later shows `on_plateau: false` again (and a line says when).

The unigram accuracy is counted once at the start from the validation split's masked tokens
(a bincount per rank, summed across ranks: one vocabulary-sized allreduce)."""
from __future__ import annotations

import torch
import torch.distributed as dist

FACTOR = 1.5  # a healthy run passes 1.5x the unigram accuracy early (RESULTS.md)
AFTER_SAMPLES = 25_000  # the quickstart's tiny passes it by 12,800 samples; mini at lr 2e-3 by 25,600

LIKELY_CAUSES = ("a peak lr too large for the batch (ds_configs/README.md, 'the batch rule'), too short a "
                 "warm-up, or a vocabulary too large for the text (bert-data-prep vocab --vocab-size 8192)")


def unigram_accuracy(batches, vocab_size: int, device) -> float:
    """Accuracy of answering the most frequent masked token of the validation split everywhere."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for batch in batches:
        counts += torch.bincount(batch["masked_labels"].flatten(), minlength=vocab_size)[:vocab_size].double()
    counts = counts.to(device)
    if dist.is_initialized():
        dist.all_reduce(counts)
    total = float(counts.sum())
    return float(counts.max()) / total if total else 0.0


class PlateauCheck:
    def __init__(self, unigram_acc: float, after_samples: int = AFTER_SAMPLES, warmup_steps: int = 0,
                 factor: float = FACTOR):
        self.unigram_acc, self.after_samples, self.warmup_steps = unigram_acc, after_samples, warmup_steps
        self.factor = factor
        self.on_plateau: bool | None = None  # None until checked; then the last evaluation's
        self.warned = False

    def fields(self, step: int, samples: int, val_mlm_acc: float) -> tuple[dict, str | None]:
        """Metric fields for an evaluation row, and a line to print: the warning at the first
        evaluation past the check point that finds the run on the plateau, and a note at the
        first one after that finds it has left. `on_plateau` describes each evaluation from the
        check point on."""
        fields = {"unigram_acc": self.unigram_acc}
        if samples < self.after_samples or step < self.warmup_steps:
            return fields, None
        was = self.on_plateau
        self.on_plateau = val_mlm_acc < self.factor * self.unigram_acc
        fields["on_plateau"] = self.on_plateau
        line = None
        if self.on_plateau and not self.warned:
            self.warned = True
            line = (f"warning: still on the unigram plateau after {samples:,} samples (step {step}): validation MLM "
                    f"accuracy {val_mlm_acc:.1%} has not passed {self.factor:g}x the {self.unigram_acc:.1%} of always "
                    f"answering the most frequent masked token. Likely causes: {LIKELY_CAUSES}. A model fine-tuned "
                    f"from here is no better than random weights.")
        elif was and not self.on_plateau:
            line = (f"left the unigram plateau at step {step}: validation MLM accuracy {val_mlm_acc:.1%} against "
                    f"{self.factor:g}x {self.unigram_acc:.1%}")
        return fields, line
