"""DiLoCo's outer loop on 2 real gloo ranks, against the paper's update computed here: the
averaged pseudo-gradient, Nesterov momentum across rounds, the three ways Δ travels and the bytes
each sends, the shared model for evaluation, the rank's own state for a checkpoint, and fp16 under
DeepSpeed's real wrapper, where each rank skips its own overflow steps without a collective.
End to end through train.py: tests/test_training_paths.py."""
import pytest
import torch
import torch.distributed as dist
from conftest import spawn_ranks
from test_precision import TinyEmbeddingModel, _fp16_wrapper, _join

from commodity_bert.collectives.lowbit import BLOCK as INT8_BLOCK
from commodity_bert.comm.bytes_counter import BytesCounter
from commodity_bert.comm.diloco import DEFAULTS, DiLoCo
from commodity_bert.optim.precision import MasterParams

INNER, LR, MOMENTUM = 3, 0.7, 0.9


def _inner_steps(model, optimizer, rank, steps, backward=None):
    """Local SGD steps on this rank's own data: the ranks' models drift apart."""
    for step in range(steps):
        torch.manual_seed(100 * rank + step)
        loss = model(torch.randint(0, 16, (4, 5)))
        optimizer.zero_grad()
        (backward or (lambda x: x.backward()))(loss)
        optimizer.step()


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def _gathered(x: torch.Tensor) -> list[torch.Tensor]:
    every = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(every, x)
    return every


def _rounds_against_reference(rank, compression, results):
    """Two rounds; after each, θ against θ − lr·(Δ̄ + μ·b) with b ← μ·b + Δ̄, Δ̄ from every rank's
    real local parameters; and the bytes of the round's one exchange."""
    torch.manual_seed(0)
    model = TinyEmbeddingModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    outer = DiLoCo(MasterParams(optimizer), {**DEFAULTS, "inner_steps": INNER, "outer_lr": LR,
                                             "outer_momentum": MOMENTUM, "compression": compression})
    theta, velocity = _flat(model.parameters()), None
    errors, sent, calls = [], [], []
    for round_ in range(2):
        _inner_steps(model, optimizer, rank + 2 * round_, INNER)
        local = _flat(model.parameters())
        mean_delta = theta - torch.stack(_gathered(local)).mean(dim=0)
        velocity = mean_delta if velocity is None else MOMENTUM * velocity + mean_delta
        theta = theta - LR * (mean_delta + MOMENTUM * velocity)
        with BytesCounter() as wire:
            outer.outer_step()
        sent.append(wire.total)
        calls.append(wire.calls)
        got = _flat(model.parameters())
        errors.append(float((got - theta).abs().max() / (LR * mean_delta.abs().max())))
        theta = got  # the next round starts from the model every rank holds
    identical = all(torch.equal(g, theta) for g in _gathered(theta))
    results[compression] = {"errors": errors, "sent": sent, "calls": calls, "identical": identical,
                            "numel": outer.numel, "rounds": outer.rounds}


def _shared_model_and_rank_state(rank, results):
    """Mid-round: global_model() shows θ and gives the rank's own parameters back; the rank's state
    restores its parameters and inner optimizer exactly."""
    torch.manual_seed(0)
    model = TinyEmbeddingModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    outer = DiLoCo(MasterParams(optimizer), {**DEFAULTS, "inner_steps": INNER})
    theta = _flat(model.parameters())
    _inner_steps(model, optimizer, rank, 2)
    local = _flat(model.parameters())
    with outer.global_model():
        inside = _flat(model.parameters())
    saved = outer.masters.rank_state()
    torch.save(saved, f"/dev/shm/diloco_test_{rank}.pt")  # through a file, as a checkpoint goes
    _inner_steps(model, optimizer, rank + 7, 1)
    outer.masters.load_rank_state(torch.load(f"/dev/shm/diloco_test_{rank}.pt", weights_only=True))
    restored = _flat(model.parameters())
    step_state = optimizer.state[next(iter(model.parameters()))]["step"]
    results["shared"] = (torch.equal(inside, theta), torch.equal(_flat(model.parameters()), restored),
                         torch.equal(restored, local), float(step_state), not torch.equal(local, theta))


def _fp16_overflow_on_one_rank(rank, results):
    """Under fp16, with no gradient allreduce, an overflow on rank 1 skips its step and halves its
    loss scale alone (no collective in the inner steps); the outer step then puts θ into DeepSpeed's
    fp32 masters and the fp16 model on both ranks alike."""
    torch.manual_seed(0)
    model = TinyEmbeddingModel().half()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = _fp16_wrapper(inner)
    outer = DiLoCo(MasterParams(optimizer), {**DEFAULTS, "inner_steps": INNER})
    skipped = []
    with BytesCounter() as wire:
        for step in range(INNER):
            torch.manual_seed(100 * rank + step)
            loss = model(torch.randint(0, 16, (4, 5))).float() / 64  # no overflow at a scale of 2^16
            optimizer.zero_grad()
            optimizer.backward(loss)
            if rank == 1 and step == 1:
                model.hidden.weight.grad[0, 0] = float("inf")
            skipped.append(bool(optimizer.step()))
        inner_calls = wire.calls
    scale = optimizer.loss_scale_config.cur_scale
    outer.outer_step()
    masters = _flat(outer.masters.tensors)
    fp16 = _flat(model.parameters())
    results["fp16"] = (skipped, scale, inner_calls, torch.equal(masters, outer.start),
                       torch.equal(fp16, masters.half().float()), all(torch.equal(f, fp16) for f in _gathered(fp16)))


