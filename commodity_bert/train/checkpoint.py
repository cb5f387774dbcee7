"""Checkpoints: DeepSpeed's own (weights, optimizer, scheduler, loss scale) plus what the
engine does not keep: the data position, the run's clocks, the dataset's digest and every
rank's random generators (CPU and CUDA).

A checkpoint is the directory CKPT/step_NNNNNNNN. `CKPT/latest` (DeepSpeed's marker) is
replaced atomically only after every rank has written all of its files, so a run killed while
saving resumes from the previous checkpoint.

Cluster nodes often share no run directory. `storage_is_shared` finds out at start; when it is
not, DeepSpeed's `checkpoint.use_node_local_storage` makes the first rank of every node write
the model and optimizer files there, and that rank writes the node's `latest`. Whether to resume
is then agreed by all ranks (`agree_on_resume`): one step everyone holds, or one line saying
what is missing where."""
from __future__ import annotations

import os
import random
import re
import secrets
import shutil
import socket
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from commodity_bert.optim.cpu_adam_resume import replay_bias_correction

try:
    from numpy._core.multiarray import _reconstruct  # numpy 2
except ImportError:
    from numpy.core.multiarray import _reconstruct  # numpy 1

TAG = re.compile(r"^step_(\d{8})$")
MODEL_FILE = "mp_rank_00_model_states.pt"


class CheckpointError(Exception):
    """A checkpoint could not be written or agreed on; the message is one line for the user."""


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def _rng_state() -> dict:
    # numpy's state as a tensor and plain numbers, not its pickled array: the file then loads
    # with torch.load(weights_only=True), which runs no code from the file
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()  # dropout on the GPU draws from these
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = ("MT19937", numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["gauss"])
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_rank_file(path: Path) -> dict:
    """A rank's RNG and own state, loaded without running code from the file (weights_only).
    Files written before 2026-11-25 hold numpy's state as a pickled array: numpy's array
    reconstruction is allowed for them, nothing else."""
    numpy_arrays = [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(numpy_arrays):
        return torch.load(path, weights_only=True)


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def storage_is_shared(run_dir: Path) -> bool:
    """Whether every rank sees the same run directory: rank 0 writes a random token there and
    every rank looks for it."""
    token = [secrets.token_hex(8) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    probe = run_dir / f".shared_probe_{token[0]}"
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text(token[0])
    dist.barrier()
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, probe.is_file())
    dist.barrier()
    if dist.get_rank() == 0:
        probe.unlink()
    return all(seen)


def is_writer(node_local: bool) -> bool:
    """Whether this rank writes the shared files (the marker, pruning) of its directory."""
    return _local_rank() == 0 if node_local else dist.get_rank() == 0


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _space_message(directory: Path, tag: str, need: int, what: str, at_least: bool) -> str:
    free = shutil.disk_usage(directory).free if directory.exists() else 0
    previous = latest(directory)
    kept = f"{previous} is intact" if previous else "there is no earlier checkpoint"
    size = f"{'more than' if at_least else 'about'} {need / 2**20:,.0f} MB"
    return (f"cannot write checkpoint {directory / tag} ({what}): {free / 2**20:,.0f} MB free there and a "
            f"checkpoint needs {size}; the partial {tag} was removed and {kept}. Free space there or use an "
            f"--output-dir on a larger disk, then relaunch the same command to resume")


def save(engine, directory: Path, step: int, client_state: dict, keep: int, rank_state: dict | None = None,
         node_local: bool = False) -> Path:
    """Write the checkpoint of `step` on every rank, or raise CheckpointError on every rank with
    the partial directory removed and the previous checkpoint untouched (a full disk must not
    cost the run its last good state). `rank_state`: what differs per rank beyond the RNGs (e.g.
    1-bit error buffers); DeepSpeed saves the optimizer from rank 0 only."""
    tag = tag_for(step)
    rank = dist.get_rank()
    writer = is_writer(node_local)

    # DeepSpeed raises from deep inside torch.save when a write fails, between its own
    # collectives; a rank that left there would hang the others. Each write is tried here and
    # its failure kept, so every rank runs DeepSpeed's save to the end and all agree afterwards.
    errors: list[str] = []

    def guarded(write):
        def attempt(*args, **kwargs):
            if errors:
                return
            try:
                write(*args, **kwargs)
            except (OSError, RuntimeError) as exc:
                errors.append(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return attempt

    writes = {"save": engine.checkpoint_engine.save, "copy": engine._copy_recovery_script}
    engine.checkpoint_engine.save = guarded(writes["save"])
    engine._copy_recovery_script = guarded(writes["copy"])  # zero_to_fp32.py, beside ZeRO's files
    try:
        guarded(lambda: (directory / tag).mkdir(parents=True, exist_ok=True))()
        guarded(torch.save)({**_rng_state(), "rank_state": rank_state or {}}, directory / tag / rng_file(rank))
        # DeepSpeed's rank 0 would write `latest` before the other ranks finish their files
        engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)
    finally:
        engine.checkpoint_engine.save = writes["save"]
        engine._copy_recovery_script = writes["copy"]
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, errors[0] if errors else None)
    dist.barrier()
    if any(failures):
        previous = latest(directory)
        need = _size(directory / previous) if previous else 0  # the last one's size: this one's, about
        partial = _size(directory / tag)
        if writer:
            shutil.rmtree(directory / tag, ignore_errors=True)
        dist.barrier()
        reason = next(f for f in failures if f)
        raise CheckpointError(_space_message(directory, tag, need or partial, reason, at_least=not need))
    if writer:
        (directory / "latest.tmp").write_text(tag)
        (directory / "latest.tmp").replace(directory / "latest")
    dist.barrier()
    if writer and keep > 0:
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


