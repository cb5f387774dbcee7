"""train.py's plateau warning on real runs through DeepSpeed's launcher: one forced onto the
unigram plateau (a learning rate of 1e-9 cannot move the model) and one that learns (the
session's healthy_run: the quickstart's recipe for 400 steps), 2 ranks each."""
import json

import numpy as np
from conftest import CPU_CONFIG, rows, train

from commodity_bert.data import shard_format as fmt


def unigram_by_hand(data_dir):
    manifest = fmt.load_manifest(data_dir)
    labels = np.concatenate([s["masked_lm_ids"][s["masked_lm_positions"] > 0] for s in
                             (fmt.read_shard(p) for p in fmt.shard_paths(data_dir, manifest, "validation"))])
    counts = np.bincount(labels.astype(np.int64))
    return counts.max() / counts.sum()


def config_with_lr(tmp_path, lr, warmup, total):
    config = json.loads(CPU_CONFIG.read_text())
    config["optimizer"]["params"]["lr"] = lr
    config["scheduler"]["params"].update({"warmup_max_lr": lr, "warmup_num_steps": warmup, "total_num_steps": total})
    path = tmp_path / f"lr_{lr:g}.json"
    path.write_text(json.dumps(config))
    return path


def test_plateau_warning_fires_on_a_stuck_run(tmp_path, train_data):
    common = ["--data", train_data, "--model", "tiny", "--num-workers", 1, "--log-every", 10]
    stuck = tmp_path / "stuck"
    proc = train(2, "--deepspeed_config", config_with_lr(tmp_path, 1e-9, 2, 8), *common, "--output-dir", stuck,
                 "--max-steps", 8, "--eval-every", 2, "--plateau-check-samples", 200)
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning: still on the unigram plateau")]
    # once, at the first evaluation after 200 samples (64 a step: step 4) and the warm-up (2 steps)
    assert len(warnings) == 1 and "after 256 samples (step 4)" in warnings[0], proc.stdout[-3000:]
    assert "lr too large for the batch" in warnings[0] and "vocabulary" in warnings[0]
    evals = [r for r in rows(stuck) if "val_mlm_acc" in r]
    expected = unigram_by_hand(train_data)
    assert all(abs(r["unigram_acc"] - expected) < 1e-9 for r in evals)  # both ranks' halves, summed
    assert [r.get("on_plateau") for r in evals] == [None, True, True, True]
    assert json.loads((stuck / "summary.json").read_text())["on_plateau"] is True



def test_no_plateau_warning_on_a_run_that_learns(healthy_run):
    assert "warning: still on the unigram plateau" not in (healthy_run / "stdout.log").read_text()
    final = [r for r in rows(healthy_run) if "val_mlm_acc" in r][-1]
    assert final["step"] == 400 and final["on_plateau"] is False
    assert final["val_mlm_acc"] >= 1.5 * final["unigram_acc"]
    assert json.loads((healthy_run / "summary.json").read_text())["on_plateau"] is False
