"""Bad input gets one clear error line and destroys nothing; interrupted runs resume exactly."""
import gzip
import os
import signal
import subprocess
import sys
import time

import h5py
import pytest
from conftest import REPO, load_manifest, run_cli, shard_checksums, tree_checksums


def error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr  # one line, no traceback
    assert lines[0].startswith("bert-data-prep: error: ")
    return lines[0]


def shards(*args, **kw):
    return run_cli("shards", "--workers", 1, "--num-shards", 2, "--dupe-factor", 1, *args, check=False, **kw)


def test_missing_input(tmp_path):
    line = error_line(shards("--input", tmp_path / "nope.txt", "--output", tmp_path / "out"))
    assert "input not found" in line and "nope.txt" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", [b"", b"\n\n   \n\n"])
def test_empty_corpus(tmp_path, content):
    (tmp_path / "empty.txt").write_bytes(content)
    line = error_line(shards("--input", tmp_path / "empty.txt", "--output", tmp_path / "out"))
    assert "no usable text" in line
    assert not (tmp_path / "out").exists()  # the run created it, the run removes it


def test_binary_file(tmp_path):
    (tmp_path / "model.txt").write_bytes(bytes(range(256)) * 64)
    line = error_line(shards("--input", tmp_path / "model.txt", "--output", tmp_path / "out"))
    assert "binary" in line and "model.txt" in line


def test_truncated_gzip(tmp_path, sotu_small):
    data = gzip.compress(sotu_small.read_bytes())
    (tmp_path / "cut.txt.gz").write_bytes(data[: len(data) // 2])
    line = error_line(shards("--input", tmp_path / "cut.txt.gz", "--output", tmp_path / "out"))
    assert "corrupt or truncated" in line and "cut.txt.gz" in line


def test_undecodable_lines_are_counted_and_skipped(tmp_path, sotu_small):
    good = sotu_small.read_bytes()
    (tmp_path / "mixed.txt").write_bytes(b"caf\xe9 au lait \xff\xfe\n\n" + good + b"\n\n\xc3\x28 bad\n")
    proc = shards("--input", tmp_path / "mixed.txt", "--output", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "warning: skipped 2 line(s): not valid UTF-8 (first at" in proc.stderr
    assert load_manifest(tmp_path / "out")["skipped_lines"]


def test_bad_vocab_file(tmp_path, sotu_small):
    (tmp_path / "vocab.txt").write_text("hello\nworld\n")
    line = error_line(shards("--input", sotu_small, "--vocab", tmp_path / "vocab.txt", "--output", tmp_path / "o"))
    assert "lacks the special tokens" in line


def test_vocab_mismatch_and_other_arguments_leave_existing_shards_alone(tmp_path, sotu_small):
    out = tmp_path / "out"
    assert shards("--input", sotu_small, "--output", out).returncode == 0
    before = tree_checksums(out)
    other_vocab = tmp_path / "other_vocab.txt"
    run_cli("vocab", "--input", sotu_small, "--vocab-size", 800, "--output", other_vocab)
    line = error_line(shards("--input", sotu_small, "--vocab", other_vocab, "--output", out))
    assert "another vocabulary" in line
    line = error_line(shards("--input", sotu_small, "--seq-len", 64, "--output", out))
    assert "other arguments" in line and "seq_len=128 (now 64)" in line
    assert tree_checksums(out) == before


def test_foreign_output_directory_is_not_touched(tmp_path, sotu_small):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    line = error_line(shards("--input", sotu_small, "--output", tmp_path / "mine"))
    assert "not made by bert-data-prep" in line
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["thesis.tex"]


def test_verify_catches_a_damaged_shard(tmp_path, sotu_small):
    out = tmp_path / "out"
    assert shards("--input", sotu_small, "--output", out).returncode == 0
    with h5py.File(out / "shard_00001.hdf5", "r+") as f:
        f["input_ids"][0, 1] = f["input_ids"][0, 1] + 1
    proc = run_cli("inspect", out, "--verify", check=False)
    assert proc.returncode == 1
    assert "shard_00001.hdf5: sha256 differs" in proc.stderr and "FAILED" in proc.stdout
    (out / "shard_00000.hdf5").write_bytes(b"not hdf5")
    proc = run_cli("inspect", out, "--verify", check=False)
    assert "shard_00000.hdf5: cannot be read as HDF5" in proc.stderr


def _kill_when(cmd, ready, timeout=120):
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, "finished before it could be interrupted; make the job larger"
        assert time.time() < deadline
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("phase", ["scatter", "write"])
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, sotu_small, phase):
    args = ["--input", sotu_small, "--num-shards", 24, "--dupe-factor", 3, "--workers", 2, "--seq-len", 64]
    run_cli("shards", *args, "--output", tmp_path / "whole")
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "data_prep", "shards", *map(str, args), "--output", str(out)]
    if phase == "scatter":
        _kill_when(cmd, lambda: any((out / ".work" / "buckets").rglob("*.rec")))
    else:
        _kill_when(cmd, lambda: len(list(out.glob("shard_*.hdf5"))) >= 3)
    assert not (out / "manifest.json").exists()
    finished = list(out.glob("shard_*.hdf5"))
    expected = shard_checksums(tmp_path / "whole")
    for path in finished:  # nothing under a final name is partial
        assert shard_checksums(out)[path.name] == expected[path.name]
    run_cli("shards", *args, "--output", out)
    assert shard_checksums(out) == expected
    assert not (out / ".work").exists() and not list(out.rglob("*.tmp"))
    run_cli("inspect", out, "--verify")


def test_vocab_from_an_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n")
    proc = run_cli("vocab", "--input", tmp_path / "empty.txt", "--output", tmp_path / "vocab.txt", check=False)
    assert "no text found" in error_line(proc)
    assert not (tmp_path / "vocab.txt").exists()
