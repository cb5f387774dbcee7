"""The throughput benchmark runs end to end on real shards and accounts for padding correctly."""
import json
import subprocess
import sys

import numpy as np
from conftest import REPO, run_cli

from commodity_bert.data import shard_format as fmt


def test_throughput_benchmark_counts_padding_and_reports_both_paths(tmp_path, sotu_small):
    # most samples aim at a random shorter length, so batches carry some padding
    train_data = tmp_path / "short"
    run_cli("shards", "--input", sotu_small, "--seq-len", 64, "--dupe-factor", 1, "--num-shards", 1,
            "--short-seq-prob", 0.9, "--output", train_data)
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "benchmarks/throughput.py", "--device", "cpu", "--model", "tiny",
                           "--data", str(train_data), "--micro-batch", "32", "--steps", "2", "--repeats", "1",
                           "--paths", "padded_baseline", "padded_sparse_head", "project",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["path"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"padded_baseline", "padded_sparse_head", "project"}
    for row in rows.values():
        assert row["seq_per_s"] > 0 and 0 < row["mfu"] < 1 and row["peak_tflops"] > 0
    # the baseline computes every padded position: its ratio is seq_len / mean real length
    lengths = np.concatenate([fmt.read_shard(p)["lengths"] for p in fmt.shard_paths(
        train_data, fmt.load_manifest(train_data), "train")])
    # (stratified batches: every batch has the data set's mix of lengths)
    assert rows["padded_baseline"]["computed_over_real"] > 1.0
    assert abs(rows["padded_baseline"]["computed_over_real"] - 64 / lengths.mean()) < 0.05
    assert rows["padded_sparse_head"]["computed_over_real"] == rows["padded_baseline"]["computed_over_real"]
    assert rows["padded_sparse_head"]["executed_tflops"] / rows["padded_sparse_head"]["tflops"] < \
        rows["padded_baseline"]["executed_tflops"] / rows["padded_baseline"]["tflops"]  # no head on unmasked tokens
    assert rows["project"]["computed_over_real"] == 1.0
    # same samples: same real tokens per sequence for every path
    per_seq = [r["tokens_per_s"] / r["seq_per_s"] for r in rows.values()]
    assert max(per_seq) - min(per_seq) < 1e-6 * per_seq[0]

    # the sparse-head baseline computes HF's loss: the same number from the same weights and batch
    sys.path.insert(0, str(REPO / "benchmarks"))
    import torch
    from throughput import PaddedSparseHead, padded_batch, padded_sparse_batch, project_batches

    from commodity_bert.model.bert import build_config, build_model
    manifest = fmt.load_manifest(train_data)
    batch = project_batches(train_data, 8, 1)[0]
    torch.manual_seed(0)
    hf = type(build_model(build_config("tiny", manifest["vocab"]["size"]), nsp=manifest["nsp"]))._from_config(
        build_config("tiny", manifest["vocab"]["size"]), attn_implementation="sdpa").eval()
    dense = hf(**padded_batch(batch, 64, manifest["nsp"])).loss
    sparse = PaddedSparseHead(hf)(**padded_sparse_batch(batch, 64, manifest["nsp"]))
    assert torch.allclose(dense, sparse, atol=1e-5), (dense, sparse)


def test_trainer_comparison_scores_both_sides_on_one_clock(tmp_path, sotu_small):
    """12 s a side at micro-batch 8: each side's clock includes its start (the Trainer's first step
    ended at 9.6 s at micro-batch 32 on a 2-core AMD EPYC without AVX-512, past a 6-s budget)."""
    out, budget_s = tmp_path / "result.json", 12
    proc = subprocess.run([sys.executable, "benchmarks/vs_hf_trainer.py", "--model", "tiny", "--input", sotu_small,
                           "--minutes", str(budget_s / 60), "--micro-batch", "8", "--eval-every-s", "2",
                           "--project-eval-every", "2",
                           "--warmup-steps", "2", "--work", str(tmp_path / "work"), "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for side in ("hf_trainer", "project"):
        curve = result[side]
        assert len(curve) >= 2, side
        # evaluation time is left out of each side's clock, which never runs past the budget by much
        times = [r["elapsed_s"] for r in curve]
        assert times == sorted(times) and times[-1] < budget_s + 20, (side, times)
        assert all(0 <= r["val_mlm_acc"] <= 1 for r in curve)
    assert result["target"] == result["hf_trainer"][-1]["val_mlm_acc"]
    first_reaching = next((r for r in result["project"] if r["val_mlm_acc"] >= result["target"]), None)
    assert result["project_reached_at_s"] == (first_reaching["elapsed_s"] if first_reaching else None)


def test_equal_tokens_gives_both_sides_one_recipe_and_the_trainer_stops_at_its_step_budget(tmp_path, sotu_small):
    """--sequences N: train.py takes N / micro-batch steps with ds_configs/cpu_mini_adamw_bf16.json's
    AdamW, its schedule spanning exactly those steps, and the Trainer side is set to the same
    rate, beta2, epsilon, steps and linear schedule; it stops at that step budget, not the clock,
    and keeps a model that loads."""
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "benchmarks/vs_hf_trainer.py", "--model", "tiny", "--input", sotu_small,
                           "--sequences", "64", "--micro-batch", "8", "--project-eval-every", "8",
                           "--eval-every-s", "600", "--work", str(tmp_path / "work"), "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["project"][-1]["step"] == 8
    recipe = json.loads((REPO / "ds_configs" / "cpu_mini_adamw_bf16.json").read_text())
    config = json.loads((tmp_path / "work" / "project" / "ds_config.json").read_text())
    assert config["optimizer"] == recipe["optimizer"]
    assert config["scheduler"]["params"]["total_num_steps"] == 8 and config["scheduler"]["params"]["warmup_num_steps"] == 1
    args = result["args"]
    params = recipe["optimizer"]["params"]
    assert (args["hf_lr"], args["hf_beta2"], args["hf_eps"], args["hf_steps"], args["hf_schedule"]) == (
        params["lr"], params["betas"][1], params["eps"], 8, "linear")
    assert [r["step"] for r in result["hf_trainer"]] == [8]  # the budget; its clock would allow more evaluations
    final = tmp_path / "work" / "snapshots" / "hf_trainer_final"
    assert json.loads((final / "pretraining.json").read_text())["step"] == 8
    from transformers import BertForMaskedLM
    assert BertForMaskedLM.from_pretrained(final).config.hidden_size == 128


def test_a_decaying_trainer_schedule_without_a_step_budget_is_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/vs_hf_trainer.py", "--sides", "hf_trainer", "--hf-schedule",
                           "linear", "--work", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode != 0 and "need --hf-steps" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "work").exists()  # refused before any data was made
