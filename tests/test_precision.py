"""The fp16/bf16 logic against DeepSpeed's real FP16_UnfusedOptimizer, built directly on the CPU
(DeepSpeed's CPU accelerator refuses fp16 in the engine, so these pieces are tested here and
end to end on a GPU): the loss scale read, overflow steps, unscaling in bucket-wise clipping,
1-bit LAMB's row mask and DeepSpeed's priming step. On 2 real gloo ranks."""
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, spawn_ranks
from torch import nn

FREEZE = 3


class TinyEmbeddingModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(16, 8)
        self.hidden = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, ids):
        return self.out(torch.tanh(self.hidden(self.word_embeddings(ids)))).pow(2).mean()


def _join(rank, world, port):
    # on a one-GPU machine every rank shares device 0 (gloo)
    local = rank % torch.cuda.device_count() if torch.cuda.is_available() else rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(local))
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


def _fp16_wrapper(optimizer, dtype=torch.float16, clip_grad=0.0):
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    dynamic = dtype == torch.float16
    return FP16_UnfusedOptimizer(optimizer, low_precision_dtype=dtype, dynamic_loss_scale=dynamic,
                                 dynamic_loss_args={"init_scale": 2.0**16, "scale_window": 1000, "min_scale": 1.0,
                                                    "delayed_shift": 2, "consecutive_hysteresis": False}
                                 if dynamic else None, clip_grad=clip_grad, verbose=False)


def _loss_scale_and_overflow(results):
    from deepspeed.runtime.engine import DeepSpeedEngine

    from commodity_bert.optim.lamb import Lamb
    from commodity_bert.optim.precision import current_loss_scale
    model = nn.Linear(4, 4).half()
    optimizer = _fp16_wrapper(Lamb(model.parameters(), lr=0.1))
    engines_view = DeepSpeedEngine._get_optimizer_loss_scale(SimpleNamespace(optimizer=optimizer))
    before = current_loss_scale(optimizer)
    results["scale"] = (before, engines_view, getattr(optimizer, "cur_scale", 1.0))
    weights = model.weight.detach().clone()
    optimizer.backward(model(torch.ones(2, 4).half()).float().sum())
    model.weight.grad[0, 0] = math.inf
    overflow = optimizer.step()
    results["overflow"] = (bool(overflow), torch.equal(model.weight, weights), current_loss_scale(optimizer),
                           DeepSpeedEngine._get_optimizer_loss_scale(SimpleNamespace(optimizer=optimizer)))


def _bucketwise_under_loss_scale(rank, world, results):
    """Clipping each bucket on the loss-scaled fp16 gradients must clip the unscaled ones."""
    from commodity_bert.comm.bucketwise import BucketwiseClipAllreduce
    from commodity_bert.optim.lamb import Lamb
    from commodity_bert.optim.precision import current_loss_scale
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).half()
    optimizer = _fp16_wrapper(Lamb(model.parameters(), lr=0.1))
    params = list(model.parameters())
    max_norm = 0.05
    clipper = BucketwiseClipAllreduce(params, bucket_mb=64 * 64 * 2 / 2**20, max_norm=max_norm,
                                      loss_scale=lambda: current_loss_scale(optimizer))
    torch.manual_seed(1 + rank)
    x = torch.randn(16, 64).half()
    clipper.start_boundary_backward()
    optimizer.backward(model(x).float().pow(2).mean())
    scale = current_loss_scale(optimizer)
    local = [p.grad.float() / scale for p in params]  # what this rank computed, unscaled
    clipper.finish()
    got = [p.grad.float() / scale for p in params]
    # reference in fp32: clip every bucket of every rank's unscaled gradient, then average
    limit = max_norm / math.sqrt(len(clipper.buckets))
    index = {id(p): i for i, p in enumerate(params)}
    expected = [g.clone() for g in local]
    for bucket in clipper.buckets:
        norm = torch.linalg.vector_norm(torch.stack([local[index[id(p)]].norm() for p in bucket]))
        for p in bucket:
            expected[index[id(p)]] *= min(1.0, limit / float(norm))
    for g in expected:
        dist.all_reduce(g)
        g /= world
    clipped_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in local])))
    results["bucketwise"] = (len(clipper.buckets), scale, clipped_norm,
                             max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, expected)))


