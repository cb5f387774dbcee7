"""The 1-bit allreduce and the byte counter, on 2 and 3 real gloo ranks."""
import os

import pytest
import torch
import torch.distributed as dist
from conftest import spawn_ranks

from commodity_bert.collectives.onebit_allreduce import (
    CompressedAllreduce,
    pack_nonnegative,
    unpack_nonnegative,
)
from commodity_bert.comm.bytes_counter import BytesCounter


def test_sign_bits_round_trip():
    x = torch.randn(8 * 37)
    x[::5] = 0.0  # sign(0) = +1
    packed = pack_nonnegative(x >= 0)
    assert packed.dtype == torch.uint8 and packed.numel() == x.numel() // 8
    assert torch.equal(unpack_nonnegative(packed), x >= 0)


def _join_gloo(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _compressed_allreduce_worker(rank, world, port, results, numel, steps, scale_block):
    _join_gloo(rank, world, port)
    torch.manual_seed(rank)
    compressor = CompressedAllreduce(numel, "cpu", scale_block=scale_block)
    local = torch.randn(numel) * (rank + 1) + rank
    exact = local.clone()
    dist.all_reduce(exact)
    exact /= world
    running = torch.zeros(numel)
    errors = {}
    with BytesCounter() as wire:
        for step in range(1, steps + 1):
            out = compressor(local)
            running += out
            if step in (1, 10, steps):
                errors[step] = float((running / step - exact).norm() / exact.norm())
            outputs = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(outputs, out)
            assert all(torch.equal(outputs[0], o) for o in outputs)  # every rank rebuilds the same
        compressed_bytes = wire.total - steps * (world - 1) * out.numel() * 4  # minus the check above
    with BytesCounter() as wire:
        dist.all_reduce(local.clone())
        plain_bytes = wire.total
    # one call on a buffer whose first part is 1000× smaller than the rest (rare embedding rows);
    # the part ends on a block boundary, as rows of a tensor at the buffer's start do
    small = 4864  # 19 · 256 = 76 · 64
    mixed = torch.randn(numel)
    mixed[:small] *= 1e-3
    once = CompressedAllreduce(numel, "cpu", scale_block=scale_block)(mixed)
    exact_mixed = mixed.clone()
    dist.all_reduce(exact_mixed)
    exact_mixed /= world
    small_error = float((once - exact_mixed)[:small].norm() / exact_mixed[:small].norm())
    results[rank] = (errors, compressed_bytes / steps, plain_bytes, small_error)
    dist.destroy_process_group()


@pytest.mark.parametrize(("world", "scale_block"), [(2, None), (3, None), (2, 256), (3, 64)])
def test_error_feedback_makes_the_running_average_exact(world, scale_block):
    numel, steps = 10_001, 300  # not a multiple of 8·world nor of the block: padding is exercised
    results = spawn_ranks(_compressed_allreduce_worker, world, numel, steps, scale_block)
    for rank in range(world):
        errors, compressed, plain, small_error = results[rank]
        if scale_block is None:  # one scale per chunk: the small half is quantized to the big half's size
            assert small_error > 10
        else:                    # a scale per block keeps each block's magnitude
            assert small_error < 1.5
        assert errors[1] > 0.3                       # one call alone is coarse
        assert errors[steps] < errors[10] < errors[1]
        assert errors[steps] < 0.02                  # the running average converges to the exact one
        assert compressed <= plain / 16              # ≥ 16× fewer bytes than an fp32 allreduce


def _bucketwise_worker(rank, world, port, results):
    from commodity_bert.comm.bucketwise import BucketwiseClipAllreduce
    _join_gloo(rank, world, port)
    torch.manual_seed(0)  # same model everywhere
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    params = list(model.parameters())
    clipper = BucketwiseClipAllreduce(params, bucket_mb=64 * 65 * 4 * 2 / 2**20, max_norm=0.5,
                                      loss_scale=lambda: 1.0)
    torch.manual_seed(100 + rank)  # different data per rank
    x = torch.randn(16, 64) * (rank + 1) * 3

    def local_grads():
        model.zero_grad()
        model(x).pow(2).mean().backward()
        return [p.grad.clone() for p in params]
    local = local_grads()                       # without the clipper: hooks inactive
    model.zero_grad()
    clipper.start_boundary_backward()
    model(x).pow(2).mean().backward()
    launched_before_end = len(clipper.in_flight) == len(clipper.buckets)
    clipper.finish()
    ours = [p.grad.clone() for p in params]
    # reference: each bucket clipped locally to c/√B, then averaged
    expected = [g.clone() for g in local]
    index = {id(p): i for i, p in enumerate(params)}
    limit = 0.5 / len(clipper.buckets) ** 0.5
    for bucket in clipper.buckets:
        ids = [index[id(p)] for p in bucket]
        norm = torch.cat([local[i].reshape(-1) for i in ids]).norm()
        for i in ids:
            expected[i] = local[i] * min(1.0, float(limit / norm))
    for g in expected:
        dist.all_reduce(g)
        g /= world
    total = torch.cat([g.reshape(-1) for g in ours]).norm().item()
    results[rank] = (len(clipper.buckets), all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours, expected)),
                     total, launched_before_end)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_bucketwise_clipping_before_allreduce(world):
    results = spawn_ranks(_bucketwise_worker, world)
    for rank in range(world):
        buckets, matches, norm, launched = results[rank]
        assert buckets >= 3
        assert matches          # per-bucket clip to c/√B, then the average
        assert norm <= 0.5 + 1e-6
        assert launched         # every bucket's allreduce started during backward


