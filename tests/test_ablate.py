"""bert-ablate end to end: a --vary grid of the tiny model on 2 CPU ranks through DeepSpeed's
launcher, interrupted and resumed by running the same command again; a failing variant."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, rows

from commodity_bert.ablate import grid
from commodity_bert.ablate.cli import hold_lock
from commodity_bert.ablate.cli import main as ablate_main

BERT_ABLATE = [sys.executable, "-m", "commodity_bert.ablate"]
TINY = REPO / "ds_configs" / "cpu_tiny_lamb.json"
LRS = ("0.02", "0.005", "0.001")


def grid_command(data, out):
    # 12 steps of 64 samples; a checkpoint every 2 steps, so that an interruption has one to resume.
    # The ranks agree on a stop one step after the signal (bookkeeping.py), and the signal travels
    # bert-ablate → bert-launch → ranks: with 6 steps it once landed after the run's last step
    return [*BERT_ABLATE, "--base", str(TINY), "--vary", f"optimizer.params.lr={','.join(LRS)}",
            "--data", str(data), "--model", "tiny", "--ranks", "2", "--samples", "768", "--eval-every", "3",
            "--log-every", "2", "--target", "0.02", "--train-args", "--num-workers 1 --save-every 2",
            "--out", str(out)]


@pytest.fixture(scope="module")
def interrupted_then_resumed(tmp_path_factory, train_data):
    """The grid started, stopped (SIGINT, as Ctrl-C) while its second variant trains, then the
    same command run again to the end."""
    out = tmp_path_factory.mktemp("ablation") / "ABL"
    cmd = grid_command(train_data, out)
    first_log = out.parent / "first.log"
    with open(first_log, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        second = out / "runs" / f"cpu_tiny_lamb__lr={LRS[1]}" / "seed_1"
        deadline = time.time() + 240
        while not any((second / "checkpoints").glob("step_*")) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        first_code = proc.wait(timeout=240)
    second_run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    return {"out": out, "first_code": first_code, "first_log": first_log.read_text(), "second": second_run}


def test_interrupted_ablation_resumes_by_running_the_command_again(interrupted_then_resumed):
    r = interrupted_then_resumed
    out, second = r["out"], r["second"]
    assert r["first_code"] == 130, r["first_log"]
    assert f"cpu_tiny_lamb__lr={LRS[2]} seed 1" not in r["first_log"], r["first_log"]  # stopped before the third
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"cpu_tiny_lamb__lr={LRS[0]} seed 1: finished earlier, kept" in second.stdout
    assert f"cpu_tiny_lamb__lr={LRS[1]} seed 1: resuming from its checkpoint" in second.stdout
    log = (out / "runs" / f"cpu_tiny_lamb__lr={LRS[1]}" / "seed_1" / "train.log").read_text()
    assert "resuming from" in log and "at step" in log
    # the first variant was not trained again: one launch in its log
    first_log = (out / "runs" / f"cpu_tiny_lamb__lr={LRS[0]}" / "seed_1" / "train.log").read_text()
    assert first_log.count("\n$ ") == 1


def test_vary_grid_reports_its_runs_own_numbers(interrupted_then_resumed):
    out = interrupted_then_resumed["out"]
    results = json.loads((out / "results.json").read_text())
    assert [r["variant"] for r in results] == [f"cpu_tiny_lamb__lr={lr}" for lr in LRS]
    table = (out / "results.md").read_text()
    for lr, r in zip(LRS, results):
        run = Path(r["run_dir"])
        config = json.loads(Path(r["config"]).read_text())
        # the varied value, and DeepSpeed's scheduler, which sets the lr, follows it
        assert config["optimizer"]["params"]["lr"] == float(lr)
        assert config["scheduler"]["params"]["warmup_max_lr"] == float(lr)
        assert config["scheduler"]["params"]["total_num_steps"] == 12  # the schedule fits the budget
        summary = json.loads((run / "summary.json").read_text())
        metrics = rows(run)
        evals = [m["val_mlm_acc"] for m in metrics if "val_mlm_acc" in m]
        assert r["status"] == "finished" and r["seed"] == 1
        assert r["samples"] == summary["samples"] == 768
        assert r["final_val_mlm_acc"] == summary["val_mlm_acc"]
        assert r["best_val_mlm_acc"] == max(evals)
        logged = [m for m in metrics if "loss" in m]
        assert r["total_bytes"] == pytest.approx(sum(m["bytes_sent"] * (m["step"] - p["step"])
                                                     for p, m in zip([{"step": 0}] + logged, logged)))
        assert r["total_bytes"] > 0 and r["bytes_per_step"] == pytest.approx(r["total_bytes"] / 12)
        assert r["total_bytes_received"] == pytest.approx(r["total_bytes"])  # 2 ranks, a ring: both ways alike
        assert r["seq_per_s"] > 0 and r["train_s"] > 0
        if r["samples_to_target"] is not None:
            first = next(m for m in metrics if m.get("val_mlm_acc", -1) >= 0.02)
            assert r["samples_to_target"] == first["samples"]
        assert f"{100 * r['final_val_mlm_acc']:.2f}" in table
        assert f"`{r['variant']}`" in table
    # three learning rates train three different models
    assert len({r["final_loss"] for r in results}) == 3
    commands = (out / "commands.sh").read_text().splitlines()
    assert sum("train.py" in c and "--deepspeed_config" in c for c in commands) == 3
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert not (out / "bytes.png").exists()  # the same bytes for every variant: no bytes plot


def test_a_failing_variant_is_recorded_and_the_others_finish(tmp_path, train_data):
    """...and the finished one is fine-tuned downstream (--downstream) on a task of two families,
    each score in both reports and in the card's model-index with its own task type."""
    out = tmp_path / "ABL"
    proc = subprocess.run([*BERT_ABLATE, "--base", str(TINY), "--vary", "optimizer.type=Nonesuch,Lamb",
                           "--data", str(train_data), "--model", "tiny", "--ranks", "1", "--samples", "128",
                           "--train-args", "--num-workers 1", "--out", str(out), "--downstream", "embedded:party",
                           "embedded:entities", "--downstream-args", ("--seeds 1 --lr 1e-3 --epochs 1 --min-steps 0 --max-seq-len 32 "
                                                 "--batch-size 64 --threads 1")],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    results = {r["variant"]: r for r in json.loads((out / "results.json").read_text())}
    bad, good = results["cpu_tiny_lamb__type=Nonesuch"], results["cpu_tiny_lamb__type=Lamb"]
    assert bad["status"] == "failed"
    assert "train.py: error:" in bad["error"] and "Nonesuch" in bad["error"]
    assert good["status"] == "finished" and good["final_val_mlm_acc"] is not None
    assert "Nonesuch" in (out / "results.md").read_text()
    probe = json.loads((Path(good["run_dir"]) / "downstream.json").read_text())
    assert probe["task"] == "embedded:party" and probe["lr"] == 1e-3 and len(probe["per_seed"]) == 1
    assert good["downstream"]["median"] == probe["median"] and "downstream" not in bad
    assert good["downstream"]["bag_of_words"] == probe["bag_of_words"]["value"] > 0.5
    assert good["downstream"]["linear_probe"] == probe["linear_probe"]["pretrained"]["value"] > 0.5
    table = (out / "results.md").read_text()
    assert "downstream" in table and f"{100 * probe['median']:.2f}" in table and "bag of words" in table
    assert f"linear probe {100 * probe['linear_probe']['pretrained']['value']:.2f}" in table
    card = (Path(good["run_dir"]) / "hf_model" / "README.md").read_text()  # rewritten with the fine-tuning row
    assert f"| embedded:party | classification | final | {probe['metric']} | {100 * probe['median']:.1f}% |" in card
    assert f"value: {round(probe['median'], 4)}" in card                 # and in the Hub's metadata
    tagged = json.loads((Path(good["run_dir"]) / "downstream" / "embedded_entities.json").read_text())
    assert good["downstream_tasks"]["embedded:entities"] == {k: tagged[k] for k in ("family", "metric", "median",
                                                                                     "min", "max")}
    assert tagged["family"] == "tagging" and f"embedded:entities f1 {100 * tagged['median']:.2f}" in table
    assert f"| embedded:entities | tagging | final | f1 | {100 * tagged['median']:.1f}% |" in card
    assert "type: token-classification" in card and card.count("| embedded:party |") == 1


def test_grid_and_bad_input(tmp_path, train_data, capsys):
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8,
                                "optimizer": {"type": "Lamb", "params": {"lr": 0.01, "betas": [0.9, 0.999]}},
                                "scheduler": {"type": "WarmupDecayLR",
                                              "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 10,
                                                         "total_num_steps": 100}}}))
    variants = grid.from_vary(base, ["optimizer.params.betas=[0.9,0.98],[0.8,0.99]",
                                     "commodity_bert.bucketwise_clipping.enabled=true,false"])
    assert [v.changes for v in variants] == [
        {"optimizer.params.betas": b, "commodity_bert.bucketwise_clipping.enabled": e}
        for b in ([0.9, 0.98], [0.8, 0.99]) for e in (True, False)]
    assert variants[0].config["commodity_bert"]["bucketwise_clipping"]["enabled"] is True
    removed = grid.from_vary(base, ["scheduler=null"])[0].config
    assert "scheduler" not in removed
    fitted = grid.fit_to_budget(variants[0].config, 50)["scheduler"]["params"]
    assert fitted["total_num_steps"] == 50 and fitted["warmup_num_steps"] == 5

    def refused(*argv):
        with pytest.raises(SystemExit) as exit_:
            ablate_main([*map(str, argv)])
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("bert-ablate: error:"), err
        return err

    common = ["--data", train_data, "--model", "tiny", "--samples", 64, "--out", tmp_path / "ABL", "--dry-run"]
    assert "KEY=V1,V2" in refused("--base", base, "--vary", "optimizer.params.lr", *common)
    assert "either" in refused(*common)
    assert "not found" in refused("--configs", tmp_path / "missing.json", *common)
    assert "manifest" in refused("--base", base, "--vary", "optimizer.params.lr=1,2", "--data", tmp_path, "--model",
                                 "tiny", "--samples", 64, "--out", tmp_path / "ABL")
    # an ABL directory compares runs made alike; a changed variant is not mixed in
    ablate_main(["--base", str(base), "--vary", "optimizer.params.lr=0.1", *map(str, common)])
    assert "samples" in refused("--base", base, "--vary", "optimizer.params.lr=0.1", *common[:4], "--samples", 128,
                                *common[6:])
    changed = json.loads(base.read_text())
    changed["train_micro_batch_size_per_gpu"] = 4
    base.write_text(json.dumps(changed))
    assert "differs" in refused("--base", base, "--vary", "optimizer.params.lr=0.1", *common)
    assert (tmp_path / "ABL" / "commands.sh").exists()
    held = hold_lock(tmp_path / "ABL")  # as a running bert-ablate holds it
    assert "another bert-ablate" in refused("--base", base, "--vary", "optimizer.params.lr=0.1", *common)
    held.close()
