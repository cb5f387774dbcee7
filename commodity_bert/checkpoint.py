"""Checkpoints: DeepSpeed's own (weights, optimizer, scheduler, loss scale) plus what the
engine does not keep: the data position and every rank's random generators.

A checkpoint is the directory CKPT/step_NNNNNNNN. `CKPT/latest` (DeepSpeed's marker) is
replaced atomically by rank 0 only after every rank has written all of its files, so a run
killed while saving resumes from the previous checkpoint."""
from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

TAG = re.compile(r"^step_(\d{8})$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save(engine, directory: Path, step: int, client_state: dict, keep: int, rank_state: dict | None = None) -> Path:
    """`rank_state`: what differs per rank beyond the RNGs (e.g. 1-bit error buffers); DeepSpeed
    saves the optimizer from rank 0 only."""
    tag = tag_for(step)
    rank = dist.get_rank()
    (directory / tag).mkdir(parents=True, exist_ok=True)
    torch.save({**_rng_state(), "rank_state": rank_state or {}}, directory / tag / f"rng_rank{rank}.pt")
    # DeepSpeed's rank 0 would write `latest` before the other ranks finish their files
    engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)
    dist.barrier()
    if rank == 0:
        (directory / "latest.tmp").write_text(tag)
        (directory / "latest.tmp").replace(directory / "latest")
    dist.barrier()
    if rank == 0 and keep > 0:
        tags = sorted(p for p in directory.iterdir() if p.is_dir() and TAG.match(p.name))
        for old in tags[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return directory / tag


def latest(directory: Path) -> str | None:
    marker = directory / "latest"
    if not marker.is_file():
        return None
    tag = marker.read_text().strip()
    return tag if (directory / tag).is_dir() else None


def load(engine, directory: Path, tag: str | None = None, weights_only: bool = False) -> tuple[dict, dict]:
    """Restore a checkpoint; returns its client state (data position, step, samples) and this
    rank's own state."""
    path, client_state = engine.load_checkpoint(
        str(directory), tag=tag, load_optimizer_states=not weights_only,
        load_lr_scheduler_states=not weights_only, load_module_only=weights_only)
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {directory}")
    rank_state = {}
    if not weights_only:
        rng = Path(path).parent / f"rng_rank{dist.get_rank()}.pt"
        if rng.is_file():
            state = torch.load(rng, weights_only=False)
            _set_rng_state(state)
            rank_state = state.get("rank_state", {})
    return client_state or {}, rank_state
