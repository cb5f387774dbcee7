"""recipes/domain.sh, the domain BERT from scratch, end to end on a small corpus: the task's training
texts joined to the text, a vocabulary and shards of them, a schedule sized to the time budget by
a timing run of the same job, the run, and the judgement beside random init; a corpus holding
a dev sentence of the task refused before anything is built."""
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, first_documents, free_port

from commodity_bert.finetune import tasks

VENV = str(Path(sys.executable).parent.parent)


def domain(out: Path, text: Path, **env) -> subprocess.CompletedProcess:
    settings = {"VENV": VENV, "OUT": str(out), "TEXT": str(text), "TASK": "embedded:polarity", "MODEL": "tiny",
                "VOCAB_SIZE": "2000", "SEQ_LEN": "64", "BATCH": "16", "TIMING_STEPS": "12", "CHECKPOINTS": "2",
                "FINETUNE_ARGS": "--lr 1e-3 --seeds 1 --train-examples 100 --epochs 1 --min-steps 0 "
                                 "--max-seq-len 64 --threads 1", "MASTER_PORT": str(free_port()), **env}
    return subprocess.run(["bash", str(REPO / "recipes" / "domain.sh")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **settings})


def test_the_domain_path_builds_sizes_trains_and_judges(tmp_path, sotu_text):
    text = tmp_path / "domain.txt"
    text.write_text(first_documents(sotu_text, 200_000))
    done = domain(tmp_path / "out", text, TIME_BUDGET="15s")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    manifest = json.loads((out / "shards" / "manifest.json").read_text())
    inputs = json.dumps(manifest)
    assert "domain.txt" in inputs and "task_train.txt" in inputs  # the task's training texts joined the corpus
    assert "check-text: none of embedded:polarity's 964 dev texts in" in done.stdout  # and no dev text did
    config = json.loads((out / "ds_config.json").read_text())["scheduler"]["params"]
    steps = config["total_num_steps"]
    assert config["warmup_num_steps"] == max(1, round(steps / 10)) and steps >= 5
    assert f"{steps} steps sized to 15s" in done.stdout
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    # the sized schedule fits the budget: at 15 s the start-up and the two evaluations are a larger
    # share than the reserve allows for, so most of it rather than all
    assert 0.7 * steps <= max(r["step"] for r in rows) <= steps
    result = json.loads((out / "downstream.json").read_text())
    assert result["task"] == "embedded:polarity" and result["random_init"]["per_seed"]
    assert result["train_size"] == 100 and not (out / "timing").exists()
    # the same OUT with another vocabulary would be another run: refused, the run as it was
    kept = sorted((p, p.stat().st_mtime_ns) for p in out.rglob("*"))
    refused = domain(out, text, VOCAB=str(REPO / "data_prep" / "resources" / "bert_base_uncased_vocab.txt"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "another vocabulary than VOCAB=" in refused.stderr
    assert sorted((p, p.stat().st_mtime_ns) for p in out.rglob("*")) == kept


def test_a_corpus_with_a_dev_sentence_is_refused_before_anything_is_built(tmp_path):
    dev = tasks.embedded_polarity().dev.texts
    long_one = next(t for t in dev if len(t.split()) >= 12)
    text = tmp_path / "reviews.txt"
    text.write_text("A review.\n\nI saw it twice. " + long_one.upper() + "  Then I left.\n\nHorrible.\n")
    refused = domain(tmp_path / "out", text, TASK_TEXT="0")
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "1 dev text(s) of embedded:polarity" in lines[0] and long_one[:40] in lines[0], lines
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []
