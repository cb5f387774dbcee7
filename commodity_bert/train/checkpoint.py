"""Checkpoints: DeepSpeed's own (weights, optimizer, scheduler, loss scale) plus what the
engine does not keep: the data position, the run's clocks, the dataset's digest and every
rank's random generators (CPU and CUDA).

A checkpoint is the directory CKPT/step_NNNNNNNN. `CKPT/latest` (DeepSpeed's marker) is
replaced atomically only after every rank has written all of its files, so a run killed while
saving resumes from the previous checkpoint.

A checkpoint is whole once its `digest.json` is written: each file's size and SHA-256, taken as
the files are read back after the save, when every torch file is also checked against the CRCs
torch wrote from memory (a write the disk did not keep shows there). Only then is `latest`
moved and are older checkpoints pruned, so pruning never removes the last whole one. A resume
verifies the files each rank reads against the digest, newest checkpoint first, and takes the
newest that every rank finds intact; the skipped newer ones are renamed NAME.skipped, not
deleted. Why our own: DeepSpeed records nothing of the kind (torch.distributed.checkpoint and
Orbax skip unfinished checkpoints but load damaged ones; Megatron-LM's opt-in SHA-256 check
refuses with no fallback).

Cluster nodes often share no run directory. `storage_is_shared` finds out at start; when it is
not, DeepSpeed's `checkpoint.use_node_local_storage` makes the first rank of every node write
the model and optimizer files there, and that rank writes the node's `latest`. Whether to resume
is then agreed by all ranks (`agree_on_resume`): one step everyone holds, or one line saying
what is missing where."""
from __future__ import annotations

import errno
import getpass
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import socket
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from commodity_bert.host import atomic_write_text
from commodity_bert.optim.cpu_adam_resume import replay_bias_correction

try:
    from numpy._core.multiarray import _reconstruct  # numpy 2
except ImportError:
    from numpy.core.multiarray import _reconstruct  # numpy 1

TAG = re.compile(r"^step_(\d{8})$")
MODEL_FILE = "mp_rank_00_model_states.pt"
DIGEST = "digest.json"
PROGRESS = "progress.json"  # step, samples and batch sizes, readable before an engine exists


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


def directory_bytes(path: Path) -> int:
    """The bytes of the files under `path` (0 where there is no such directory)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


class ReadBackError(OSError):
    """A file of a finished save that does not read back as it was written."""


def failure_cause(exc: BaseException) -> tuple[str | None, str]:
    """(what kind of failure, its first line): an errno's name, "read back" for a file that did
    not read back as written, None where the error says neither (torch.save wraps a failed write in
    a RuntimeError that has lost its errno)."""
    line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, ReadBackError):
        return "read back", line
    if isinstance(exc, OSError) and exc.errno in errno.errorcode:
        return errno.errorcode[exc.errno], line
    return None, line


def save_failure_line(directory: Path, tag: str, need: int, cause: tuple[str | None, str], at_least: bool) -> str:
    """One line for a save that failed, naming the real cause: a full disk (or quota), a read-only
    file system, a directory this user may not write, a disk that altered what was written, an
    I/O error; the partial checkpoint is gone and the previous one intact in every case."""
    kind, what = cause
    free = shutil.disk_usage(directory).free if directory.exists() else 0
    previous = latest(directory)
    kept = f"{previous} is intact" if previous else "there is no earlier checkpoint"
    head = f"cannot write checkpoint {directory / tag} ({what})"
    after = f"the partial {tag} was removed and {kept}"
    resume = "then relaunch the same command to resume"
    if kind in ("ENOSPC", "EDQUOT") or (kind is None and free < (need or 1)):
        size = f"{'more than' if at_least else 'about'} {need / 2**20:,.0f} MB"
        quota = " (or your quota there is used up)" if kind == "EDQUOT" else ""
        return (f"{head}: {free / 2**20:,.0f} MB free there{quota} and a checkpoint needs {size}; {after}. Free "
                f"space there or use an --output-dir on a larger disk, {resume}")
    if kind == "EROFS":
        return (f"{head}: {directory} is on a read-only file system; {after}. Remount it read-write or use an "
                f"--output-dir on a writable disk, {resume}")
    if kind in ("EACCES", "EPERM"):
        return (f"{head}: user {getpass.getuser()} may not write in {directory}; {after}. Give it the right "
                f"(chmod, chown) or use another --output-dir, {resume}")
    if kind == "read back":
        return (f"{head}: what was written did not read back as written, so the disk or its file system altered "
                f"it; {after}. Check the disk (dmesg, the file system's check) or use an --output-dir on another, "
                f"{resume}")
    if kind == "EIO":
        return (f"{head}: the disk reported an I/O error; {after}. Check the disk (dmesg) or use an --output-dir "
                f"on another, {resume}")
    return f"{head}; {after}. Fix the cause, {resume}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _torch_file_problem(path: Path) -> str | None:
    """A torch file (a zip archive) whose bytes on disk are not those torch wrote: a record's CRC,
    computed by torch from memory, that the bytes read back do not match, or no archive at all."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        return f"{path.name} is not a whole torch file ({exc})"
    return f"{path.name} does not read back as written (record {bad})" if bad else None


