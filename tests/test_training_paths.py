"""The paths people run, through DeepSpeed's launcher on 2 gloo ranks: bf16 (it goes through the
same DeepSpeed optimizer wrapper as fp16 under ZeRO 0), LAMB, 1-bit LAMB across the freeze,
bucket-wise clipping, ZeRO-1 and ZeRO-2 AdamW, gradient accumulation, dynamic masking, --init-from
a checkpoint directory, exact resume; each asserts numbers against an fp32 run or a reference
computed here. The fp16-only logic (loss scaling) is tested in test_precision.py."""
import json
from statistics import median

import pytest
import torch
from conftest import REPO, config_file, rows, train, window_loss

from commodity_bert.data import shard_format as fmt
from commodity_bert.data.dataset import ShardSet
from commodity_bert.data.deal import Deal
from commodity_bert.data.loader import TrainingBatches
from commodity_bert.model.bert import PretrainingModel, build_config, build_model, load_pretrained

CONFIGS = REPO / "ds_configs"
BF16_LOSS_TOLERANCE = 0.01  # measured: bf16 tracks fp32 within 0.003 over these runs
SEED = 42


def launch(tmp_dir, data, name, config, steps, *extra):
    run = tmp_dir / name
    train(2, "--deepspeed_config", config, "--model", "tiny", "--data", data, "--output-dir", run,
          "--max-steps", steps, "--log-every", 1, "--num-workers", 1, *extra)
    return run


def reference_grad_norm(data, micro_batch, accumulation=1, world=2, pretrained=None, per_rank=False,
                        deal=None) -> float:
    """Step 1's gradient norm computed here, without DeepSpeed: the same initial weights, batches
    and dropout as train.py's ranks, the gradient averaged over ranks and micro-batches (with
    `per_rank`, the root mean square of each rank's own gradient's norm, as DiLoCo logs it), each
    rank training the micro-batches `deal` gives it (data/deal.py; None: its own)."""
    manifest = fmt.load_manifest(data)
    total, own = None, []
    for rank in range(world):
        torch.manual_seed(SEED)
        hf = build_model(build_config("tiny", manifest["vocab"]["size"]), nsp=manifest["nsp"])
        if pretrained is not None:
            hf, _ = load_pretrained(pretrained, nsp=manifest["nsp"])
        model = PretrainingModel(hf).train()
        torch.manual_seed(SEED + rank)
        batches = TrainingBatches(ShardSet.open(data), rank, world, micro_batch, SEED, 0)
        batches.set_deal(deal)
        stream = iter(batches)
        for _ in range(batches.micro_batches_per_step(accumulation)):
            loss, _ = model(next(stream))
            (loss / accumulation).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        own.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    if per_rank:
        return (sum(n * n for n in own) / world) ** 0.5
    return float(torch.linalg.vector_norm(torch.stack([(g / world).norm() for g in total])))


def by_step(run) -> dict:
    return {r["step"]: r for r in rows(run) if "loss" in r}


def tiny_numel(data) -> int:
    """The parameters of `tiny` on `data`'s vocabulary."""
    manifest = fmt.load_manifest(data)
    return sum(p.numel() for p in build_model(build_config("tiny", manifest["vocab"]["size"]),
                                              nsp=manifest["nsp"]).parameters())


def identical_across_ranks(run) -> bool:
    return json.loads((run / "summary.json").read_text())["params_identical_across_ranks"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, train_data):
    return tmp_path_factory.mktemp("paths")


# ---- LAMB and 1-bit LAMB in bf16 against their fp32 runs


def test_lamb_in_bf16_tracks_fp32(mode_run, train_data, run30):
    run = mode_run("allreduce").whole
    bf16, fp32 = by_step(run), by_step(run30)  # run30 logs every 5 steps
    for step in (5, 10):
        assert abs(window_loss(bf16, step) - fp32[step]["loss"]) < BF16_LOSS_TOLERANCE, (step, fp32[step])
    assert all(r["loss_scale"] == 1.0 for r in bf16.values())  # bf16 needs no loss scale
    assert bf16[1]["grad_norm"] == pytest.approx(reference_grad_norm(train_data, 32), rel=0.01)
    assert identical_across_ranks(run)


