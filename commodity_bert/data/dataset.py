"""One prepared data set, as train.py and bert-plan open it: the directory of `bert-data-prep`
shards, its manifest (checked when opened), the digest that names the data in checkpoints (a
resume onto other data is refused by it), and its vocabulary."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from commodity_bert.data import shard_format
from commodity_bert.data.masking import MASK_PROB


@dataclass(frozen=True)
class ShardSet:
    path: Path
    manifest: dict
    digest: str  # sha256 of manifest.json, which holds every shard's sha256

    @classmethod
    def open(cls, path: str | os.PathLike) -> ShardSet:
        """ShardFormatError, in one line, for a directory that is not a data set."""
        manifest = shard_format.load_manifest(path)
        digest = hashlib.sha256((Path(path) / shard_format.MANIFEST_NAME).read_bytes()).hexdigest()
        return cls(Path(path), manifest, digest)

    @property
    def vocab_path(self) -> Path:
        return self.path / shard_format.VOCAB_NAME

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab"]["size"]

    @property
    def lowercase(self) -> bool:
        return self.manifest["vocab"].get("lowercase", True)

    @property
    def nsp(self) -> bool:
        return self.manifest["nsp"]

    @property
    def mask_prob(self) -> float:
        """The masking rate the shards were prepared for."""
        return self.manifest.get("args", {}).get("mask_prob", MASK_PROB)
