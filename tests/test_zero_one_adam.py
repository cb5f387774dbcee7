"""0/1 Adam on 2 real gloo ranks: its two schedules (T_v, T_u) as the collectives it makes show
them, the ranks' parameters equal after every sync and apart between, the shared parameters for
evaluation, weight decay from the last sync's parameters, and the launch checks. End to end
through train.py: tests/test_training_paths.py."""
import contextlib

import pytest
import torch
import torch.distributed as dist
from conftest import spawn_ranks
from test_comm import _join_gloo
from torch import nn

from commodity_bert.comm.bytes_counter import BytesCounter
from commodity_bert.optim.precision import current_loss_scale, loss_for_backward
from commodity_bert.optim.zero_one_adam import ZeroOneAdam, step_kinds, variance_updates

FREEZE, KAPPA, SCALER, CLIPPER, STEPS = 12, 4, 4, 4, 28
LR, DECAY = 0.01, 0.1


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(6, 16)
        self.out = nn.Linear(16, 1)
        self.unused = nn.Parameter(torch.ones(4))  # never gets a gradient: only weight decay moves it

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x))).pow(2).mean()


def _flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _worker(rank, world, port, results):
    _join_gloo(rank, world, port)
    torch.manual_seed(0)
    model = TwoLayers()
    optimizer = ZeroOneAdam(model.parameters(), lr=LR, betas=(0.9, 0.9), weight_decay=DECAY, var_freeze_step=FREEZE,
                            var_update_scaler=KAPPA, local_step_scaler=SCALER, local_step_clipper=CLIPPER,
                            scale_block=32)
    engine_flags = []
    optimizer.engine_allreduce = engine_flags.append
    allreduced_next = optimizer.next_step_allreduced()
    per_step, equal, shared_equal, decay_ok = [], [], [], []
    for step in range(1, STEPS + 1):
        torch.manual_seed(1000 * rank + step)  # each rank its own data
        loss = model(torch.randn(8, 6))
        optimizer.zero_grad()
        loss.backward()
        if allreduced_next:  # what DeepSpeed's engine does on a step of T_v
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        if step == FREEZE + 1:
            last_synced, since_sync = model.unused.detach().clone(), 0
        since_sync = since_sync + 1 if step > FREEZE else 0
        with BytesCounter() as wire:
            optimizer.step()
        per_step.append((allreduced_next, wire.calls))
        allreduced_next = engine_flags[-1]
        mine = _flat(model)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        equal.append(all(torch.equal(every[0], e) for e in every))
        if optimizer.frozen and step > FREEZE:
            with optimizer.shared_params(lambda: None):
                shared = _flat(model)
            dist.all_gather(every, shared)
            shared_equal.append(all(torch.equal(every[0], e) for e in every))
            if optimizer.synced_last_step:  # decoupled decay of Λ = Σ lr from the last sync's parameters
                expected = last_synced * (1 - DECAY * LR * since_sync)
                decay_ok.append(float((model.unused.detach() - expected).abs().max()))
                last_synced, since_sync = model.unused.detach().clone(), 0
    results[rank] = {"per_step": per_step, "equal": equal, "shared_equal": shared_equal, "decay": decay_ok,
                     "loss_end": float(loss)}
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    return spawn_ranks(_worker, 2)


def test_the_variance_is_updated_on_t_v_from_allreduced_gradients(results):
    """κ = 4: steps 1-4, then every 2nd step up to the freeze at 12; 1-bit gradients between."""
    assert variance_updates(FREEZE, KAPPA) == 8
    per_step = results[0]["per_step"]
    allreduced = [step for step, (full, _) in enumerate(per_step, 1) if full]
    assert allreduced == [1, 2, 3, 4, 6, 8, 10, 12]
    for step, (full, calls) in enumerate(per_step[:FREEZE], 1):
        assert calls == (0 if full else 4), step  # the 1-bit exchange: 2 all-to-alls, 2 all-gathers
    assert all(results[0]["equal"][:FREEZE]) and all(results[1]["equal"][:FREEZE])