def _freeze_worker(rank, world, port, results, freeze_step):
    from commodity_bert.optim.onebit_lamb import OneBitLamb
    _join_gloo(rank, world, port)
    torch.manual_seed(0)  # the same weights and gradients on every rank: the average is the gradient
    params = [torch.nn.Parameter(torch.randn(256, 64) * 1e-4), torch.nn.Parameter(torch.randn(4096) * 1e-4)]
    # gradients of one magnitude per tensor, so that 1-bit momenta (sign × block mean |m|) are exact
    # and a step's size depends on the coefficient alone (with the varied magnitudes of real
    # gradients, single compressed steps are noisy by design and only their sum is right)
    gradients = [torch.randn_like(p).sign() * magnitude for p, magnitude in zip(params, (0.5, 2.0))]
    # tiny weights against O(1) updates: the trust ratio sits at min_coeff, 0.01, at every warmup step
    optimizer = OneBitLamb(params, lr=1e-3, min_coeff=0.01, freeze_step=freeze_step, scale_block=64)
    moved = []
    for _ in range(freeze_step + 3):
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, gradients):
            p.grad = g.clone()
        optimizer.step()
        moved.append(torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(params, before)]).norm().item())
    results[rank] = moved
    dist.destroy_process_group()


@pytest.mark.parametrize("freeze_step", [10, 60])
def test_frozen_coefficient_is_the_mean_trust_ratio_of_warmup(freeze_step):
    """After the freeze, steps keep the size that warmup's trust ratios gave them: the frozen
    coefficient is their mean, whatever the freeze step (a running mean started at 1 made the
    first compressed steps ~35x too large after a freeze at step 10)."""
    results = spawn_ranks(_freeze_worker, 2, freeze_step)
    assert results[0] == results[1]
    moved = results[0]
    last_warmup = moved[freeze_step - 1]
    for compressed in moved[freeze_step:]:
        # the momentum still grows a little (no bias correction) and the factor starts within
        # ±factor_threshold of 1
        assert 0.8 * last_warmup < compressed < 1.25 * last_warmup, moved


def _auto_freeze_worker(rank, world, port, results):
    from commodity_bert.optim.onebit_lamb import OneBitLamb
    _join_gloo(rank, world, port)

    def gradient(step, shape):
        # the same on every rank (in warmup the engine has averaged them): large and shrinking
        # for 30 steps, as when a model leaves its first plateau, then of one scale
        g = torch.Generator().manual_seed(step)
        return torch.randn(shape, generator=g) * (1 + 20 * 0.8 ** step if step <= 30 else 1.0)

    def train(optimizer, params, steps, first=1):
        history = []
        for step in range(first, first + steps):
            for i, p in enumerate(params):
                p.grad = gradient(step * 10 + i, p.shape)
            was_frozen = optimizer.frozen
            optimizer.step()
            if not was_frozen and optimizer.step_count % optimizer.freeze_window == 0:
                history.append((optimizer.step_count, optimizer.variance_change))
        return history

    def fresh(**kwargs):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(512))]
        settings = {"lr": 1e-3, "freeze_step": "auto", "freeze_window": 5, "freeze_max_step": 120,
                    "scale_block": 64, **kwargs}
        return params, OneBitLamb(params, **settings)

    params, optimizer = fresh(freeze_threshold=0.05)
    history = train(optimizer, params, 80)
    out = {"history": history, "freeze_step": optimizer.freeze_step}
    # a run resumed from a checkpoint taken between two windows decides alike
    params, optimizer = fresh(freeze_threshold=0.05)
    train(optimizer, params, 17)
    saved = optimizer.state_dict()
    params2, resumed = fresh(freeze_threshold=0.05)
    for p, q in zip(params2, params):
        p.data.copy_(q.data)
    resumed.load_state_dict(saved)
    train(resumed, params2, 63, first=18)
    out["resumed_freeze_step"] = resumed.freeze_step
    # never settled below the threshold: the cap
    params, optimizer = fresh(freeze_threshold=0.0, freeze_max_step=40)
    train(optimizer, params, 45)
    out["capped_freeze_step"] = optimizer.freeze_step
    out["capped_frozen"] = optimizer.frozen
    results[rank] = out
    dist.destroy_process_group()