def write_digest(step_dir: Path) -> None:
    """Read every file of a finished save back, check the torch files against their CRCs, and
    record each file's size and SHA-256 in digest.json (written last, atomically)."""
    files = {}
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != DIGEST):
        if path.suffix == ".pt" and (problem := _torch_file_problem(path)):
            raise ReadBackError(problem)
        files[str(path.relative_to(step_dir))] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    atomic_write_text(step_dir / DIGEST, json.dumps({"files": files}, indent=1))


def _files_read_by(rank: int, names) -> tuple[list[str], list[str]]:
    """Of a checkpoint's file names, those `rank` reads when it resumes (the model, with the
    optimizer at ZeRO 0; its generators; its ZeRO partition, bf16_zero_pp_… too), and those it
    needs that are not among them."""
    names = list(names)
    read = [n for n in names if n in (MODEL_FILE, rng_file(rank)) or f"zero_pp_rank_{rank}_" in n]
    lacking = [n for n in (MODEL_FILE, rng_file(rank)) if n not in read]
    if any(n.endswith("_optim_states.pt") for n in names) and not any(f"zero_pp_rank_{rank}_" in n for n in read):
        lacking.append(f"zero_pp_rank_{rank}_*_optim_states.pt")
    return read, lacking


def damage(directory: Path, tag: str, rank: int) -> str | None:
    """Why checkpoint `tag` cannot be resumed by `rank` from here (None: it can): no digest (its
    save did not finish), or a file this rank reads that is missing or not what the digest says."""
    step_dir = directory / tag
    digest_file = step_dir / DIGEST
    if not digest_file.is_file():
        if latest(directory) == tag:  # written before checkpoints had digests: as before, by its files
            _, lacking = _files_read_by(rank, (p.name for p in step_dir.iterdir()) if step_dir.is_dir() else ())
            return f"it lacks {', '.join(lacking)}" if lacking else None
        return "its save did not finish (no digest.json)"
    try:
        recorded = json.loads(digest_file.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "its digest.json cannot be read"
    needed, lacking = _files_read_by(rank, recorded)
    if lacking:
        return f"it holds no {', '.join(lacking)}"
    for name in needed:
        if problem := _file_damage(step_dir / name, recorded[name]):
            return problem
    return None


def _file_damage(path: Path, record: dict) -> str | None:
    """Why a checkpoint's file is not the one its digest recorded (None: it is)."""
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"{path.name} has {size:,} bytes, {record['bytes']:,} when written"
    if _sha256(path) != record["sha256"]:
        return f"{path.name} is not the file written (its SHA-256 differs)"
    return None


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
                errors.append(failure_cause(exc))
        return attempt

    writes = {"save": engine.checkpoint_engine.save, "copy": engine._copy_recovery_script}
    engine.checkpoint_engine.save = guarded(writes["save"])
    engine._copy_recovery_script = guarded(writes["copy"])  # zero_to_fp32.py, beside ZeRO's files
    if writer and (directory / tag).exists():  # a skipped or unfinished one of the same step
        shutil.rmtree(directory / tag, ignore_errors=True)
    dist.barrier()
    try:
        guarded(lambda: (directory / tag).mkdir(parents=True, exist_ok=True))()
        guarded(torch.save)({**_rng_state(), "rank_state": rank_state or {}}, directory / tag / rng_file(rank))
        if writer:
            guarded(atomic_write_text)(directory / tag / PROGRESS, json.dumps(
                {"step": step, **{k: client_state[k] for k in ("samples", "batch") if k in client_state}}))
        # DeepSpeed's rank 0 would write `latest` before the other ranks finish their files
        engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)
    finally:
        engine.checkpoint_engine.save = writes["save"]
        engine._copy_recovery_script = writes["copy"]
    def gathered() -> list:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, errors[0] if errors else None)
        return found

    failures = gathered()
    if not any(failures):  # every file is on disk: the writers read them back and record them
        if writer:
            guarded(write_digest)(directory / tag)
        failures = gathered()
    if any(failures):
        previous = latest(directory)
        need = directory_bytes(directory / previous) if previous else 0  # the last one's size: this one's, about
        partial = directory_bytes(directory / tag)
        if writer:
            shutil.rmtree(directory / tag, ignore_errors=True)
        dist.barrier()
        reason = next(f for f in failures if f)
        raise CheckpointError(save_failure_line(directory, tag, need or partial, reason, at_least=not need))
    if writer:
        atomic_write_text(directory / "latest", tag)
    dist.barrier()
    if writer and keep > 0:  # the whole ones beyond `keep`, and unfinished ones older than this
        older = sorted(p for p in directory.iterdir() if p.is_dir() and TAG.match(p.name) and p.name < tag)
        whole = [p for p in older if (p / DIGEST).is_file()]
        kept = set(whole[-(keep - 1):]) if keep > 1 else set()
        for old in older:
            if old not in kept:
                shutil.rmtree(old, ignore_errors=True)
    return directory / tag