def test_local_steps_sync_on_t_u_and_the_ranks_agree_after_each_sync(results):
    """After the freeze: syncs every step for 4 steps, every 2nd for 4, then every 4th (the clipper)."""
    per_step = results[0]["per_step"]
    syncs = [step for step, (_, calls) in enumerate(per_step, 1) if step > FREEZE and calls]
    assert syncs == [13, 14, 15, 16, 18, 20, 24, 28]
    assert all(calls in (0, 4) for _, calls in per_step[FREEZE:])
    for rank in (0, 1):
        equal = results[rank]["equal"]
        assert [s for s in range(FREEZE + 1, STEPS + 1) if equal[s - 1]] == syncs  # apart between syncs
        assert all(results[rank]["shared_equal"])  # the last sync's parameters, alike on every rank


def test_the_planners_step_kinds_are_what_the_optimizer_sent(results):
    """bert-plan counts 0/1 Adam's traffic with step_kinds: the same schedule the run followed."""
    observed = []
    for step, (full, calls) in enumerate(results[0]["per_step"], 1):
        if step <= FREEZE:
            observed.append("full" if full else "onebit")
        else:
            observed.append("sync" if calls else "local")
    assert list(step_kinds(STEPS, FREEZE, KAPPA, SCALER, CLIPPER)) == observed
    assert observed.count("sync") == 8 and observed.count("onebit") == 4


def test_weight_decay_is_decoupled_from_the_last_syncs_parameters(results):
    for rank in (0, 1):
        assert len(results[rank]["decay"]) == 8
        assert max(results[rank]["decay"]) < 1e-7


def _config(params, **extra):
    return {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "ZeroOneAdam", "params": params}, **extra}


@pytest.mark.parametrize("config,phrase", [
    (_config({}, zero_optimization={"stage": 1}), "ZeroOneAdam cannot run under ZeRO stage 1"),
    (_config({"bias_correction": True}), 'ZeroOneAdam has no bias correction'),
    (_config({"local_step_clipper": 0}), "ZeroOneAdam local_step_clipper 0: give a positive integer"),
    (_config({}, commodity_bert={"diloco": {}}), "DiLoCo and ZeroOneAdam cannot be combined"),
    (_config({}, commodity_bert={"bucketwise_clipping": {"enabled": True}}),
     "bucket-wise clipping and ZeroOneAdam both replace the gradient allreduce"),
])
def test_bad_zero_one_adam_configs_are_refused(config, phrase):
    from commodity_bert.train.launch_checks import LaunchError, check_deepspeed_config
    with pytest.raises(LaunchError) as refused:
        check_deepspeed_config(config, 2)
    assert phrase in str(refused.value)


# ---- the local-step stage under DeepSpeed's fp16/bf16 wrapper: each rank skips its own overflows
E_FREEZE, E_STEPS, E_LR = 4, 16, 1e-3
E_KINDS = list(step_kinds(E_STEPS, E_FREEZE, 2, 2, 4))  # freeze after step 4; syncs every 1, 2, then 4 steps
OVERFLOW_STEP = next(t for t, kind in enumerate(E_KINDS, 1) if kind == "local" and E_KINDS[t] == "local")


