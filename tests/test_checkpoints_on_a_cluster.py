"""Checkpoints and resume as a cluster sees them: nodes that share no run directory, a full
disk, other data, a damaged shard, the time budget across relaunches, --export-only with
nothing to export. Real DeepSpeed launches on this machine."""
import errno
import json
import os
import shutil
import subprocess

import pytest
from conftest import COMMON, ForkedRanks, checked, refused_in_process, rows, train


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "train.py: error:" in line]


def checkpoint_files(run) -> dict[str, int]:
    return {str(p.relative_to(run)): p.stat().st_size for p in sorted((run / "checkpoints").rglob("*")) if p.is_file()}


def test_export_only_without_a_checkpoint_is_refused(tmp_path, train_data, capsys):
    """Where train.py decides what to resume (the launch's one-line exit: test_launch_errors.py)."""
    import train as train_module
    run = tmp_path / "run"
    args = train_module.parse_args([*map(str, COMMON), "--data", str(train_data), "--output-dir", str(run),
                                    "--export-only"])
    status, err = refused_in_process(lambda: train_module.checkpoint_place(args, run), capsys)
    [line] = [line for line in err.splitlines() if "train.py: error:" in line]
    assert status == 2 and "--export-only: no checkpoint in" in line
    assert not (run / "hf_model").exists()


def test_a_shard_that_differs_from_its_manifest_stops_every_rank(tmp_path, train_data):
    copy = tmp_path / "data"
    shutil.copytree(train_data, copy)
    # both read fine as shards: only their digests tell that each holds the other's samples
    a, b = copy / "shard_00000.hdf5", copy / "shard_00001.hdf5"
    a.rename(tmp_path / "swap")
    b.rename(a)
    (tmp_path / "swap").rename(b)
    run = tmp_path / "run"
    proc = train(2, *COMMON, "--data", copy, "--output-dir", run, "--max-steps", 5, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = error_lines(proc)  # both ranks found theirs: the first says it
    assert len(lines) == 1 and "differs from its manifest (sha256)" in lines[0], proc.stderr[-2000:]
    assert not (run / "metrics.jsonl").exists()


def test_relaunches_continue_the_time_budget_and_refuse_other_data_unless_asked_for(tmp_path, train_data):
    """One run directory through four launches, as a preempted run meets them: a relaunch onto
    other data is refused (nothing changed) unless asked for; the time budget and the elapsed time
    continue across relaunches."""
    run = tmp_path / "run"
    common = [*COMMON, "--output-dir", run, "--log-every", 1]
    train(1, *common, "--data", train_data, "--max-steps", 3)
    first = json.loads((run / "summary.json").read_text())
    before = checkpoint_files(run)
    other = tmp_path / "other"
    shutil.copytree(train_data, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["args"]["seed"] = 1234  # what a re-made dataset would differ in
    (other / "manifest.json").write_text(json.dumps(manifest))
    proc = train(1, *common, "--data", other, "--max-steps", 4, check=False)
    assert proc.returncode != 0
    [line] = error_lines(proc)
    assert "was trained on other data" in line and "--allow-data-change" in line
    assert checkpoint_files(run) == before and [r["step"] for r in rows(run)] == [1, 2, 3]
    # a budget the first launch has all but used: the relaunch stops within a few steps, where a
    # budget per launch would give it the whole budget again, 30 steps and more here
    proc = train(1, *common, "--data", train_data, "--max-steps", 1000,
                 "--time-budget", f"{first['wall_s'] + 0.05:.2f}")
    stopped = int(proc.stdout.split("stopping at step ")[1].split(":")[0])
    assert "time budget" in proc.stdout and 4 <= stopped <= 12, proc.stdout[-2000:]
    history = rows(run)
    assert [r["step"] for r in history] == list(range(1, stopped + 1))
    assert history[3]["elapsed_s"] > history[2]["elapsed_s"]  # continued, not started again from 0
    assert (run / "checkpoints" / "latest").read_text() == f"step_{stopped:08d}"  # saved where it stopped
    proc = train(1, *common, "--data", other, "--max-steps", stopped + 1, "--allow-data-change")
    assert "starting at its first batch" in proc.stdout
    assert [r["step"] for r in rows(run)] == list(range(1, stopped + 2))


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a small tmpfs needs root")
def test_a_full_disk_during_checkpoints_is_said_trained_through_with_a_flag_and_ends_the_run_at_its_last(
        tmp_path, train_data):
    """--on-save-error continue on a disk with room for one checkpoint: step 2's is written, steps
    4 and 6 fail, each said in one warning line while training goes on (the partial one removed,
    step 2's kept); the last step's save, which cannot be skipped, ends the run in one line, status 3."""
    disk = tmp_path / "disk"
    disk.mkdir()
    # room for one checkpoint of the tiny model (~18 MB with the session's 8,192-token vocabulary)
    # and the run's logs, not for two
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=28m", "tmpfs", str(disk)], check=True)
    try:
        run = disk / "run"
        proc = train(1, *COMMON, "--data", train_data, "--output-dir", run, "--max-steps", 8, "--save-every", 2,
                     "--keep-checkpoints", 3, "--on-save-error", "continue", check=False)
        assert proc.returncode == 3, proc.stderr[-3000:]
        lines = error_lines(proc)
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert f"cannot write checkpoint {run / 'checkpoints' / 'step_00000008'}" in lines[0]
        assert "MB free there and a checkpoint needs about" in lines[0] and "step_00000002 is intact" in lines[0]
        warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning: cannot write checkpoint")]
        assert [w.split()[4] for w in warnings] == [str(run / "checkpoints" / f"step_0000000{s}") for s in (4, 6)]
        assert all("MB free there" in w and w.endswith("(--on-save-error continue: training goes on without it)")
                   for w in warnings), warnings
        assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()][-1] == 8
        assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step_00000002"]
        assert (run / "checkpoints" / "latest").read_text() == "step_00000002"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.parametrize("error, words", [
    (OSError(errno.ENOSPC, "No space left on device"), "MB free there and a checkpoint needs about 18 MB"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "(or your quota there is used up)"),
    (OSError(errno.EROFS, "Read-only file system"), "is on a read-only file system; the partial step_00000004 was removed"),
    (PermissionError(errno.EACCES, "Permission denied"), "may not write in"),
    (OSError(errno.EIO, "Input/output error"), "the disk reported an I/O error"),
])
def test_a_failed_save_names_its_real_cause(tmp_path, error, words):
    from commodity_bert.train.checkpoint import failure_cause, save_failure_line
    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "latest").write_text("step_00000002")
    line = save_failure_line(tmp_path, "step_00000004", 18 * 2**20, failure_cause(error), at_least=False)
    assert words in line and "step_00000002 is intact" in line and "relaunch the same command to resume" in line
    assert ("MB free there" in line) == (error.errno in (errno.ENOSPC, errno.EDQUOT))