def _worker(rank, world, port, shared):
    _join(rank, world, port)
    results = {}
    for compression in ("none", "bf16", "int8"):
        _rounds_against_reference(rank, compression, results)
    _shared_model_and_rank_state(rank, results)
    _fp16_overflow_on_one_rank(rank, results)
    shared[rank] = results
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    return spawn_ranks(_worker, 2)


@pytest.mark.parametrize("compression,tolerance", [("none", 1e-5), ("bf16", 2e-2), ("int8", 2e-2)])
def test_outer_steps_follow_nesterov_on_the_averaged_pseudo_gradient(results, compression, tolerance):
    for rank in (0, 1):
        r = results[rank][compression]
        assert r["rounds"] == 2
        assert max(r["errors"]) < tolerance, r["errors"]
        assert r["identical"]  # every rank starts the next round from the same θ
        assert r["calls"] == ([1, 1] if compression != "int8" else [2, 2])


def test_each_compression_sends_what_it_says(results):
    """2 ranks: a ring allreduce sends (N−1)/N·2 = 1× the buffer; int8 sends half its packed chunks
    in the all-to-all and its own averaged chunk in the all-gather."""
    numel = results[0]["none"]["numel"]
    chunk = -(-numel // (INT8_BLOCK * 2)) * INT8_BLOCK
    packed_chunk = chunk + 4 * chunk // INT8_BLOCK
    assert results[0]["none"]["sent"] == [4 * numel] * 2
    assert results[0]["bf16"]["sent"] == [2 * numel] * 2
    assert results[0]["int8"]["sent"] == [2 * packed_chunk] * 2


def test_the_shared_model_is_shown_and_the_ranks_own_state_restored(results):
    for rank in (0, 1):
        theta_inside, put_back, restored_exactly, adam_steps, drifted = results[rank]["shared"]
        assert drifted and theta_inside and put_back and restored_exactly
        assert adam_steps == 2  # the inner optimizer's own state came back too


def test_fp16_ranks_skip_their_own_overflows_without_a_collective(results):
    skipped0, scale0, calls0, masters0, fp16_0, identical = results[0]["fp16"]
    skipped1, scale1, calls1, masters1, fp16_1, _ = results[1]["fp16"]
    assert skipped0 == [False] * INNER and skipped1 == [False, True, False]
    assert scale1 == scale0 / 2
    assert calls0 == calls1 == 0
    assert masters0 and masters1 and fp16_0 and fp16_1 and identical


# ---- what the launch checks refuse, each with one line naming the fix

def _config(**project):
    return {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
            "commodity_bert": project}


@pytest.mark.parametrize("project,changes,phrase", [
    ({"bucketwise_cliping": {"enabled": True}}, {},
     'unknown key "commodity_bert.bucketwise_cliping" in the DeepSpeed config; the known ones are '
     'activation_checkpointing, attention, balance, bucketwise_clipping, diloco, head_warmup, hierarchy, lamb'),
    ({"diloco": {"inner_step": 50}}, {}, 'unknown key "commodity_bert.diloco.inner_step"'),
    ({"bucketwise_clipping": {"enabled": True, "max_nrom": 1.0}}, {},
     'unknown key "commodity_bert.bucketwise_clipping.max_nrom"'),
    ({"diloco": True}, {}, '"commodity_bert.diloco" must be an object'),
    ({"diloco": {"inner_steps": 0}}, {}, "diloco inner_steps 0: give a positive number of steps"),
    ({"diloco": {"compression": "fp8"}}, {}, "diloco compression 'fp8': give one of none, bf16, int8"),
    ({"diloco": {"outer_momentum": 1.0}}, {}, "diloco outer_momentum 1.0: give a number in [0, 1)"),
    ({"diloco": {}}, {"optimizer": {"type": "OneBitLamb", "params": {"freeze_step": 10}}},
     "DiLoCo and OneBitLamb cannot be combined"),
    ({"diloco": {}, "bucketwise_clipping": {"enabled": True}}, {},
     "DiLoCo and bucket-wise clipping cannot be combined"),
    ({"diloco": {}}, {"optimizer": {"type": "AdamW", "params": {}}, "zero_optimization": {"stage": 1}},
     "DiLoCo cannot run under ZeRO stage 1"),
])
def test_bad_project_blocks_are_refused(project, changes, phrase):
    from commodity_bert.train.launch_checks import LaunchError, check_deepspeed_config
    with pytest.raises(LaunchError) as refused:
        check_deepspeed_config({**_config(**project), **changes}, 2)
    assert phrase in str(refused.value) and "\n" not in str(refused.value)


def test_good_project_blocks_pass():
    from commodity_bert.train.launch_checks import check_deepspeed_config
    check_deepspeed_config(_config(diloco={"inner_steps": 10, "compression": "int8"}), 2)
    check_deepspeed_config(_config(diloco={"enabled": False}, bucketwise_clipping={"enabled": True}), 2)
    adamw = {**_config(diloco={}), "optimizer": {"type": "AdamW", "params": {}}, "bf16": {"enabled": True}}
    check_deepspeed_config(adamw, 2)
