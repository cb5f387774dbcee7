"""bert-data-prep against NVIDIA's create_pretraining_data.py on the same text and settings.

Both get the same one-sentence-per-line text (blank line between documents: NVIDIA's input
format; made here from the first `--megabytes` of the shared sotu.txt with Bling Fire) and the
same settings: seq 128, dupe factor 5, 20 predictions, masked-LM probability 0.15, short-sequence
probability 0.1, static masking, NSP, BERT's uncased vocabulary. Each runs `--repeats` times,
alone; reported: median wall time (start-up included), MB/s, and the peak RSS of the largest
process. NVIDIA's script is not part of this project: pass the folder that holds it
(`PyTorch/LanguageModeling/BERT` of NVIDIA/DeepLearningExamples). Its tokenization.py imports
`six` and `file_utils` (for downloads, which the local vocabulary does not need); where they are
missing, two-line stand-ins are put on its path.

    python benchmarks/vs_nvidia_data_prep.py --nvidia-dir DIR [--megabytes 6.1 2] [--repeats 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from data_prep.sentences import split_sentences  # noqa: E402

VOCAB = REPO / "data_prep" / "resources" / "bert_base_uncased_vocab.txt"
SOTU = REPO.parent / "shared" / "corpora" / "sotu.txt"
STAND_INS = {"six.py": "PY2 = False\nPY3 = True\n",
             "file_utils.py": "def cached_path(path, cache_dir=None):\n    return path\n"}


def sentence_per_line(out: Path, megabytes: float) -> Path:
    text = SOTU.read_bytes()[:int(megabytes * 1e6)].decode(errors="ignore")
    with open(out, "w") as fh:
        for doc in text.split("\n\n"):
            lines = [s for line in doc.splitlines() if line.strip() for s in split_sentences(line)]
            if lines:
                fh.write("\n".join(lines) + "\n\n")
    return out


def timed(cmd: list[str], cwd: Path, env: dict | None = None) -> tuple[float, float]:
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return time.perf_counter() - started, usage.ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvidia-dir", type=Path, required=True)
    p.add_argument("--megabytes", type=float, nargs="+", default=[6.1, 2.0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shims = tmp / "stand_ins"
        shims.mkdir()
        for name, text in STAND_INS.items():
            module = name.removesuffix(".py")
            found = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=args.nvidia_dir,
                                   capture_output=True).returncode == 0
            if not found:
                (shims / name).write_text(text)
        env = {**os.environ, "PYTHONPATH": f"{args.nvidia_dir}:{shims}"}
        for megabytes in args.megabytes:
            text = sentence_per_line(tmp / f"text_{megabytes:g}mb.txt", megabytes)
            size = text.stat().st_size / 1e6
            tools = {
                "nvidia create_pretraining_data.py": [
                    sys.executable, str(args.nvidia_dir / "create_pretraining_data.py"), "--vocab_file", str(VOCAB),
                    "--input_file", str(text), "--output_file", str(tmp / "nvidia.hdf5"), "--max_seq_length", "128",
                    "--dupe_factor", "5", "--max_predictions_per_seq", "20", "--masked_lm_prob", "0.15",
                    "--short_seq_prob", "0.1", "--do_lower_case"],
                "bert-data-prep shards, 1 worker": [
                    sys.executable, "-m", "data_prep", "shards", "--input", str(text), "--vocab", str(VOCAB),
                    "--output", str(tmp / "ours"), "--seq-len", "128", "--dupe-factor", "5", "--max-predictions", "20",
                    "--masking", "static", "--num-shards", "1", "--val-fraction", "0", "--workers", "1"],
            }
            for name, cmd in tools.items():
                runs = []
                for _ in range(args.repeats):
                    subprocess.run(["rm", "-rf", str(tmp / "ours"), str(tmp / "nvidia.hdf5")], check=True)
                    runs.append(timed(cmd, REPO if "data_prep" in cmd else args.nvidia_dir, env))
                wall = statistics.median(w for w, _ in runs)
                rows.append({"tool": name, "text_mb": size, "wall_s": wall, "mb_per_s": size / wall,
                             "peak_rss_mb": max(r for _, r in runs), "runs": [w for w, _ in runs]})
                print(f"{name:36} {size:5.1f} MB  {wall:7.2f} s  {size / wall:5.2f} MB/s  "
                      f"peak RSS {rows[-1]['peak_rss_mb']:.0f} MB", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                                                    f"Python {platform.python_version()}",
                                         "command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