def _onebit_row_mask_under_bf16(rank, world, results):
    """A row of an embedding first seen after the freeze must not move (its frozen variance is ~0)."""
    from commodity_bert.optim.build import build_optimizer
    torch.manual_seed(0)
    model = TinyEmbeddingModel().to(torch.bfloat16)
    config = {"optimizer": {"type": "OneBitLamb", "params": {"lr": 0.01, "freeze_step": FREEZE,
                                                             "weight_decay": 0.01}}}
    inner, _ = build_optimizer(config, model)
    optimizer = _fp16_wrapper(inner, dtype=torch.bfloat16)
    results["primed_steps"] = inner.step_count  # DeepSpeed's priming step must not count
    table = model.word_embeddings.weight
    start = table.detach().clone()
    for step in range(1, FREEZE + 4):
        seen = [0, 1, 2] if step <= FREEZE else [0, 1, 2, 5]  # row 5 first appears after the freeze
        loss = model(torch.tensor([seen, seen]))
        optimizer.zero_grad()
        optimizer.backward(loss)
        if step <= FREEZE:  # DeepSpeed's allreduce in warmup; after the freeze 1-bit LAMB's own
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        optimizer.step()
    results["row_mask"] = (inner.frozen, inner.step_count, float((table[5] - start[5]).abs().max()),
                           float((table[0] - start[0]).abs().max()))


def _one_pass_against_deepspeeds_step(results):
    """DeepSpeed's FP16_UnfusedOptimizer step and the one-pass step of the same wrapper
    (optim/precision.py), side by side from the same bf16 weights and gradients."""
    import sys
    sys.path.insert(0, str(REPO / "benchmarks"))
    from master_step_ops import CountOps

    from commodity_bert.optim.lamb import Lamb
    from commodity_bert.optim.precision import one_pass_master_step

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(16, 16) for _ in range(12)]).to(torch.bfloat16)

    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for name, make in (("lamb", lambda ps: Lamb(ps, lr=0.01, weight_decay=0.01)),
                       ("adamw", lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.01))):
        for clip in (0.0, 0.05):
            runs = []
            for one_pass in (False, True):
                net = model()
                optimizer = _fp16_wrapper(make(list(net.parameters())), dtype=torch.bfloat16, clip_grad=clip)
                if one_pass:
                    assert one_pass_master_step(SimpleNamespace(optimizer=optimizer))
                ops, norms = [], []
                for step in range(4):
                    net(x).float().pow(2).mean().backward()
                    if step == 3:  # an inf gradient: the step is skipped, nothing moves
                        net[0].weight.grad[0, 0] = math.inf
                    before = [p.detach().clone() for p in net.parameters()]
                    with CountOps() as counted:
                        overflow = optimizer.step()
                    ops.append((counted.ops, counted.syncs))
                    norms.append(optimizer._global_grad_norm)
                    optimizer.zero_grad()
                unmoved = all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
                masters = [p.detach().clone() for g in optimizer.fp32_groups for p in g]
                runs.append({"params": [p.detach().clone() for p in net.parameters()], "masters": masters,
                             "ops": ops[1][0], "syncs": ops[1][1], "norms": norms, "skipped": (bool(overflow), unmoved)})
            results[f"one_pass_{name}_clip{clip}"] = runs


def _worker(rank, world, port, shared):
    _join(rank, world, port)
    results = {}
    if rank == 0:
        _loss_scale_and_overflow(results)
        _one_pass_against_deepspeeds_step(results)
    _bucketwise_under_loss_scale(rank, world, results)
    _onebit_row_mask_under_bf16(rank, world, results)
    shared[rank] = results
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    """{rank: what that rank measured}, from one spawn of 2 ranks for all the tests here."""
    if torch.cuda.is_available():  # DeepSpeed's accelerator is then CUDA: the wrapper refuses CPU tensors
        pytest.skip("the wrapper is built on CPU tensors here; on a GPU the engine tests below cover fp16")
    return spawn_ranks(_worker, 2)


def test_loss_scale_is_read_as_deepspeed_reads_it(results):
    ours, deepspeeds, old_read = results[0]["scale"]
    assert ours == deepspeeds == 2.0**16
    assert old_read == 1.0  # what train.py logged before: getattr(optimizer, "cur_scale", 1.0)


def test_overflow_step_is_skipped_and_the_scale_halves(results):
    overflow, unchanged, scale, deepspeeds = results[0]["overflow"]
    assert overflow and unchanged
    assert scale == deepspeeds == 2.0**15


def test_bucketwise_clipping_unscales_before_measuring_the_norm(results):
    for rank in (0, 1):
        buckets, scale, local_norm, error = results[rank]["bucketwise"]
        assert buckets >= 3 and scale == 2.0**16
        assert local_norm > 0.05  # clipping really happens on this rank
        assert error < 2e-3, error  # fp16 gradients; with the scale left in they were ~2^16 too small


def test_onebit_lamb_row_mask_applies_under_bf16_and_priming_does_not_count(results):
    for rank in (0, 1):
        r = results[rank]
        assert r["primed_steps"] == 0
        frozen, steps, unseen_row_moved, seen_row_moved = r["row_mask"]
        assert frozen and steps == FREEZE + 3
        assert unseen_row_moved == 0.0
        assert seen_row_moved > 0.0