def test_onebit_lamb_in_bf16_tracks_fp32_across_the_freeze(mode_run, onebit20):
    run = mode_run("onebit_lamb").whole
    bf16, fp32 = by_step(run), by_step(onebit20)  # both log every step
    for step in (5, 10):  # before the freeze after step 10
        assert abs(window_loss(bf16, step) - window_loss(fp32, step)) < BF16_LOSS_TOLERANCE, step
    # The compression stage's first updates (after steps 11 and 12) show in the losses of steps 12
    # and 13: there bf16 tracks fp32 as in warmup (within 0.0005 on an AMX Xeon; single steps, so
    # twice the windows' tolerance). A stage that updated nothing (measured: its update multiplied
    # by 0) put them 0.058 and 0.10 above.
    for step in (11, 12, 13):
        assert abs(bf16[step]["loss"] - fp32[step]["loss"]) < 2 * BF16_LOSS_TOLERANCE, (step, bf16[step], fp32[step])
    # Later the runs part: this compression stage (frozen after 10 steps, far earlier than a real
    # run would) has one-step loss spikes that the next step undoes, in fp32 as in bf16, at steps
    # that the smallest difference moves: bf16's rounding differs between CPUs (AMX, AVX-512 BF16,
    # emulated), so the spikes are not pinned by the suite's data being the same each run. Measured
    # on an AMD EPYC over two draws of the data, lr 0.01 and ±1%, in both precisions
    # (benchmarks/onebit_spikes.py): grad
    # norms of 11-120 at step 14, 16, 18 or 20; where bf16 spiked at 14 and fp32 did not, bf16's
    # 5-step mean at 15 was 0.08 above fp32's, as on one CI machine. So the stage is only held to
    # go on learning: the median of steps 11-15 (one spike moves it little) was 0.16-0.20 below
    # that of steps 6-10 in all 12 runs; on shares 1 : 3 (micro-batch 16 × 2, UNEQUAL in conftest.py)
    # 0.19 below in bf16 and in fp32 (one run each).
    assert median(bf16[s]["loss"] for s in range(11, 16)) < median(bf16[s]["loss"] for s in range(6, 11)) - 0.1, \
        ([bf16[s]["loss"] for s in range(6, 16)], [fp32[s]["loss"] for s in range(6, 16)])
    # the freeze at the same step as in fp32 (DeepSpeed's priming step is not counted): warmup
    # sends bf16 gradients, half fp32's, the compression stage the same 1-bit momenta as fp32
    assert bf16[10]["bytes_sent"] == pytest.approx(fp32[10]["bytes_sent"] / 2, rel=1e-6)  # ring volumes, floored
    assert bf16[11]["bytes_sent"] == bf16[15]["bytes_sent"] < bf16[10]["bytes_sent"] / 8
    assert bf16[15]["bytes_sent"] == pytest.approx(fp32[15]["bytes_sent"], rel=1e-4)
    assert all(r["grad_norm"] and r["grad_norm"] > 0 for r in bf16.values())
    assert identical_across_ranks(run)


# ---- bucket-wise clipping, fp32 and bf16


@pytest.fixture(scope="module")
def bucketwise_fp32(reference_runs):
    return reference_runs["bucketwise_fp32"]


def test_bucketwise_clipping_logs_the_ranks_norms_before_clipping(bucketwise_fp32, train_data, run30):
    history = by_step(bucketwise_fp32)
    # about 2, above max_norm 1.0: the metric is taken before clipping, from each rank's own
    # gradient (the average is never formed unclipped), combined in the row: no traffic of its own
    # (each rank's own: rank 1 trains 3 of the step's 4 micro-batches, UNEQUAL in conftest.py)
    own = reference_grad_norm(train_data, 16, accumulation=2, per_rank=True, deal=Deal.from_speeds([1, 3], 2))
    assert history[1]["grad_norm"] == pytest.approx(own, rel=1e-4)
    assert own > reference_grad_norm(train_data, 16, accumulation=2)  # not the average's norm
    assert history[10]["loss"] < history[1]["loss"]
    assert identical_across_ranks(bucketwise_fp32)
    # the same bytes as DeepSpeed's own allreduce, sent in buckets during backward
    assert history[5]["bytes_sent"] == pytest.approx(rows(run30)[0]["bytes_sent"], rel=1e-3)


