"""Do rare tokens' input embeddings collapse onto one direction? The word-embedding matrix of a
pretrained BERT, its tokens grouped by how often they occur in a corpus: mean pairwise cosine
and mean norm per group (500 tokens drawn per group), and the matrix's effective rank (the
exponential of the entropy of its centred singular values' energy), beside N(0, 0.02) weights,
BERT's initialisation.

With tied input and output embeddings, every masked-LM step pushes the output row of every
token that was not the answer away from the hidden state; a token that is rarely an input or an
answer gets only that push, the same direction for all of them, and Adam-type optimizers scale
it to a full-size step. This asks whether that is why a briefly pretrained model probes
and fine-tunes no better than random weights (RESULTS.md measures the collapse, and that untying the
embeddings removes it without moving the downstream figures).

    python benchmarks/embedding_spread.py --model RUN [--corpus ../shared/corpora/sotu.txt] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from commodity_bert.finetune import models  # noqa: E402

BANDS = ((1000, None), (100, 1000), (10, 100), (1, 10), (0, 1))  # occurrences in the corpus
PER_BAND = 500


def spread(matrix: torch.Tensor, freq: torch.Tensor, generator: torch.Generator) -> dict:
    unit = torch.nn.functional.normalize(matrix, dim=-1)
    bands = []
    for low, high in BANDS:
        members = ((freq >= low) & (freq < (high or float("inf")))).nonzero().squeeze(1)
        if len(members) < 2:
            continue
        drawn = members[torch.randperm(len(members), generator=generator)[:PER_BAND]]
        sims = unit[drawn] @ unit[drawn].T
        k = len(drawn)
        bands.append({"occurrences": [low, high], "tokens": len(members),
                      "mean_cosine": round(float((sims.sum() - k) / (k * (k - 1))), 4),
                      "mean_norm": round(float(matrix[drawn].norm(dim=-1).mean()), 4)})
    energy = torch.linalg.svdvals(matrix - matrix.mean(0)) ** 2
    energy = energy / energy.sum()
    rank = float(torch.exp(-(energy * torch.log(energy.clamp(min=1e-30))).sum()))
    return {"effective_rank": round(rank, 1), "width": matrix.shape[1], "bands": bands}


def _band(occurrences) -> str:
    low, high = occurrences
    if high is None:
        return f"{low}+"
    return str(low) if high - 1 == low else f"{low}-{high - 1}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--corpus", type=Path, default=REPO.parent / "shared" / "corpora" / "sotu.txt")
    p.add_argument("--corpus-chars", type=int, default=3_000_000, help="read this much of the corpus")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    pretrained = models.load(args.model)
    matrix = pretrained.encoder_state["bert.embeddings.word_embeddings.weight"].float()
    text = args.corpus.read_text(errors="replace")[:args.corpus_chars]
    counts = Counter(pretrained.tokenizer(text, add_special_tokens=False)["input_ids"])
    freq = torch.tensor([counts.get(i, 0) for i in range(matrix.shape[0])], dtype=torch.float)
    result = {"model": str(args.model), "corpus": str(args.corpus), "corpus_chars": args.corpus_chars,
              "tied_output_embeddings": bool(getattr(pretrained.config, "tie_word_embeddings", True)),
              "pretrained": spread(matrix, freq, torch.Generator().manual_seed(0)),
              "random_init": spread(torch.randn(matrix.shape, generator=torch.Generator().manual_seed(1)) * 0.02,
                                    freq, torch.Generator().manual_seed(0))}
    for arm in ("pretrained", "random_init"):
        r = result[arm]
        bands = [f"seen {_band(b['occurrences'])} ({b['tokens']} tokens): cos {b['mean_cosine']:.3f}, "
                 f"norm {b['mean_norm']:.3f}" for b in r["bands"]]
        print(f"{arm}: effective rank {r['effective_rank']} of {r['width']}; " + "; ".join(bands))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