@pytest.mark.parametrize("case", ["lamb_clip0.0", "lamb_clip0.05", "adamw_clip0.0", "adamw_clip0.05"])
def test_the_one_pass_master_step_updates_as_deepspeeds_wrapper_does(results, case):
    """bf16 at ZeRO 0 (LAMB, AdamW): the same weights after three steps, bit for bit without
    clipping and within the norm's rounding with it; an inf gradient skipped by both; and a
    fraction of the operations (kernels on a device: DeepSpeed's runs several per tensor) and one
    host sync where DeepSpeed's takes one per tensor."""
    deepspeeds, one_pass = results[0][f"one_pass_{case}"]
    exact = case.endswith("clip0.0")
    for a, b in zip(deepspeeds["params"] + deepspeeds["masters"], one_pass["params"] + one_pass["masters"]):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert deepspeeds["norms"][:3] == pytest.approx(one_pass["norms"][:3], rel=1e-5)
    if not exact:
        assert deepspeeds["norms"][0] > 0.05  # so the clipped cases clipped
    assert deepspeeds["norms"][3] == one_pass["norms"][3] == math.inf
    assert deepspeeds["skipped"] == one_pass["skipped"] == (True, True)
    print(f"{case}: {deepspeeds['ops']} operations and {deepspeeds['syncs']} host syncs a step in DeepSpeed's "
          f"wrapper, {one_pass['ops']} and {one_pass['syncs']} in one pass")
    # 12 layers, 24 tensors: DeepSpeed's wrapper spends over 20 operations and a sync on each
    assert deepspeeds["ops"] - one_pass["ops"] > 20 * 24, (one_pass["ops"], deepspeeds["ops"])
    assert deepspeeds["syncs"] - one_pass["syncs"] >= 24  # torch's AdamW on a CPU reads its step count per tensor
    assert one_pass["syncs"] == 1 or case.startswith("adamw")


def test_a_bf16_config_on_a_cpu_without_native_bf16_is_named_with_its_fp32_twin():
    from commodity_bert.optim.precision import cpu_bf16_warning
    epyc = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"          # no AVX-512 BF16, no AMX
    sapphire = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n"
    zen4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
    shipped = REPO / "ds_configs" / "cpu_quickstart_lamb_bf16.json"
    config = json.loads(shipped.read_text())
    warning = cpu_bf16_warning(str(shipped), config, epyc)
    assert "no native bf16" in warning and "cpu_quickstart_lamb_fp32.json" in warning and "\n" not in warning
    assert cpu_bf16_warning(str(shipped), config, sapphire) is None
    assert cpu_bf16_warning(str(shipped), config, zen4) is None
    fp32 = REPO / "ds_configs" / "cpu_quickstart_lamb_fp32.json"
    assert cpu_bf16_warning(str(fp32), json.loads(fp32.read_text()), epyc) is None
    # a config of the user's own with no fp32 twin: the setting to change
    own = cpu_bf16_warning("/tmp/mine.json", {"bf16": {"enabled": True}}, epyc)
    assert own.endswith('set "bf16": {"enabled": false}')


def _sgd_engine_worker(rank, world, port, results, precision):
    """One SGD step of a real engine on the GPU in `precision`: the update is lr × the gradient, so
    a gradient that reached the optimizer at the wrong scale shows as an update that far off."""
    _join(rank, world, port)
    import deepspeed

    from commodity_bert.optim.precision import loss_for_backward
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              **({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}} if precision == "fp16" else {})}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(engine.device)
    if precision == "fp16":
        x = x.half()
    masters = (engine.optimizer.fp32_groups[0] if precision == "fp16" else list(model.parameters()))
    before = torch.cat([p.detach().float().reshape(-1) for p in masters]).cpu()
    engine.backward(loss_for_backward(engine)(engine(x).float().pow(2).mean()))
    engine.step()
    after = torch.cat([p.detach().float().reshape(-1) for p in masters]).cpu()
    results[rank] = {"update": after - before, "skipped": engine.skipped_steps}
    dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="DeepSpeed's CPU accelerator refuses fp16")
def test_fp16_gradients_reach_the_optimizer_at_their_true_scale():
    """DeepSpeed 0.19's engine.backward leaves the loss unscaled under fp16 at ZeRO stage 0 while its
    wrapper divides the gradients by the loss scale (optim/precision.py): the update was 65,536
    times too small until train.py scaled the loss itself."""
    fp32 = spawn_ranks(_sgd_engine_worker, 1, "fp32")[0]
    fp16 = spawn_ranks(_sgd_engine_worker, 1, "fp16")[0]
    assert fp16["skipped"] == 0
    ratio = float(fp16["update"].norm() / fp32["update"].norm())
    assert 0.97 < ratio < 1.03, ratio
    assert torch.allclose(fp16["update"], fp32["update"], rtol=0.05, atol=1e-4)