def test_bucketwise_clipping_in_bf16_tracks_fp32(mode_run, bucketwise_fp32):
    bf16, fp32 = by_step(mode_run("bucketwise_clipping").whole), by_step(bucketwise_fp32)
    for step in (1, 5, 10):
        assert abs(bf16[step]["loss"] - fp32[step]["loss"]) < BF16_LOSS_TOLERANCE, (step, bf16[step], fp32[step])
    assert bf16[1]["grad_norm"] == pytest.approx(fp32[1]["grad_norm"], rel=0.01)


# ---- ZeRO-1 (fp32) and ZeRO-2 (bf16) AdamW, accumulation 2, dynamic masking; ZeRO-2's exact
# resume: MODE_CASES["allreduce_zero2_adamw"] (test_comm_modes.py), whose run this is


@pytest.fixture(scope="module")
def zero1_fp32(reference_runs):
    return reference_runs["zero1_fp32"]


def test_zero1_with_accumulation_and_dynamic_masking_logs_the_reference_norm(zero1_fp32, dynamic_data):
    history = by_step(zero1_fp32)
    # ZeRO's bucketed reduction sums in another order: 2e-4 apart, where a norm taken locally, after
    # clipping or with a loss scale would be off by far more
    assert history[1]["grad_norm"] == pytest.approx(reference_grad_norm(dynamic_data, 16, accumulation=2), rel=1e-3)
    assert history[1]["samples"] == 64 and history[10]["loss"] < history[1]["loss"]
    assert identical_across_ranks(zero1_fp32)


def test_zero2_bf16_tracks_zero1_fp32(mode_run, zero1_fp32):
    zero2_bf16 = mode_run("allreduce_zero2_adamw").whole
    bf16, fp32 = by_step(zero2_bf16), by_step(zero1_fp32)
    for step in (1, 5, 10):
        assert abs(bf16[step]["loss"] - fp32[step]["loss"]) < BF16_LOSS_TOLERANCE, (step, bf16[step], fp32[step])
    assert bf16[1]["grad_norm"] == pytest.approx(fp32[1]["grad_norm"], rel=0.01)
    assert identical_across_ranks(zero2_bf16)


# ---- --init-from a checkpoint directory, in bf16


def test_init_from_a_checkpoint_directory_in_bf16(runs, train_data, run30):
    config = config_file(runs, "cpu_tiny_lamb.json", **{"bf16.enabled": True})
    run = launch(runs, train_data, "init_from_checkpoint", config, 1, "--init-from", run30 / "checkpoints")
    first = by_step(run)[1]
    # run30's step-30 weights, which its checkpoint and its export both hold
    assert first["grad_norm"] == pytest.approx(reference_grad_norm(train_data, 32, pretrained=run30 / "hf_model"), rel=0.02)
    assert first["loss"] < by_step(run30)[5]["loss"] - 0.05  # not from random weights


# ---- DiLoCo in bf16 with gradient accumulation: rounds, bytes, the shared model (its run and
# its resume mid-round: MODE_CASES["diloco"], test_comm_modes.py)


@pytest.fixture(scope="module")
def diloco20(mode_run):
    """inner_steps 10: rounds end at steps 10 and 20; evaluations every 5 steps, two of them
    mid-round."""
    return mode_run("diloco").whole


def test_diloco_communicates_once_a_round(diloco20, train_data):
    history = by_step(diloco20)
    numel = tiny_numel(train_data)
    for step, row in history.items():
        if step % 10:  # inner steps: no gradient allreduce, no overflow flag, nothing at all
            assert (row["comm_rounds"], row["bytes_sent"]) == (0, 0), row
        else:  # one fp32 allreduce of the pseudo-gradient: 2(N−1)/N × 4 bytes a parameter
            assert (row["comm_rounds"], row["bytes_sent"]) == (1, 4 * numel), row
    assert history[20]["outer_rounds"] == 2 and history[20]["samples"] == 20 * 64
    # the ranks' own gradients' norms, not the norm of an average nobody formed (no allreduce for it)
    assert history[1]["grad_norm"] == pytest.approx(reference_grad_norm(
        train_data, 16, accumulation=2, per_rank=True, deal=Deal.from_speeds([1, 3], 2)), rel=0.01)
    assert window_loss(history, 20) < history[1]["loss"] - 0.2  # lr still warming up (30 steps)
    assert identical_across_ranks(diloco20)  # the run ends with an outer step


