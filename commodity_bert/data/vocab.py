"""The WordPiece vocabulary: loading, checking and the tokenizer built from it."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from commodity_bert.data.shard_format import sha256_file

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class VocabError(Exception):
    pass


@dataclass(frozen=True)
class Vocab:
    path: Path
    tokens: tuple[str, ...]
    sha256: str

    @classmethod
    def load(cls, path: str | os.PathLike) -> Vocab:
        path = Path(path)
        if not path.is_file():
            raise VocabError(f"vocabulary {path} not found; pass --vocab vocab.txt "
                             f"(make one with: bert-data-prep vocab --input ... --output vocab.txt)")
        try:
            tokens = tuple(line.rstrip("\n") for line in path.read_text(encoding="utf-8").splitlines())
        except UnicodeDecodeError as exc:
            raise VocabError(f"vocabulary {path} is not UTF-8 text ({exc}); pass a vocab.txt "
                             f"with one WordPiece token per line") from exc
        missing = [t for t in SPECIAL_TOKENS if t not in tokens]
        if missing:
            raise VocabError(f"vocabulary {path} lacks the special tokens {missing}; it must be a "
                             f"BERT WordPiece vocab.txt with one token per line")
        if len(set(tokens)) != len(tokens):
            raise VocabError(f"vocabulary {path} lists a token twice; one token per line, each once")
        return cls(path, tokens, sha256_file(path))

    def __len__(self) -> int:
        return len(self.tokens)

    def id(self, token: str) -> int:
        return self.tokens.index(token)

    @property
    def special_ids(self) -> dict[str, int]:
        return {t: self.tokens.index(t) for t in SPECIAL_TOKENS}

    def special_mask(self) -> np.ndarray:
        """True for bracketed special tokens ([CLS], [SEP], [PAD], ...), which are never masked."""
        return np.array([t.startswith("[") and t.endswith("]") for t in self.tokens], dtype=bool)

    def continuation_mask(self) -> np.ndarray:
        """True for '##' word pieces, which whole-word masking keeps with the piece before."""
        return np.array([t.startswith("##") for t in self.tokens], dtype=bool)

    def random_replacement_ids(self) -> np.ndarray:
        """Ids a masked token may be replaced with at random: every non-special token
        (unlike Google's BERT, which could draw [CLS] or [PAD])."""
        return np.flatnonzero(~self.special_mask())

    def tokenizer(self, lowercase: bool):
        """HF `tokenizers` WordPiece tokenizer (BERT normalizer and pre-tokenizer)."""
        from tokenizers import BertWordPieceTokenizer
        return BertWordPieceTokenizer(str(self.path), lowercase=lowercase,
                                      strip_accents=lowercase)


def model_vocabulary(directory: str | os.PathLike) -> tuple[list[str], bool] | None:
    """(tokens in id order, lowercase) of a model directory's tokenizer (a RUN's hf_model, a
    Hugging Face BERT): from vocab.txt where there is one, else from tokenizer.json's WordPiece
    vocabulary (transformers 5 saves only that); casing from tokenizer_config.json's
    do_lower_case (BERT's default, True, where it says nothing). None: no vocabulary there."""
    import json
    directory = Path(directory)
    if (directory / "vocab.txt").is_file():
        tokens = (directory / "vocab.txt").read_text(encoding="utf-8").splitlines()
    elif (directory / "tokenizer.json").is_file():
        try:
            by_id = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
            tokens = [token for token, _ in sorted(by_id.items(), key=lambda kv: kv[1])]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise VocabError(f"{directory}/tokenizer.json holds no WordPiece vocabulary ({exc}); a BERT "
                             f"tokenizer's has one") from None
    else:
        return None
    try:
        lowercase = bool(json.loads((directory / "tokenizer_config.json").read_text()).get("do_lower_case", True))
    except (OSError, ValueError):
        lowercase = True
    return tokens, lowercase