def weights_damage(directory: Path, tag: str) -> str | None:
    """Why the weights of checkpoint `tag` cannot be read from here (None: they can): what
    `damage` says, for the model file alone, which is all that readers of weights take
    (bert-finetune, its --watch, --init-from)."""
    step_dir = directory / tag
    digest_file = step_dir / DIGEST
    if not digest_file.is_file():
        if latest(directory) == tag:  # written before checkpoints had digests
            return None if (step_dir / MODEL_FILE).is_file() else f"it lacks {MODEL_FILE}"
        return "its save did not finish (no digest.json)"
    try:
        recorded = json.loads(digest_file.read_text())["files"][MODEL_FILE]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its digest.json cannot be read or names no {MODEL_FILE}"
    return _file_damage(step_dir / MODEL_FILE, recorded)


def newest_intact_weights(directory: Path) -> tuple[str | None, str | None]:
    """For a reader of weights that takes "the newest": the checkpoint `latest` names if its
    weights are intact, else the newest older one whose are, and a line saying so; (None, why)
    when none is. Nothing is renamed: the directory may be another run's, read only."""
    newest = latest(directory)
    if newest is None:
        return None, f"no checkpoint in {directory}"
    why = weights_damage(directory, newest)
    if why is None:
        return newest, None
    broken = f"checkpoint {directory / newest} is damaged ({why})"
    for tag in sorted((p.name for p in directory.iterdir() if p.is_dir() and TAG.match(p.name) and p.name < newest),
                      reverse=True):
        if weights_damage(directory, tag) is None:
            return tag, f"{broken}: using {tag}, the newest intact one"
    return None, f"{broken}, and no older checkpoint there is intact"