def test_diloco_evaluates_the_shared_model_mid_round(diloco20):
    """Mid-round the ranks' models differ; evaluation uses θ, the last round's result: at step 15
    the same model as at step 10, right after the outer step."""
    history = by_step(diloco20)
    assert history[15]["val_mlm_acc"] == history[10]["val_mlm_acc"]
    assert history[15]["val_loss"] == history[10]["val_loss"]
    assert history[20]["val_loss"] < history[10]["val_loss"] < history[5]["val_loss"]


def test_diloco_warms_up_as_data_parallel_training_then_starts_its_rounds(mode_run, train_data):
    """warmup_steps 6, inner_steps 3: steps 1-6 are the allreduce case's (the same config without
    the diloco block), bit for bit; then one round ends at step 9, and the last step ends another."""
    warmed, plain = mode_run("diloco_warmup").whole, mode_run("allreduce").whole
    warm, same = by_step(warmed), by_step(plain)
    keys = ("loss", "grad_norm", "bytes_sent", "comm_rounds", "val_loss")
    for step in range(1, 7):
        assert {k: warm[step].get(k) for k in keys} == {k: same[step].get(k) for k in keys}, step
        assert warm[step]["bytes_sent"] > 0 and warm[step]["outer_rounds"] == 0
    assert warm[7]["loss"] == same[7]["loss"]  # the weights after step 6, alike
    assert warm[8]["loss"] != same[8]["loss"]  # after an inner step on each rank's own gradient
    numel = tiny_numel(train_data)
    for step in (7, 8):
        assert (warm[step]["comm_rounds"], warm[step]["bytes_sent"]) == (0, 0), warm[step]
    for step in (9, 10):  # the pseudo-gradient in fp32: 2(N−1)/N × 4 bytes a parameter
        assert (warm[step]["comm_rounds"], warm[step]["bytes_sent"]) == (1, 4 * numel), warm[step]
    assert [warm[s]["outer_rounds"] for s in (8, 9, 10)] == [0, 1, 2]
    assert identical_across_ranks(warmed)


# ---- 0/1 Adam in bf16: T_v, 1-bit steps, local steps and syncs on the wire (its run and its
# resume between syncs: MODE_CASES["zero_one_adam"], test_comm_modes.py)


@pytest.fixture(scope="module")
def zero_one24(mode_run):
    """Variance steps 1-4, 6, …, 12 (frozen after 12); syncs at 13-16, 18, 20, 24."""
    return mode_run("zero_one_adam").whole


def test_zero_one_adam_talks_as_its_schedules_say(zero_one24):
    history = by_step(zero_one24)
    full, one_bit, local = [1, 2, 3, 4, 6, 8, 10, 12], [5, 7, 9, 11], [17, 19, 21, 22, 23]
    sync = [13, 14, 15, 16, 18, 20, 24]
    assert {history[s]["bytes_sent"] for s in full} == {history[1]["bytes_sent"]}  # DeepSpeed's bf16 allreduce
    assert history[5]["bytes_sent"] < history[1]["bytes_sent"] / 4  # 1 + 1 bits a parameter against 16
    # a variance-stage 1-bit step: the exchange's four rounds and DeepSpeed's bf16 wrapper's 1-byte
    # overflow flag (the ranks must agree on skipping before the exchange); a sync, the exchange
    # alone; a local step, nothing (each rank skips its own overflows)
    assert {(history[s]["comm_rounds"], history[s]["bytes_sent"]) for s in one_bit} == {(5, history[5]["bytes_sent"])}
    assert {(history[s]["comm_rounds"], history[s]["bytes_sent"]) for s in sync} == {(4, history[5]["bytes_sent"] - 1)}
    assert {(history[s]["comm_rounds"], history[s]["bytes_sent"]) for s in local} == {(0, 0)}
    assert [s for s in history if history[s]["variance_frozen"]] == list(range(12, 25))
    assert window_loss(history, 24) < history[1]["loss"] - 0.5
    assert identical_across_ranks(zero_one24)  # the run ended on a sync
