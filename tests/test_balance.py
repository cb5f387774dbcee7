"""Ranks of unequal speed (data/deal.py, train/balance.py): the deal's arithmetic, its refusals, and
two fp32 runs on 2 forked ranks, dropout off, that train the same steps: the equal split, and
the same micro-batches dealt by speeds measured while rank 1 is slowed 3× (so it is re-dealt).
The loader's side (the same micro-batches a step whatever the deal) is in test_data.py; each
mode on unequal shares, with its relaunch bit for bit, in MODE_CASES (conftest.py)."""
import json
import re

import pytest
import torch
from conftest import checked, config_file, rows, side_by_side
from safetensors.torch import load_file

from commodity_bert.data.deal import Deal, DealError, counts_for_speeds
from commodity_bert.run_config import RunConfig
from commodity_bert.train.balance import SLOW_RANKS_ENV, slow_ranks


def test_counts_follow_speed_within_what_fits():
    assert counts_for_speeds([1, 1, 1, 0.5], 7) == [8, 8, 8, 4]  # the ideal 1.75x of the example
    assert Deal.from_speeds([1, 1, 1, 0.5], 7).step_time([1, 1, 1, 0.5]) == 8
    assert Deal.equal(4, 7).step_time([1, 1, 1, 0.5]) == 14
    assert counts_for_speeds([1, 100], 2) == [1, 3]  # every rank keeps one: it joins the exchange
    assert counts_for_speeds([1, 3], 4, caps=[8, 5]) == [3, 5]  # the fast card fits only 5
    with pytest.raises(DealError, match="below the step's 8"):
        counts_for_speeds([1, 3], 4, caps=[3, 4])


def test_every_rank_ends_its_step_on_its_own_last_micro_batch():
    """Rank r's last micro-batch of a step is unit r's last (data/deal.py): its loader then stands
    at the step's end, where a checkpoint records it."""
    for speeds in ([1, 2, 0.5], [3, 1, 1, 1], [1, 1, 1, 0.5]):
        deal = Deal.from_speeds(speeds, 4)
        assert deal.counts() == counts_for_speeds(speeds, 4)
        for rank in range(len(speeds)):
            assert deal.owners[rank][-1] == rank
            assert deal.taken(rank)[-1][0] == rank
    assert Deal.from_counts([4, 4], 4) == Deal.equal(2, 4) and Deal.equal(2, 4).is_equal()


def test_balance_settings_are_checked():
    def problem(balance, stage=0):
        return RunConfig.parse({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": stage},
                                "commodity_bert": {"balance": balance}}).problems()
    assert problem({"split": "speed"}) is None
    assert "ZeRO stage 2" in problem({"split": "speed"}, stage=2)
    assert problem({"split": "speed"}, stage=1) is None
    unmanaged = RunConfig.parse({"train_micro_batch_size_per_gpu": 8, "managed_gradient_accumulation": False,
                                 "commodity_bert": {"balance": {"split": "speed"}}}).problems()
    assert 'drop "managed_gradient_accumulation": false' in unmanaged
    assert "give one number above 0 per rank" in problem({"split": "speed", "speeds": [1, 0]})
    assert 'give "equal" or "speed"' in problem({"split": "fast"})
    assert slow_ranks("0:1.5,1:2:5-9", 1) == (2.0, 5, 9) and slow_ranks("1:2", 0) == (1.0, 0, None)


def test_a_balanced_step_is_the_equal_splits_step(tmp_path, train_data, monkeypatch):
    """fp32, dropout off, micro-batch 8 × accumulation 4 on 2 ranks, side by side: the equal split,
    and the deal measured after each step with rank 1 slowed 3×. The deal follows the slow-down (rank 1's
    share falls), and every step is the equal split's: losses and gradient norms alike, weights
    within 1e-6."""
    common = {"bf16.enabled": False, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,
              "commodity_bert.pretraining.dropout": 0.0}
    equal = config_file(tmp_path, "cpu_tiny_lamb.json", **common)
    measured = config_file(tmp_path, "cpu_tiny_lamb.json", **common, **{
        "commodity_bert.balance": {"split": "speed", "measure_steps": 1, "redeal_gain": 0.0}})
    args = ["--model", "tiny", "--data", train_data, "--max-steps", 3, "--log-every", 1, "--num-workers", 0,
            "--eval-batches", 1]
    monkeypatch.setenv(SLOW_RANKS_ENV, "1:3")  # both runs' rank 1: it slows the equal split's steps, not its sums
    _, run = map(checked, side_by_side([["--deepspeed_config", equal, *args, "--output-dir", tmp_path / "equal"],
                                        ["--deepspeed_config", measured, *args, "--output-dir", tmp_path / "balanced"]]))
    # 3× slower, read beside the other test worker's ranks on shared cores: fewer than half
    first = re.search(r"balance at step 1: micro-batches a step per rank \[(\d), (\d)\] of 8", run.stdout)
    assert first and int(first[2]) < 4, run.stdout[-3000:]
    plain, dealt = rows(tmp_path / "equal"), rows(tmp_path / "balanced")
    shares = [r["rank_share"] for r in dealt if "loss" in r]
    assert shares[0] == [0.5, 0.5] and all(share[1] < 0.5 for share in shares[1:]), shares
    for a, b in zip(plain, dealt):
        if "loss" in a:
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    weights = [load_file(tmp_path / name / "hf_model" / "model.safetensors") for name in ("equal", "balanced")]
    for name, value in weights[0].items():
        assert torch.linalg.vector_norm(weights[1][name] - value) <= 1e-6 * torch.linalg.vector_norm(value) + 1e-9, name
    summary = json.loads((tmp_path / "balanced" / "summary.json").read_text())
    assert summary["params_identical_across_ranks"] is True