def progress(step_dir: Path) -> dict | None:
    """What checkpoint `step_dir` recorded of its step, samples and batch sizes (None: a
    checkpoint written before it kept them), for the launch to read before it builds an engine."""
    try:
        return json.loads((step_dir / PROGRESS).read_text())
    except (OSError, ValueError):
        return None


def latest(directory: Path) -> str | None:
    marker = directory / "latest"
    if not marker.is_file():
        return None
    tag = marker.read_text().strip()
    return tag if (directory / tag).is_dir() else None


def _gather(mine) -> list:
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    return views


def _listed(problems: list[str]) -> str:
    return "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")


def agree_on_resume(directory: Path, explicit: bool, node_local: bool = False) -> tuple[str | None, str | None]:
    """The checkpoint every rank resumes from (None: every rank starts fresh) and a line to say
    when it is not the newest, or CheckpointError in one line. Ranks deciding from their own disks
    alone could pick different steps, or some could resume while others start over, and then hang.

    The newest (by every rank's `latest`) must be on every rank's disk: a node without it is
    refused, naming it (copy it there, or --resume none). Its files are verified against its
    digest; if any rank finds them damaged, every rank goes back to the newest checkpoint that all
    find intact, and the skipped ones are renamed NAME.skipped. --resume PATH takes no such step
    back: a damaged checkpoint there is refused."""
    rank, host = dist.get_rank(), socket.gethostname()
    views = _gather((rank, host, latest(directory)))
    tags = {view[2] for view in views}
    if tags == {None}:
        if explicit:
            raise CheckpointError(f"--resume {directory}: no checkpoint there (no 'latest' file naming a "
                                  f"step directory)")
        return None, None
    newest = max(t for t in tags if t)
    behind = [f"rank {r} on {h} has {t or 'no checkpoint'}" for r, h, t in views if t != newest]
    if behind:
        raise CheckpointError(f"ranks disagree on the checkpoint to resume in {directory}: {newest} is the newest, "
                              f"but {_listed(behind)}. Copy {newest} (and 'latest') to those nodes' {directory}, "
                              f"or relaunch with --resume none to start over")
    found = [(r, h, why) for r, h, why in _gather((rank, host, damage(directory, newest, rank))) if why]
    if not found:
        return newest, None
    by_reason: dict[str, list[str]] = {}  # a shared file's damage, seen by every rank, said once
    for r, h, why in found:
        by_reason.setdefault(why, []).append(f"rank {r} on {h}")
    reasons = [f"{', '.join(who) if len(who) < 3 else f'{len(who)} ranks'}: {why}" for why, who in by_reason.items()]
    broken = f"checkpoint {directory / newest} is damaged ({_listed(reasons)})"
    if explicit:
        raise CheckpointError(f"--resume {directory}: {broken}; give another checkpoint, or --resume auto in its run")
    # every rank lists the older ones it holds; the newest that every rank finds intact wins
    mine = {p.name for p in directory.iterdir() if p.is_dir() and TAG.match(p.name) and p.name < newest} \
        if directory.is_dir() else set()
    held = set.intersection(*(set(view) for view in _gather(sorted(mine))))
    for tag in sorted(held, reverse=True):
        if not any(_gather(damage(directory, tag, rank))):
            if is_writer(node_local):  # out of the way of pruning and of the next resume, kept for a look
                for skipped in sorted(p for p in directory.iterdir() if TAG.match(p.name) and p.name > tag):
                    skipped.rename(skipped.with_name(skipped.name + ".skipped"))
                atomic_write_text(directory / "latest", tag)
            dist.barrier()
            return tag, (f"{broken}: resuming from {tag}, the newest intact one; the skipped checkpoints are "
                         f"kept as NAME.skipped")
    raise CheckpointError(f"{broken}, and no older checkpoint is intact on every rank; relaunch with --resume none "
                          f"to start over")


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