def _missing_files(directory: Path, tag: str, rank: int) -> list[str]:
    """The files this rank reads when it resumes `tag`, if absent here."""
    step_dir = directory / tag
    needed = [step_dir / MODEL_FILE, step_dir / rng_file(rank)]
    missing = [p.name for p in needed if not p.is_file()]
    zero_files = list(step_dir.glob("*_optim_states.pt"))
    if zero_files and not any(f"zero_pp_rank_{rank}_" in p.name for p in zero_files):
        missing.append(f"zero_pp_rank_{rank}_*_optim_states.pt")
    return missing


def agree_on_resume(directory: Path, explicit: bool) -> str | None:
    """The checkpoint every rank resumes from (None: every rank starts fresh), or CheckpointError
    naming what is missing on which host. Ranks deciding from their own disks alone could pick
    different steps, or some could resume while others start over, and then hang."""
    rank = dist.get_rank()
    tag = latest(directory)
    mine = (rank, socket.gethostname(), tag, _missing_files(directory, tag, rank) if tag else [])
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    tags = {view[2] for view in views}
    if tags == {None}:
        if explicit:
            raise CheckpointError(f"--resume {directory}: no checkpoint there (no 'latest' file naming a "
                                  f"step directory)")
        return None
    if len(tags) == 1 and not any(view[3] for view in views):
        return tags.pop()
    newest = max(t for t in tags if t)
    problems = []
    for r, host, t, missing in views:
        if t != newest:
            problems.append(f"rank {r} on {host} has {t or 'no checkpoint'}")
        elif missing:
            problems.append(f"rank {r} on {host} lacks {', '.join(missing)}")
    shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
    raise CheckpointError(f"ranks disagree on the checkpoint to resume in {directory}: {newest} is the newest, "
                          f"but {shown}. Copy {newest} (and 'latest') to those nodes' {directory}, or relaunch "
                          f"with --resume none to start over")


def load(engine, directory: Path, tag: str | None = None, weights_only: bool = False) -> tuple[dict, dict]:
    """Restore a checkpoint; returns its client state (data position, step, samples, clocks) and
    this rank's own state."""
    path, client_state = engine.load_checkpoint(
        str(directory), tag=tag, load_optimizer_states=not weights_only,
        load_lr_scheduler_states=not weights_only, load_module_only=weights_only)
    if path is None:
        raise CheckpointError(f"no checkpoint in {directory}")
    rank_state = {}
    if not weights_only:
        replay_bias_correction(engine.basic_optimizer)  # DeepSpeed's CPU Adam: β^t outside the checkpoint
        rng = Path(path).parent / rng_file(dist.get_rank())
        if rng.is_file():
            state = load_rank_file(rng)
            _set_rng_state(state)
            rank_state = state.get("rank_state", {})
    return client_state or {}, rank_state