def test_a_checkpoint_that_does_not_read_back_is_blamed_on_the_disk(tmp_path):
    """write_digest reads a finished save back: a torch file whose bytes are not those written
    (a disk that altered them) fails the save with words that say so, not a full disk's."""
    import torch

    from commodity_bert.train.checkpoint import failure_cause, save_failure_line, write_digest
    step = tmp_path / "step_00000004"
    step.mkdir()
    torch.save({"w": torch.arange(4096.0)}, step / "mp_rank_00_model_states.pt")
    raw = bytearray((step / "mp_rank_00_model_states.pt").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (step / "mp_rank_00_model_states.pt").write_bytes(bytes(raw))
    with pytest.raises(OSError) as failed:
        write_digest(step)
    line = save_failure_line(tmp_path, "step_00000004", 0, failure_cause(failed.value), at_least=True)
    assert "did not read back as written, so the disk or its file system altered it" in line
    assert "MB free" not in line and not (step / "digest.json").exists()


# ---- two nodes that share no run directory: each launched on its own, as under Slurm


def on_two_nodes(data, runs, *args) -> subprocess.CompletedProcess:
    """Two nodes of one rank each (forked ranks: conftest.ForkedRanks), each with a run directory
    of its own, as nodes without a shared file system have."""
    return ForkedRanks(2, *COMMON, "--data", data, *args,
                       node_args=[["--output-dir", run] for run in runs]).wait()


def test_nodes_without_a_shared_run_directory_agree_on_what_to_resume(tmp_path, train_data):
    runs = [tmp_path / "node-a" / "run", tmp_path / "node-b" / "run"]
    checked(on_two_nodes(train_data, runs, "--max-steps", 4, "--save-every", 2, "--log-every", 2))
    for run in runs:  # every node holds whole checkpoints of its own
        assert (run / "checkpoints" / "latest").read_text() == "step_00000004"
        assert (run / "checkpoints" / "step_00000004" / "mp_rank_00_model_states.pt").is_file()
    uninterrupted = rows(runs[0])
    # both nodes step back to step 2 (a node missing the newest is refused: test_checkpoint_files.py)
    for run in runs:
        shutil.rmtree(run / "checkpoints" / "step_00000004")
        (run / "checkpoints" / "latest").write_text("step_00000002")
    resumed = checked(on_two_nodes(train_data, runs, "--max-steps", 4, "--log-every", 2))
    assert f"resuming from {runs[0] / 'checkpoints' / 'step_00000002'}" in resumed.stdout
    keys = ("step", "loss", "mlm_acc")
    assert [[r[k] for k in keys] for r in rows(runs[0])] == [[r[k] for k in keys] for r in uninterrupted]
    # the norm is a reduction over threads whose order can change in the last bit (one CI run:
    # 2.0695323944 against 2.0695326328, with identical losses): equal, not bitwise
    assert [r["grad_norm"] for r in rows(runs[0])] == pytest.approx([r["grad_norm"] for r in uninterrupted], rel=1e-5)
    assert json.loads((runs[0] / "summary.json").read_text())["params_identical_across_ranks"] is True