def _engine_worker(rank, world, port, results, precision):
    """The mode's hooks around a real DeepSpeed engine, as train.py's loop calls them; rank 1's
    gradient overflows (an inf put into it) at one local step."""
    import os

    on_cuda = torch.cuda.is_available()
    # on one GPU both ranks share device 0 and talk through gloo (NCCL refuses two ranks on one GPU)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK="0" if on_cuda else str(rank), LOCAL_SIZE=str(world))
    import deepspeed

    from commodity_bert.comm import mode as comm_mode
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = TwoLayers()
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              precision: {"enabled": True, **({"loss_scale": 0, "initial_scale_power": 8} if precision == "fp16" else {})},
              "optimizer": {"type": "ZeroOneAdam", "params": {
                  "lr": E_LR, "var_freeze_step": E_FREEZE, "var_update_scaler": 2, "local_step_scaler": 2,
                  "local_step_clipper": 4, "scale_block": 32}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": E_LR,
                                                           "warmup_num_steps": E_STEPS, "warmup_type": "linear"}}}
    from commodity_bert.optim.build import build_optimizer
    from commodity_bert.run_config import RunConfig
    mode = comm_mode.select(config)
    optimizer, parameters = build_optimizer(config, model)
    config = mode.deepspeed_config(RunConfig.parse(config).for_deepspeed(without_optimizer=True))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=parameters,
                                           config=config)
    mode.attach(engine, optimizer, model)
    mode.ready()
    mode.begin(contextlib.nullcontext)
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    scaled = loss_for_backward(engine)  # as train.py: the loss scale DeepSpeed leaves out at ZeRO 0
    rows = []
    for step in range(1, E_STEPS + 1):
        torch.manual_seed(1000 * rank + step)
        x = torch.randn(8, 6).to(engine.device, dtype)
        before = torch.cat([t.detach().reshape(-1).float().cpu() for t in mode.masters.tensors])
        with BytesCounter() as wire:
            mode.start_step(logged=False)
            with mode.micro_batch(True):
                engine.backward(scaled(engine(x).float()))
                if step == OVERFLOW_STEP and rank == 1:
                    model.hidden.weight.grad.view(-1)[0] = float("inf")
            mode.after_backward()
            engine.step()
            mode.after_step(step, last=step == E_STEPS)
        after = torch.cat([t.detach().reshape(-1).float().cpu() for t in mode.masters.tensors])
        rows.append({"calls": wire.calls, "moved": not torch.equal(before, after), "params": after,
                     "schedule": dict(optimizer.schedule), "lr": engine.get_lr()[0],
                     "synced": optimizer.synced_last_step, "loss_scale": current_loss_scale(engine.optimizer)})
    results[rank] = {"rows": rows, "skipped": engine.skipped_steps, "device": str(engine.device)}
    dist.destroy_process_group()


PRECISIONS = [pytest.param("bf16", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="bf16 is tested on CPU")),
              pytest.param("fp16", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                            reason="DeepSpeed's CPU accelerator refuses fp16"))]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_local_steps_send_nothing_and_each_rank_skips_its_own_overflows(precision):
    ranks = spawn_ranks(_engine_worker, 2, precision)
    assert OVERFLOW_STEP > E_FREEZE and E_KINDS[OVERFLOW_STEP - 1] == "local"
    for rank in (0, 1):
        rows = ranks[rank]["rows"]
        for t, (kind, row) in enumerate(zip(E_KINDS, rows), 1):
            if kind == "local":  # no gradient allreduce, no overflow flag: nothing at all
                assert row["calls"] == 0, (rank, t, row["calls"])
            elif kind == "sync":  # the 1-bit exchange (4 collectives), and under fp16 the loss scale
                assert row["calls"] == 4 + (precision == "fp16"), (rank, t, row["calls"])
            elif kind == "onebit":  # the 1-bit exchange and the wrapper's overflow flag
                assert row["calls"] == 5, (rank, t, row["calls"])
            assert row["schedule"]["step"] == t  # the skipped step counts on rank 1 too
    zero, one = ranks[0]["rows"], ranks[1]["rows"]
    assert (ranks[0]["skipped"], ranks[1]["skipped"]) == (0, 1)
    assert zero[OVERFLOW_STEP - 1]["moved"] and not one[OVERFLOW_STEP - 1]["moved"]
    for t, (a, b) in enumerate(zip(zero, one), 1):  # one schedule, one lr, one Λ on both ranks
        assert (a["schedule"], a["lr"], a["synced"]) == (b["schedule"], b["lr"], b["synced"]), t
        if a["synced"]:  # and the same parameters after every sync, the skipped step's too
            assert torch.equal(a["params"], b["params"]), t
    next_sync = next(t for t in range(OVERFLOW_STEP + 1, E_STEPS + 1) if E_KINDS[t - 1] == "sync")
    assert not torch.equal(zero[OVERFLOW_STEP - 1]["params"], one[OVERFLOW_STEP - 1]["params"])
    if precision == "fp16":  # rank 1 halved its scale alone; at the next sync both take it
        assert one[OVERFLOW_STEP - 1]["loss_scale"] == zero[OVERFLOW_STEP - 1]["loss_scale"] / 2
        assert zero[next_sync - 1]["loss_scale"] == one[next_sync - 1]["loss_scale"] == one[OVERFLOW_STEP - 1]["loss_scale"]
