"""bert-plan: the step-time model's arithmetic by hand, the estimate CLI, and preflight on 2
local ranks and on the namespace cluster with one slowed link."""
import json
import subprocess
import sys

import pytest
from conftest import DEEPSPEED, REPO, free_port, refusal

from commodity_bert.plan.step_model import (
    GBIT,
    Network,
    PlanError,
    Workload,
    micro_batches_s,
    onebit_bytes_per_element,
    parse_rate,
    phase_estimate,
    recipe_rows,
    ring_allreduce_bytes,
    step_estimate,
    step_sequence,
)

ROW_KEYS = {"optimizer", "nodes", "gpus", "step_s", "compute_s", "comm_s", "seq_per_s", "efficiency", "days", "usd"}


def plan(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "commodity_bert.plan", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def work(**overrides) -> Workload:
    fields = dict(name="w", params=100_000_000, global_batch=64, micro_batch=4, steps=10, grad_bytes=2,
                  fb_s=0.5, optimizer_s=0.1, bucket_bytes=100_000_000)
    return Workload(**{**fields, **overrides})


TEN_GBIT = Network(link_bytes_per_s=1.25e9, latency_s=0.0)
ZERO_ONE_12_4_4_4 = dict(var_freeze_step=12, var_update_scaler=4, local_step_scaler=4, local_step_clipper=4)


def test_rates_and_volumes_by_hand():
    assert parse_rate("10gbit") == 1.25e9
    assert parse_rate("100mbit") == 12.5e6
    assert parse_rate("2.5Gbit/s") == 2.5e9 / 8
    with pytest.raises(PlanError, match="like 1gbit"):
        parse_rate("fast")
    assert ring_allreduce_bytes(100, 4) == 150
    assert ring_allreduce_bytes(100, 1) == 0
    assert onebit_bytes_per_element(256) == 1 / 8 + 4 / 256
    # 1 GB over 4 nodes at 10 Gbit/s, 1 ms a hop: 2·3/4·1e9 / 1.25e9 + 6 hops
    assert Network(1.25e9, latency_s=1e-3).allreduce_s(1e9, 4, 1) == pytest.approx(1.2 + 0.006)
    # 2 nodes of 2 GPUs: within the node at 200 Gbit/s (25 GB/s, 10 µs a hop), then across
    assert Network(1.25e9, latency_s=1e-3).allreduce_s(1e9, 2, 2) == pytest.approx(
        (1e9 / 25e9 + 2 * 10e-6) + (1e9 / 1.25e9 + 2 * 1e-3))


def test_step_estimates_by_hand():
    w = work()
    # 64 sequences over 4 GPUs of micro-batch 4: 4 micro-batches → 4 × 0.5 + 0.1
    lamb = step_estimate(w, "lamb", "full", 4, 1, TEN_GBIT)
    assert lamb.compute_s == pytest.approx(2.1)
    assert lamb.comm_s == pytest.approx(1.5 * 2e8 / 1.25e9)  # fp16 gradients, 2e8 bytes
    assert lamb.step_s == pytest.approx(2.1 + 0.24)
    assert lamb.bytes_per_rank == pytest.approx(3e8)

    onebit = step_estimate(work(compress_s=0.05), "onebit_lamb", "compressed", 4, 1, TEN_GBIT)
    assert onebit.bytes_per_rank == pytest.approx(1.5 * 1e8 * 0.140625)
    assert onebit.comm_s == pytest.approx(1.5 * 1e8 * 0.140625 / 1.25e9)
    assert onebit.compute_s == pytest.approx(2.15)
    assert onebit.rounds == 4

    # fp32 buckets of 1e8 bytes: 4 of them, 0.12 s each; 3/4 of the backward (2/3 of 0.5 s) hides comm
    bucketwise = step_estimate(w, "bucketwise", "full", 4, 1, TEN_GBIT)
    assert bucketwise.comm_total_s == pytest.approx(0.48)
    assert bucketwise.comm_s == pytest.approx(0.48 - 0.25)
    slow_backward = step_estimate(work(fb_s=2.0), "bucketwise", "full", 4, 1, TEN_GBIT)
    assert slow_backward.comm_s == pytest.approx(0.12)  # all hidden but the last bucket

    one_gpu = step_estimate(w, "lamb", "full", 1, 1, TEN_GBIT)
    assert (one_gpu.compute_s, one_gpu.comm_s) == (pytest.approx(16 * 0.5 + 0.1), 0.0)


def test_zero_one_adam_and_diloco_steps_by_hand():
    latency = Network(link_bytes_per_s=1.25e9, latency_s=0.01)
    w = work(compress_s=0.05, wrapped=True, schedule=ZERO_ONE_12_4_4_4, inner_steps=10)
    onebit_s = 1.5 * 1e8 * 0.140625 / 1.25e9 + 4 * 3 * 0.01  # 4 collectives of 3 hops each
    flag_s = 1.5 * 1 / 1.25e9 + 6 * 0.01  # the bf16/fp16 wrapper's overflow flag: a ring's 6 hops
    onebit = step_estimate(w, "zero_one_adam", "onebit", 4, 1, latency)
    assert (onebit.comm_s, onebit.rounds) == (pytest.approx(onebit_s + flag_s), 5)
    assert onebit.bytes_per_rank == pytest.approx(1.5 * 1e8 * 0.140625 + 1.5)
    local = step_estimate(w, "zero_one_adam", "local", 4, 1, latency)  # each rank skips its own overflows
    assert (local.compute_s, local.comm_s, local.rounds, local.bytes_per_rank) == (pytest.approx(2.1), 0.0, 0, 0.0)
    sync = step_estimate(w, "zero_one_adam", "sync", 4, 1, latency)
    assert (sync.compute_s, sync.comm_s, sync.rounds) == (pytest.approx(2.15), pytest.approx(onebit_s), 4)
    fp16_sync = step_estimate(work(compress_s=0.05, wrapped=True, loss_scaled=True, schedule=ZERO_ONE_12_4_4_4),
                              "zero_one_adam", "sync", 4, 1, latency)  # and the ranks agree on the loss scale
    assert (fp16_sync.comm_s, fp16_sync.rounds) == (pytest.approx(onebit_s + 1.5 * 16 / 1.25e9 + 6 * 0.01), 5)
    fp32_local = step_estimate(work(schedule=ZERO_ONE_12_4_4_4), "zero_one_adam", "local", 4, 1, latency)
    assert (fp32_local.comm_s, fp32_local.rounds, fp32_local.bytes_per_rank) == (0.0, 0, 0.0)
    full = step_estimate(w, "zero_one_adam", "full", 4, 1, latency)
    assert full.comm_s == pytest.approx(0.24 + 6 * 0.01) and full.rounds == 1

    # 28 steps of test_zero_one_adam's schedule: 8 variance steps, 4 1-bit, 8 syncs, 8 local
    phase = phase_estimate(work(steps=28, schedule=ZERO_ONE_12_4_4_4), "zero_one_adam", 4, 1, latency)
    assert {k: v["steps"] for k, v in phase["stages"].items()} == {"full": 8, "onebit": 4, "sync": 8, "local": 8}

    inner = step_estimate(w, "diloco", "inner", 4, 1, latency)  # no_sync: not even the flag
    assert (inner.compute_s, inner.comm_s, inner.rounds) == (pytest.approx(2.1), 0.0, 0)
    for compression, size, rounds in (("none", 4e8, 1), ("bf16", 2e8, 1), ("int8", 1e8 * (1 + 4 / 256), 2)):
        outer = step_estimate(work(outer_compression=compression), "diloco", "outer", 4, 1, latency)
        assert outer.bytes_per_rank == pytest.approx(1.5 * size) and outer.rounds == rounds
        assert outer.comm_s == pytest.approx(1.5 * size / 1.25e9 + rounds * 6 * 0.01 / (1 if rounds == 1 else 2))
        assert outer.compute_s == pytest.approx(2.2)  # and the outer update's pass
    # H = 10 over 25 steps: outer steps at 10, 20 and 25 (the last step ends a round too)
    phase = phase_estimate(work(steps=25, inner_steps=10), "diloco", 4, 1, latency)
    assert [(k, v["steps"]) for k, v in phase["stages"].items()] == [("inner", 22), ("outer", 2), ("final", 1)]
    # streamed: 4 fragments of int4 each a quarter of the parameters, every H/4 steps, the exchange
    # behind the next inner step's compute; the last step syncs the whole model, blocking
    streamed = work(outer_compression="int4", fragments=4, overlap_steps=1, inner_steps=8, steps=20)
    quarter = 1e8 / 4 * (0.5 + 4 / 256)
    outer = step_estimate(streamed, "diloco", "outer", 4, 1, latency)
    assert outer.bytes_per_rank == pytest.approx(1.5 * quarter) and outer.rounds == 2
    assert outer.comm_total_s == pytest.approx(1.5 * quarter / 1.25e9 + 2 * 3 * 0.01) and outer.comm_s == 0.0
    final = step_estimate(streamed, "diloco", "final", 4, 1, latency)
    assert final.comm_s == pytest.approx(1.5 * 4 * quarter / 1.25e9 + 2 * 3 * 0.01)
    phase = phase_estimate(streamed, "diloco", 4, 1, latency)  # round ends at 2, 4, …, 18, then 20
    assert [(k, v["steps"]) for k, v in phase["stages"].items()] == [("inner", 10), ("outer", 9), ("final", 1)]
    assert step_sequence(streamed, "diloco").count("outer") == 9
    # 5 data-parallel warm-up steps, priced as lamb's, then the rounds count from step 5: round ends
    # at 5 + 2k (k = 1 … 7), then the final step 20; the arithmetic agrees with the step-by-step kinds
    warmed = work(outer_compression="int4", fragments=4, overlap_steps=1, inner_steps=8, steps=20, warmup_steps=5)
    phase = phase_estimate(warmed, "diloco", 4, 1, latency)
    kinds = step_sequence(warmed, "diloco")
    assert [(k, v["steps"]) for k, v in phase["stages"].items()] == [("warmup", 5), ("inner", 7), ("outer", 7),
                                                                       ("final", 1)]
    assert [(k, kinds.count(k)) for k in ("warmup", "inner", "outer", "final")] == [("warmup", 5), ("inner", 7),
                                                                                       ("outer", 7), ("final", 1)]
    assert kinds[:6] == ["warmup"] * 5 + ["inner"] and kinds[6] == "outer"
    assert step_estimate(warmed, "diloco", "warmup", 4, 1, latency) == step_estimate(warmed, "lamb", "full", 4, 1,
                                                                                       latency)
    short = work(inner_steps=8, steps=4, warmup_steps=5)  # ended in its warm-up
    assert [(k, v["steps"]) for k, v in phase_estimate(short, "diloco", 4, 1, latency)["stages"].items()] == [("warmup", 4)]
    # the int4 average's own passes (preflight's lowbit_average_s, whole model): a quarter at each
    # fragment's round end, all of it at the last step, in compute: the overlap hides only the wire
    priced = work(outer_compression="int4", fragments=4, overlap_steps=1, inner_steps=8, steps=20, lowbit_s=0.4)
    assert step_estimate(priced, "diloco", "outer", 4, 1, latency).compute_s == pytest.approx(outer.compute_s + 0.1)
    assert step_estimate(priced, "diloco", "final", 4, 1, latency).compute_s == pytest.approx(final.compute_s + 0.4)


def test_sparse_diloco_by_hand():
    """DiLoCo's sparse Δ (collectives/sparse.py): an all-gather of every rank's fixed-size payload,
    a ring, so a rank sends (and the link carries) W − 1 payloads; the top-k coding once and a
    payload's decoding per rank in compute; in two levels one payload per node between N nodes;
    where the dense int-b exchange sends fewer bytes (many workers) it is priced instead."""
    latency = Network(link_bytes_per_s=1.25e9, latency_s=0.01)
    chunks, k = -(-100_000_000 // 4096), 41  # 1% of 4,096
    payload = chunks * (k * 12 / 8 + k * 2 / 8 + 4)
    sparse = work(outer_compression="sparse", density=0.01, value_bits=2, sparse_encode_s=0.3, sparse_decode_s=0.02)
    outer = step_estimate(sparse, "diloco", "outer", 4, 1, latency)
    assert outer.bytes_per_rank == pytest.approx(3 * payload, rel=1e-6) and outer.rounds == 1
    assert outer.comm_s == pytest.approx(3 * payload / 1.25e9 + 3 * 0.01, rel=1e-6)
    assert outer.compute_s == pytest.approx(2.2 + 0.3 + 4 * 0.02)
    assert payload * 3 < 1e8 * 2 * 0.5 / 10  # a tenth of int4's bytes, and less
    # 5% in 2 bits among 8 workers: 7 payloads of 0.088 byte a value cost more than dense int2's
    # 2 · 7/8 · 0.27: the dense exchange, priced as int2
    many = step_estimate(work(outer_compression="sparse", density=0.05, value_bits=2), "diloco", "outer", 8, 1, latency)
    int2 = step_estimate(work(outer_compression="int2"), "diloco", "outer", 8, 1, latency)
    assert many == int2 and int2.bytes_per_rank == pytest.approx(1e8 * (0.25 + 4 / 256) * 2 * 7 / 8)
    # two levels, 4 nodes of 4 GPUs: inside, the fp32 buffer's ring; between nodes each local rank's
    # slice (a quarter) all-gathered among the 4 nodes: 3 payloads of a whole model on the link
    levels = step_estimate(sparse, "diloco", "outer", 4, 4, latency)
    inside = 4e8 * 2 * 3 / 4
    assert levels.comm_s == pytest.approx(inside / 25e9 + 6 * 10e-6 + 3 * (payload / 1.25e9 + 0.01), rel=1e-6)
    assert levels.bytes_per_rank == pytest.approx(inside + 3 * payload / 4, rel=1e-6)


def test_compressed_exchanges_in_two_levels_by_hand():
    """4 nodes of 4 GPUs: flat, a node's link carries 4 ranks' share of the 1-bit exchange among 16;
    in two levels (the default, comm/topology.py) the fp32 buffer is reduced and gathered inside
    the node and the link carries one share of the exchange among the 4 nodes."""
    net = Network(link_bytes_per_s=1.25e9, latency_s=0.01)  # intra-node: 25 GB/s, 10 µs a hop
    onebit = 1e8 * 0.140625
    flat = step_estimate(work(hierarchy=False), "onebit_lamb", "compressed", 4, 4, net)
    assert flat.comm_s == pytest.approx(4 * onebit * 2 * 15 / 16 * 12 / 15 / 1.25e9 + 4 * 15 * 0.01
                                        + onebit * 2 * 15 / 16 * 3 / 15 / 25e9)
    assert flat.bytes_per_rank == pytest.approx(onebit * 2 * 15 / 16)
    two = step_estimate(work(), "onebit_lamb", "compressed", 4, 4, net)
    inside = 4e8 * 2 * 3 / 4 / 25e9 + 6 * 10e-6
    assert two.comm_s == pytest.approx(inside + onebit * 2 * 3 / 4 / 1.25e9 + 4 * 3 * 0.01)
    assert two.bytes_per_rank == pytest.approx(4e8 * 2 * 3 / 4 + onebit / 4 * 2 * 3 / 4)
    assert flat.comm_s / two.comm_s > 3
    # one node of 4: "auto" stays flat (a compressed exchange as chosen), true gives the exact average
    assert step_estimate(work(), "onebit_lamb", "compressed", 1, 4, net).comm_s == pytest.approx(
        step_estimate(work(hierarchy=False), "onebit_lamb", "compressed", 1, 4, net).comm_s)
    assert step_estimate(work(hierarchy=True), "onebit_lamb", "compressed", 1, 4, net).comm_s == pytest.approx(inside)
    # 0/1 Adam's 1-bit steps and DiLoCo's int8 average alike; fp32 and bf16 averages were already by level
    zero_one = step_estimate(work(), "zero_one_adam", "sync", 4, 4, net)
    assert zero_one.comm_s == pytest.approx(two.comm_s)
    int8 = 1e8 * (1 + 4 / 256)
    diloco = step_estimate(work(outer_compression="int8"), "diloco", "outer", 4, 4, net)
    assert diloco.comm_s == pytest.approx(inside + int8 * 2 * 3 / 4 / 1.25e9 + 2 * 3 * 0.01)


def test_unequal_nodes_priced_as_their_cluster_by_hand():
    """4 + 4 + 2 GPUs: 10 ranks' compute (as 10 on one node). In two levels (comm/topology.py) the
    fullest node's fp32 ring inside, and between the 3 nodes the node's 2 slices (the smallest
    node's GPUs), together the whole 1-bit buffer on each link; flat, the 1-bit exchange among
    10 with a full node's 4 ranks sharing its link."""
    net = Network(link_bytes_per_s=1.25e9, latency_s=0.01)
    onebit = 1e8 * 0.140625
    uneven = step_estimate(work(), "onebit_lamb", "compressed", 3, (4, 4, 2), net)
    assert uneven.compute_s == pytest.approx(step_estimate(work(), "onebit_lamb", "compressed", 1, 10, net).compute_s)
    inside = 4e8 * 2 * 3 / 4 / 25e9 + 6 * 10e-6
    assert uneven.comm_s == pytest.approx(inside + onebit * 2 * 2 / 3 / 1.25e9 + 4 * 2 * 0.01)
    assert uneven.bytes_per_rank == pytest.approx(4e8 * 2 * 3 / 4 + onebit / 2 * 2 * 2 / 3)
    flat = step_estimate(work(hierarchy=False), "onebit_lamb", "compressed", 3, (4, 4, 2), net)
    assert flat.bytes_per_rank == pytest.approx(onebit * 2 * 9 / 10)  # flat among 10
    assert flat.comm_s == pytest.approx(4 * onebit * 2 * 9 / 10 * 6 / 9 / 1.25e9 + 4 * 9 * 0.01
                                        + onebit * 2 * 9 / 10 * 3 / 9 / 25e9)
    lamb = step_estimate(work(), "lamb", "full", 3, (4, 4, 2), net)
    assert lamb.comm_s == pytest.approx(step_estimate(work(), "lamb", "full", 3, 4, net).comm_s)  # the 4-GPU ring


def test_estimate_cli_prices_a_cluster_of_unequal_nodes(tmp_path, capsys):
    from commodity_bert.plan.cli import main
    out = tmp_path / "plan.json"
    assert main(["estimate", "--gpu-tflops", "71", "--link", "10gbit", "--gpus-per-node", "4,4,2", "--model", "base",
                 "--optimizer", "lamb,onebit_lamb", "--json", str(out)]) == 0
    assert "nodes of 4, 4, 2 GPUs" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [(r["optimizer"], r["nodes"], r["gpus"]) for r in rows] == [("lamb", 3, 10), ("onebit_lamb", 3, 10)]
    code, stderr = refusal(main, ["estimate", "--gpu-tflops", "71", "--link", "10gbit", "--nodes", "2",
                                  "--gpus-per-node", "4,4,2"], capsys)
    assert code == 2 and "a list of GPUs per node is one cluster of 3 nodes; drop --nodes" in stderr


def test_estimate_cli_prices_cards_of_unequal_speed_split_equally_and_by_speed(tmp_path, capsys):
    """--gpu, a card per node: the equal split runs at the slowest card's pace; dealt by speed, the
    slowest rank's share of the micro-batches sets it (data/deal.py's arithmetic); fit answers per
    card, with one micro-batch for every rank."""
    from commodity_bert.data.deal import Deal
    from commodity_bert.plan.cli import main
    out = tmp_path / "plan.json"
    assert main(["estimate", "--gpu", "3090,3090,2080ti", "--gpus-per-node", "2", "--link", "10gbit",
                 "--model", "base", "--optimizer", "lamb", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2080ti has no bf16: a job of cards with and without it trains fp16 on all" in printed
    equal, balanced = json.loads(out.read_text())
    assert (equal["split"], balanced["split"], equal["gpus"], equal["comm_s"]) == ("equal", "balanced", 6,
                                                                                   balanced["comm_s"])
    assert equal["compute_s"] > balanced["compute_s"] and balanced["step_s"] < equal["step_s"]
    # the term itself: accumulation 8 of a 0.5-s micro-batch on the slower card (speed 0.5), or 11 of
    # the step's 16 micro-batches on the faster (0.25 s each) and 5 on the slower
    slow = work(speeds=(1.0, 0.5), balanced=True)
    assert micro_batches_s(slow, 2) == pytest.approx(11 * 0.25) and micro_batches_s(work(), 2) == pytest.approx(8 * 0.5)
    assert Deal.from_speeds([1.0, 0.5], 8).counts() == [11, 5]
    # a profile's ranks: speeds in rank order, none where all are within 10%
    from commodity_bert.plan.estimate import speeds_from_profile
    ranks = [{"rank": 1, "forward_backward_s": 0.4}, {"rank": 0, "forward_backward_s": 0.2}]
    assert speeds_from_profile({"ranks": ranks}) == (1.0, 0.5)
    assert speeds_from_profile({"ranks": [{**ranks[0], "forward_backward_s": 0.21}, ranks[1]]}) is None
    code, stderr = refusal(main, ["estimate", "--gpu", "3090,k80", "--link", "1gbit"], capsys)
    assert code == 2 and "--gpu 'k80': give one of 2080ti" in stderr
    fitted = tmp_path / "fit.json"
    assert main(["fit", "--gpu", "3090,2080ti", "--model", "base", "--gpus-per-node", "4,4", "--seq-len", "512",
                 "--json", str(fitted)]) == 0
    answer = json.loads(fitted.read_text())
    assert answer["micro_batch"] == min(card["micro_batch"] for card in answer["cards"])
    assert [card["precision"] for card in answer["cards"]] == ["bf16", "fp16"]


def test_phase_and_recipe_totals_by_hand():
    w = work(schedule={"freeze_step": 4})
    phase = phase_estimate(w, "onebit_lamb", 4, 1, TEN_GBIT)
    full, compressed = 2.1 + 0.24, 2.1 + 1.5 * 1e8 * 0.140625 / 1.25e9
    assert phase["stages"]["full"]["steps"] == 4 and phase["stages"]["compressed"]["steps"] == 6
    assert phase["seconds"] == pytest.approx(4 * full + 6 * compressed)

    rows = recipe_rows({"lamb": [work()]}, [1, 4], 1, TEN_GBIT, usd_per_gpu_hour=2.0)
    assert [set(r) >= ROW_KEYS for r in rows] == [True, True]
    one, four = rows
    assert one["step_s"] == pytest.approx(8.1) and one["efficiency"] == pytest.approx(1.0)
    assert four["step_s"] == pytest.approx(2.34)
    assert four["seq_per_s"] == pytest.approx(64 / 2.34)
    assert four["efficiency"] == pytest.approx(8.1 / (4 * 2.34))
    assert four["days"] == pytest.approx(23.4 / 86400)
    assert four["usd"] == pytest.approx(23.4 / 3600 * 4 * 2.0)


def test_estimate_cli_by_hand_recipe(tmp_path):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    proc = plan("estimate", "--gpu-tflops", 125, "--link", "10gbit", "--nodes", "1,2,4", "--gpus-per-node", 4,
                "--model", "large", "--recipe", "--optimizer", "lamb,onebit_lamb", "--usd-per-gpu-hour", 2,
                "--json", out, "--plot", png)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert [(r["optimizer"], r["nodes"], r["gpus"]) for r in rows] == [
        ("lamb", 1, 4), ("lamb", 2, 8), ("lamb", 4, 16), ("onebit_lamb", 1, 4), ("onebit_lamb", 2, 8),
        ("onebit_lamb", 4, 16)]
    assert all(set(r) >= ROW_KEYS for r in rows)
    # the recipe: phase 1 (7,038 steps, batch 65,536) + phase 2 (1,563 steps, batch 32,768)
    assert [p["steps"] for p in rows[0]["phases"]] == [7038, 1563]
    for r in rows:
        assert r["step_s"] == pytest.approx(r["compute_s"] + r["comm_s"])
        assert r["days"] == pytest.approx(r["step_s"] * (7038 + 1563) / 86400)
        assert r["usd"] == pytest.approx(r["days"] * 24 * r["gpus"] * 2)
    lamb4, onebit4 = rows[2], rows[5]
    assert onebit4["comm_s"] < lamb4["comm_s"]  # compressed after the freeze
    assert png.stat().st_size > 10_000
    assert "lamb" in proc.stdout and "efficiency" in proc.stdout


def test_estimate_cli_knows_the_slow_link_modes_from_the_shipped_configs(tmp_path):
    out = tmp_path / "plan.json"
    proc = plan("estimate", "--gpu-tflops", 125, "--link", "1gbit", "--latency-ms", 20, "--nodes", "4",
                "--gpus-per-node", 4, "--model", "large", "--recipe", "--optimizer", "lamb,zero_one_adam,diloco",
                "--json", out)
    assert proc.returncode == 0, proc.stderr
    lamb, zero_one, diloco = json.loads(out.read_text())
    # 0/1 Adam's recipe: batch 4,096 for the LAMB recipe's samples; its schedule's kinds of steps
    assert [p["steps"] for p in zero_one["phases"]] == [112608, 12504]
    assert set(zero_one["phases"][0]["stages"]) == {"full", "onebit", "local", "sync"}
    # DiLoCo: H = 50 and a bf16 pseudo-gradient, against LAMB's fp16 allreduce every step: 50× fewer bytes
    stages = diloco["phases"][0]["stages"]
    assert stages["outer"]["steps"] + stages["final"]["steps"] == -(-7038 // 50)  # every 50th, and the last
    assert stages["outer"]["rounds_per_step"] == 1
    assert lamb["bytes_per_rank"] / diloco["bytes_per_rank"] == pytest.approx(50, rel=0.01)
    assert diloco["comm_s"] < lamb["comm_s"] / 40


@pytest.mark.parametrize("args, words", [
    (["estimate", "--gpu-tflops", "100", "--link", "10gbit", "--optimizer", "adam"], "choose from"),
    (["estimate", "--profile", "missing.json"], "run `bert-plan preflight"),
    (["estimate", "--gpu-tflops", "100", "--nodes", "1,2"], "--link"),
    (["estimate", "--gpu-tflops", "100", "--link", "fast"], "rate like"),
    (["estimate", "--gpu-tflops", "100", "--link", "1gbit", "--nodes", "1,x"], "comma-separated"),
    (["estimate"], "--profile"),
])
def test_estimate_bad_input_one_line(args, words, tmp_path, capsys):
    from commodity_bert.plan.cli import main
    # through the console script once, the rest in process
    code, stderr = refusal(main, args, capsys, "commodity_bert.plan" if args == ["estimate"] else None)
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bert-plan: error:") and words in lines[0], stderr


def preflight_cmd(*launch, out, extra=()):
    return [DEEPSPEED, *launch, "--module", "commodity_bert.plan", "preflight", "--model", "tiny",
            "--out", str(out), *map(str, extra)]


def test_preflight_two_local_ranks_then_estimate(tmp_path, train_data):
    out = tmp_path / "profile.json"
    out.write_text("an earlier profile")  # replaced whole, never half-written
    proc = subprocess.run(preflight_cmd("--num_gpus", "2", "--master_port", str(free_port()), out=out, extra=[
        "--data", train_data, "--deepspeed_config", REPO / "ds_configs" / "cpu_tiny_lamb.json", "--micro-batch", 8,
        "--steps", 2, "--sizes-mb", "1,4"]), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    profile = json.loads(out.read_text())
    assert (profile["world_size"], profile["hosts"], profile["backend"], profile["precision"]) == (2, 1, "gloo", "fp32")
    assert [r["rank"] for r in profile["ranks"]] == [0, 1]
    manifest = json.loads((train_data / "manifest.json").read_text())
    from commodity_bert.plan.estimate import parameter_count
    for r in profile["ranks"]:
        assert r["params"] == parameter_count("tiny", manifest["vocab"]["size"], nsp=manifest["nsp"])
        assert (r["model"], r["seq_len"], r["micro_batch"]) == ("tiny", manifest["seq_len"], 8)
        assert r["interface"] and r["device"] and r["matmul_tflops"] > 0
        assert 0 < r["forward_backward_s"] < 10 and 0 < r["optimizer_s"] < 10 and r["onebit_optimizer_s"] > 0
        assert 0 < r["lowbit_average_s"] < 10  # DiLoCo int4 average's own passes
        assert 0 < r["sparse_decode_s"] < r["sparse_encode_s"] < 10  # and sparse's: top-k costs more than a decoding
        assert 0 < r["real_token_share"] <= 1
    sizes = profile["allreduce"]["sizes"]
    assert [s["mb"] for s in sizes] == [1, 4] and all(s["seconds"] > 0 for s in sizes)
    assert profile["allreduce"]["fit"]["bus_bytes_per_s"] > 0
    assert profile["links"] == [] and profile["problems"] == []
    assert "fwd+bwd s" in proc.stdout and "busbw" in proc.stdout

    # the estimate takes the slowest rank's measured step as is for the same model, length, micro-batch
    rows_path, config = tmp_path / "rows.json", tmp_path / "micro8.json"
    base = json.loads((REPO / "ds_configs" / "cpu_tiny_lamb.json").read_text())
    config.write_text(json.dumps({**base, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4}))
    est = plan("estimate", "--profile", out, "--link", "1gbit", "--nodes", "1,2", "--gpus-per-node", 1,
               "--model", "tiny", "--config", config, "--seq-len",
               manifest["seq_len"], "--steps", 100, "--optimizer", "lamb", "--json", rows_path)
    assert est.returncode == 0, est.stderr
    rows = json.loads(rows_path.read_text())
    # two ranks sharing two cores with the suite can differ by more than 10%: the profile's ranks are
    # then unequal and the 2-GPU row comes also split by speed, never slower than the equal split
    one, two = [r for r in rows if r.get("split") != "balanced"]
    for row in rows:
        if row.get("split") == "balanced":
            # (a deal that comes out equal sums the same seconds in another order: equal to rounding)
            assert row["gpus"] == 2 and row["compute_s"] <= two["compute_s"] * (1 + 1e-12)
    slowest = max(profile["ranks"], key=lambda r: r["forward_backward_s"])
    accumulation = 4  # the config's batch, 32 sequences on one GPU, in micro-batches of 8
    assert one["compute_s"] == pytest.approx(
        accumulation * (slowest["forward_backward_s"] + slowest["loop_overhead_s"]) + slowest["optimizer_s"]
        + slowest["grad_sync_local_s"])
    size = 4 * slowest["params"]  # fp32 gradients over 1 Gbit/s
    assert two["comm_s"] == pytest.approx(size / (1e9 / 8) + 2 * 50e-6)


def test_preflight_names_a_slowed_link(cluster, tmp_path):
    """node2's uplink limited to 20 Mbit/s by tc: preflight says which host, and exits 1."""
    out = tmp_path / "profile.json"
    cluster.set_link(rate="20mbit", hosts=[1])
    try:
        proc = subprocess.run(
            cluster.exec_prefix(0) + preflight_cmd("--hostfile", str(cluster.hostfile), "--master_port",
                                                   str(free_port()), out=out, extra=[
                "--seq-len", 32, "--micro-batch", 2, "--steps", 1, "--vocab-size", 2000, "--sizes-mb", "1",
                "--link-mb", 1]), cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=300)
    finally:
        cluster.set_link()
    assert proc.returncode != 0, proc.stdout[-3000:]
    profile = json.loads(out.read_text())
    assert profile["hosts"] == 2 and {r["interface"] for r in profile["ranks"]} == {"eth0"}
    speeds = {(r["from"], r["to"]): r["gbit_s"] for r in profile["links"]}
    assert set(speeds) == {("node1", "node2"), ("node2", "node1")}
    assert speeds[("node2", "node1")] < 0.025 < speeds[("node1", "node2")]
    # the link's line alone: beside other tests on 2 shared cores a rank may also be named as slow
    [link] = [p for p in profile["problems"] if p.startswith("slow link")]
    assert link.startswith("slow link: node2 sends"), profile["problems"]
    assert f"problem: {link}" in proc.stdout
    # where each host is reached, and the lines to paste
    assert f"node1: eth0 {cluster.addresses[0]} reaches node2" in proc.stdout
    assert f"node2: eth0 {cluster.addresses[1]} reaches node1" in proc.stdout
    assert "  GLOO_SOCKET_IFNAME=eth0\n" in proc.stdout and "  NCCL_SOCKET_IFNAME=eth0\n" in proc.stdout
    assert f"  MASTER_ADDR={cluster.addresses[0]}   " in proc.stdout


def test_preflight_stops_on_an_interface_that_reaches_no_other_host(cluster, tmp_path):
    """Each host also has docker0 at 172.17.0.1 (Cluster.add_decoy_interface), and the ranks are
    told GLOO_SOCKET_IFNAME=docker0: preflight names, per host, the interface that does reach the
    others, and stops before the first collective (which would hang) with one line a host."""
    out, env_file = tmp_path / "profile.json", tmp_path / "deepspeed_env"
    env_file.write_text(f"GLOO_SOCKET_IFNAME=docker0\nOMP_NUM_THREADS={cluster.threads_per_rank}")
    cluster.add_decoy_interface()
    try:
        proc = subprocess.run(
            cluster.exec_prefix(0) + preflight_cmd("--hostfile", str(cluster.hostfile), "--master_port",
                                                   str(free_port()), out=out, extra=["--vocab-size", 2000]),
            cwd=REPO, env={**cluster.env, "DS_ENV_FILE": str(env_file), "GLOO_SOCKET_IFNAME": "docker0"},
            capture_output=True, text=True, timeout=300)
    finally:
        cluster.add_decoy_interface(remove=True)
    assert proc.returncode != 0 and not out.exists(), proc.stdout[-3000:]
    for host, peer in (("node1", "node2"), ("node2", "node1")):
        assert (f"problem: {host}: GLOO_SOCKET_IFNAME=docker0 does not reach the other hosts ({host} reaches them "
                f"through eth0); set GLOO_SOCKET_IFNAME=eth0") in proc.stdout, proc.stdout[-3000:]
    assert "  GLOO_SOCKET_IFNAME=eth0\n" in proc.stdout
    assert "stopping before the first collective" in proc.stdout
    assert GBIT == 1.25e8


def test_problem_lines_from_measurements():
    from commodity_bert.plan.preflight import interface_problems, link_problems, round_robin
    # every pair once, in rounds of disjoint pairs (a bye when odd)
    for n in (2, 3, 4, 5):
        pairs = [p for r in round_robin(n) for p in r]
        assert sorted(tuple(sorted(p)) for p in pairs) == [(a, b) for a in range(n) for b in range(a + 1, n)]
        assert all(len({h for p in r for h in p}) == 2 * len(r) for r in round_robin(n))

    fast = 1.0
    three = [{"from": a, "to": b, "gbit_s": 0.05 if a == "node3" else fast}
             for a in ("node1", "node2", "node3") for b in ("node1", "node2", "node3") if a != b]
    (line,) = link_problems(three)
    assert line.startswith("slow link: node3 sends 50 Mbit/s to node1, sends 50 Mbit/s to node2")
    receives = [{**r, "gbit_s": 0.05 if r["to"] == "node2" else fast} for r in three]
    assert link_problems(receives)[0].startswith("slow link: node2 receives 50 Mbit/s from node1")
    assert link_problems([{**r, "gbit_s": fast * 0.9} for r in three]) == []
    two = [{"from": "node1", "to": "node2", "gbit_s": 1.0}, {"from": "node2", "to": "node1", "gbit_s": 0.1}]
    assert link_problems(two)[0].startswith("slow link: node2 sends 100 Mbit/s to node1")

    from commodity_bert.plan.preflight import interface_plan, nccl_accepts, slow_rank_problems
    assert nccl_accepts("eth", "eth0") and nccl_accepts("^docker,lo", "eth0") and not nccl_accepts("=eth", "eth0")
    assert not nccl_accepts("^eth", "eth0") and nccl_accepts("ib,eth0", "eth0")
    where = [{"host": "a", "addresses": {"eth0": "10.0.0.1", "docker0": "172.17.0.1"}, "gloo_ifname": None,
              "nccl_ifname": "docker0"},
             {"host": "b", "addresses": {"ens5": "10.0.0.2"}, "gloo_ifname": None, "nccl_ifname": None}]
    lines, problems, blocking = interface_plan(where, {"a": {"b": "eth0"}, "b": {"a": "ens5"}}, "nccl")
    assert lines[:2] == ["a: eth0 10.0.0.1 reaches b", "b: ens5 10.0.0.2 reaches a"]
    assert "  NCCL_SOCKET_IFNAME=ens5,eth0" in lines and "  MASTER_ADDR=10.0.0.1   (deepspeed: --master_addr; " \
        "rank 0's host, a, on eth0; not for Slurm: pretrain.sbatch works it out on every start)" in lines
    assert any(line.startswith("  GLOO_SOCKET_IFNAME: the hosts' interfaces differ (a: eth0, b: ens5)") for line in lines)
    assert problems == ["a: NCCL_SOCKET_IFNAME=docker0 does not reach the other hosts (a reaches them through eth0); "
                        "set NCCL_SOCKET_IFNAME=eth0"] and blocking
    assert interface_plan(where, {"a": {"b": "eth0"}, "b": {"a": "ens5"}}, "gloo")[2] is False  # gloo runs
    ranks = [{"rank": r, "host": "a", "device": "GPU", "forward_backward_s": s} for r, s in enumerate((1, 1.1, 2.0))]
    (line,) = slow_rank_problems(ranks)
    assert line.startswith("slow rank: rank 2 on a (GPU) takes 2 s a forward + backward, 1.8x the median 1.1 s")

    same = [{"host": h, "interface": "eth0"} for h in ("a", "a", "b")]
    assert interface_problems(same) == []
    (line,) = interface_problems(same[:2] + [{"host": "b", "interface": "docker0"}])
    assert "a: eth0; b: docker0" in line and "GLOO_SOCKET_IFNAME" in line


@pytest.mark.parametrize("launcher", ["deepspeed", "srun", "bert-launch"])
def test_preflight_names_the_host_that_never_joins(tmp_path, launcher):
    """Rank 0 of 2 alone, as DeepSpeed's launch.py starts it (its parent holds --world_info), as
    srun does (the step's node list and tasks a node) or as bert-launch --no_ssh starts it on the
    first host of two (its launch.py forked, with bert-launch's command line): after --join-timeout
    it names the host whose rank did not come, and writes nothing."""
    import base64
    import os
    world_info = base64.urlsafe_b64encode(json.dumps({"nodeA": [0], "nodeB": [0]}).encode()).decode()
    out = tmp_path / "profile.json"
    rank0 = [sys.executable, "-m", "commodity_bert.plan", "preflight", "--model", "tiny", "--join-timeout", "3",
             "--out", str(out)]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    if launcher == "deepspeed":
        command = [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:-1]))",
                   *rank0, f"--world_info={world_info}"]
        env.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    elif launcher == "bert-launch":
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("nodeA slots=1\nnodeB slots=1\n")
        command = [sys.executable, "-m", "commodity_bert.launch", "--hostfile", str(hostfile), "--no_ssh",
                   "--node_rank", "0", "--master_addr", "127.0.0.1", "--master_port", env["MASTER_PORT"],
                   "--module", *rank0[2:]]
    else:
        command = rank0
        env.update(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="2", SLURM_NODEID="0", SLURM_LOCALID="0",
                   SLURM_STEP_NODELIST="nodeA,nodeB", SLURM_STEP_TASKS_PER_NODE="1(x2)")
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK"):
            env.pop(name, None)
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert ("bert-plan preflight: problem: host unreachable: nodeB (rank 1) did not join within 3 s"
            in proc.stdout), proc.stdout + proc.stderr
    assert not out.exists()


def test_the_allreduce_fit_stays_positive_when_noise_decides():
    """On a busy machine loopback measured 4 MB faster than 1 MB: a negative slope, a negative
    bandwidth, and estimate's input broken (CI, 2026-11-25). The fit falls back to the origin."""
    from commodity_bert.plan.preflight import fit_line
    latency, per_byte = fit_line([(1.0 * 2**20, 0.004), (4.0 * 2**20, 0.003)])
    assert latency == 0.0 and per_byte > 0
    assert fit_line([(1.0, 2.0), (3.0, 4.0)]) == (1.0, 1.0)  # an ordinary line is left as it is