def test_auto_freeze_waits_for_the_variance_to_settle():
    """"freeze_step": "auto" freezes at the first window whose relative change of the
    bias-corrected variance is below the threshold: not while the gradients' scale is still
    moving, on every rank at the same step, alike after a resume, and at the cap at the latest."""
    results = spawn_ranks(_auto_freeze_worker, 2)
    assert results[0] == results[1]
    out = results[0]
    history = [(step, change) for step, change in out["history"] if change is not None]
    assert history[0][0] == 10  # the first window has nothing to compare with
    first_settled = next(step for step, change in history if change < 0.05)
    assert out["freeze_step"] == first_settled
    assert first_settled > 30, history  # not while the scale still shrinks
    assert all(change >= 0.05 for step, change in history if step < first_settled)
    assert out["resumed_freeze_step"] == out["freeze_step"]
    assert out["capped_freeze_step"] == 40 and out["capped_frozen"]


@pytest.mark.parametrize("params, problem", [
    ({"freeze_step": "auto"}, "freeze_max_step"),
    ({"freeze_step": "soon"}, "positive step number"),
    ({"freeze_step": 0}, "positive step number"),
    ({"freeze_step": "auto", "freeze_max_step": 100, "freeze_window": 0}, "freeze_window"),
])
def test_bad_freeze_settings_are_refused_in_one_line(params, problem):
    from commodity_bert.train.launch_checks import LaunchError, check_deepspeed_config
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "OneBitLamb", "params": params}}
    with pytest.raises(LaunchError, match=problem):
        check_deepspeed_config(config, 2)
    # the optimizer refuses them in the same words: one check, called before launch and when built
    from commodity_bert.optim.onebit_lamb import OneBitLamb
    with pytest.raises(ValueError, match=problem):
        OneBitLamb([torch.zeros(2, requires_grad=True)], **params)
    check_deepspeed_config({**config, "optimizer": {"type": "OneBitLamb", "params": {
        "freeze_step": "auto", "freeze_max_step": 100}}}, 2)


def _decision_worker(rank, world, port, results):
    _join_gloo(rank, world, port)
    from commodity_bert.train.bookkeeping import Bookkeeping
    with BytesCounter() as wire:
        book = Bookkeeping(device=torch.device("cpu"), world=world, total_batch=8, max_steps=100, log_every=1000,
                           eval_every=0, save_every=4, save_every_minutes=0, time_budget=None, traffic=wire)
        decisions = []
        for step in range(1, 20):
            decision = book.decide(step, signalled=rank == 1 and step >= 6)  # one rank alone is signalled
            decisions.append((step, decision.save, decision.stop))
            if decision.stop:
                break
    results[rank] = decisions
    dist.destroy_process_group()


def test_a_signal_on_one_rank_stops_every_rank_one_step_later():
    """The stop decision's allreduce runs behind the next step instead of blocking every step: a
    signal seen at step 6 by rank 1 alone stops (and saves) every rank after step 7; --save-every
    needs no agreement and saves at step 4 everywhere."""
    results = spawn_ranks(_decision_worker, 2)
    expected = [(step, step == 4, None) for step in range(1, 7)] + [(7, True, "signal")]
    assert results[0] == results[1] == expected


def test_a_killed_compiles_lock_is_removed_and_a_live_one_kept(tmp_path, monkeypatch):
    """DeepSpeed's CPU op compile waits for ever on torch's lock file if a killed compile left it."""
    import subprocess
    import sys

    from commodity_bert.comm.deepspeed_shm import clear_stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    locks = [tmp_path / op / "lock" for op in ("deepspeed_shm_comm", "fused_adam")]
    for lock in locks:
        lock.parent.mkdir()
        lock.touch()  # what a compile killed mid-way leaves: the file, no process holding it
    assert sorted(clear_stale_build_locks()) == locks and not any(lock.exists() for lock in locks)
    lock = locks[0]

    lock.touch()  # a compile in progress: torch's FileBaton keeps the lock's fd open
    holder = subprocess.Popen([sys.executable, "-c", f"import os, time; os.open({str(lock)!r}, os.O_RDONLY); "
                               "print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert clear_stale_build_locks() == [] and lock.exists()
    finally:
        holder.kill()
        holder.wait()

    # the race between ranks of one node: while this one looked for holders, the compile it would
    # have seen released the lock and another rank's took a new one, opened after the look passed
    # its process; that lock is kept
    from commodity_bert.comm import deepspeed_shm

    def look_while_another_compile_takes_the_lock(path):
        path.unlink()
        path.touch()
        return False
    monkeypatch.setattr(deepspeed_shm, "_held_open", look_while_another_compile_takes_the_lock)
    assert clear_stale_build_locks() == [] and lock.exists()
