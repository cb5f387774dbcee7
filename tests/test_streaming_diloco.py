"""Streaming DiLoCo's parts (collectives/lowbit.py, comm/diloco.py): the 4- and 8-bit quantization's
error bounds, the low-bit average with error feedback on 2 real gloo ranks, fragments that cover
every parameter of a BERT exactly once, and overlapped fragment updates each applied exactly once,
against the outer step recomputed here. Resuming with an update in flight, through train.py:
MODE_CASES["diloco_streaming"] in tests/test_comm_modes.py."""
import os
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import spawn_ranks
from test_diloco import _flat, _gathered, _inner_steps
from test_precision import TinyEmbeddingModel, _join

from commodity_bert.collectives.lowbit import BLOCK, LowBitAverage, dequantize, levels, quantize
from commodity_bert.comm.bytes_counter import BytesCounter
from commodity_bert.comm.diloco import DEFAULTS, DiLoCo, split_into_fragments
from commodity_bert.model.bert import build_config, build_model
from commodity_bert.optim.precision import MasterParams
from commodity_bert.train.failures import lost_peer_line


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantization_error_bounds(bits):
    torch.manual_seed(0)
    x = torch.randn(BLOCK * 40) * torch.logspace(-3, 1, 40).repeat_interleave(BLOCK)  # blocks of every scale
    scales = x.view(-1, BLOCK).abs().amax(dim=1) / levels(bits)
    step = scales.repeat_interleave(BLOCK)
    packed, stands_for = quantize(x, bits)
    # the integers, `bits` each, then one fp32 scale a block
    assert packed.numel() == x.numel() * bits // 8 + 4 * x.numel() // BLOCK and packed.dtype == torch.uint8
    back = dequantize(packed, x.numel(), bits)
    assert torch.equal(back, stands_for)  # what the receiver rebuilds is what the sender counted
    assert bool(((back - x).abs() <= step / 2 * (1 + 1e-5)).all())  # nearest: half a level at most
    generator = torch.Generator().manual_seed(1)
    draws = torch.stack([dequantize(quantize(x, bits, generator)[0], x.numel(), bits) for _ in range(400)])
    assert bool(((draws - x).abs() <= step * (1 + 1e-5)).all())  # stochastic: within one level
    # unbiased: the mean of 400 draws is within 5 standard errors of x (a draw's spread ≤ step/2;
    # at 4, one value of the 10,240 in int2, whose draws spread most, fell outside)
    assert bool(((draws.mean(dim=0) - x).abs() <= 5 * step / 2 / 400 ** 0.5 + 1e-7).all())


def _low_bit_worker(rank, world, port, results):
    _join(rank, world, port)
    torch.manual_seed(rank)
    x = torch.randn(3000) * (rank + 1) + rank  # not a multiple of the blocks: padded
    exact = torch.stack(_gathered(x)).mean(dim=0)
    out = {}
    for name, kwargs in (("int4", {}), ("int4_ef", {"error_feedback": True}),
                         ("int4_stochastic_ef", {"error_feedback": True, "rounding": "stochastic"}),
                         ("int8", {"bits": 8})):
        average = LowBitAverage(x.numel(), kwargs.pop("bits", 4), "cpu", **kwargs)
        outputs = [average(x) for _ in range(20)]
        running = torch.stack(outputs).mean(dim=0)
        out[name] = {"one": float((outputs[0] - exact).norm() / exact.norm()),
                     "mean_of_20": float((running - exact).norm() / exact.norm()),
                     "alike": all(torch.equal(o, outputs[-1]) for o in _gathered(outputs[-1]))}
    results[rank] = out
    dist.destroy_process_group()


def test_low_bit_average_and_its_error_feedback():
    results = spawn_ranks(_low_bit_worker, 2)
    for rank in (0, 1):
        r = results[rank]
        assert all(v["alike"] for v in r.values())  # every rank rebuilds the same average
        print(rank, {k: (round(v["one"], 4), round(v["mean_of_20"], 4)) for k, v in r.items()})
        assert r["int8"]["one"] < 0.015 and r["int4"]["one"] < 0.25, r
        # without feedback the same error comes back every call; with it, the mean converges
        assert r["int4"]["mean_of_20"] == pytest.approx(r["int4"]["one"], rel=1e-6)
        assert r["int4_ef"]["mean_of_20"] < r["int4"]["one"] / 5, r
        assert r["int4_stochastic_ef"]["mean_of_20"] < r["int4"]["one"] / 3, r


@pytest.mark.parametrize("count", [2, 3])
def test_fragments_cover_every_parameter_exactly_once(count):
    model = build_model(build_config("tiny", 512), nsp=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    masters = MasterParams(optimizer)
    names = {p: n for n, p in model.named_parameters()}
    fragments = split_into_fragments(masters, names, count)
    covered = [torch.zeros(t.numel(), dtype=torch.int32) for t in masters.tensors]
    for pieces in fragments:
        for index, start, end in pieces:
            covered[index][start:end] += 1
    assert all(bool((c == 1).all()) for c in covered)
    layers = build_config("tiny", 512).num_hidden_layers
    for layer in range(layers):  # strided: every tensor of layer l in fragment l mod count
        where = {f for f, pieces in enumerate(fragments) for index, _, _ in pieces
                 if f".layer.{layer}." in names[masters.tensors[index]]}
        assert where == {layer % count}
    sizes = [sum(e - s for _, s, e in pieces) for pieces in fragments]
    print(f"{count} fragments of {sizes} parameters")
    assert all(sizes)


def _streaming_worker(rank, world, port, results):
    """fragments 2, overlap 1, inner steps 4 (round ends: fragment 0 at 4, 8; fragment 1 at 2, 6, 10),
    11 steps, the last ending every round. Each fragment's averaged Δ is recorded as the exchange
    returns it; θ and b are recomputed here from those, applied at the step they are due."""
    _join(rank, world, port)
    torch.manual_seed(0)
    model = TinyEmbeddingModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    settings = {**DEFAULTS, "inner_steps": 4, "fragments": 2, "overlap_steps": 1, "merge": 0.5,
                "outer_lr": 0.7, "outer_momentum": 0.9}
    names = {model.word_embeddings.weight: "bert.encoder.layer.0.w", model.hidden.weight: "bert.encoder.layer.1.w",
             model.hidden.bias: "bert.encoder.layer.1.b"}  # the head: to the smaller fragment
    outer = DiLoCo(MasterParams(optimizer), settings, names=names)
    averaged = {p: [] for p in range(2)}
    for p, fragment in enumerate(outer.fragments):
        exchange = fragment.average
        fragment.average = lambda x, p=p, exchange=exchange: averaged[p].append(exchange(x)) or averaged[p][-1]
    theta, velocity = _flat(model.parameters()), torch.zeros_like(_flat(model.parameters()))
    due = {}  # step → [(fragment, Δ index)]
    ends = {0: [4, 8], 1: [2, 6, 10]}
    for step in range(1, 12):
        _inner_steps(model, optimizer, rank + 10 * step, 1)
        before = _flat(model.parameters())
        outer.after_step(step, last=step == 11)
        # the reference: what should have been applied at this step
        applied = sorted(due.pop(step, [])) if step < 11 else sorted(x for v in due.values() for x in v)
        if step == 11:
            due.clear()
        after = before.clone()
        for p, k in applied + ([(0, len(ends[0])), (1, len(ends[1]))] if step == 11 else []):
            where = outer.fragments[p].flat
            delta = averaged[p][k]
            offset = 0
            for a, b in where:
                d = delta[offset: offset + b - a]
                offset += b - a
                velocity[a:b] = 0.9 * velocity[a:b] + d
                theta[a:b] -= 0.7 * (d + 0.9 * velocity[a:b])
                after[a:b] = theta[a:b] if step == 11 else 0.5 * theta[a:b] + 0.5 * before[a:b]
        for p in (0, 1):  # the k-th round end's exchange is the k-th the fragment records
            if step in ends[p]:
                due.setdefault(step + 1, []).append((p, ends[p].index(step)))
        results.setdefault("errors", []).append(float((_flat(model.parameters()) - after).abs().max()))
    results["exchanges"] = {p: len(v) for p, v in averaged.items()}
    results["theta"] = float((outer.start - theta).abs().max())
    results["rounds"] = outer.rounds
    results["identical"] = all(torch.equal(g, _flat(model.parameters())) for g in _gathered(_flat(model.parameters())))
    outer.executor.shutdown()
    dist.destroy_process_group()


def _streaming_entry(rank, world, port, shared):
    results = {}
    _streaming_worker(rank, world, port, results)
    shared[rank] = results


def test_overlapped_fragment_updates_are_applied_once_each():
    results = spawn_ranks(_streaming_entry, 2)
    for rank in (0, 1):
        r = results[rank]
        assert r["exchanges"] == {0: 3, 1: 4}  # its round ends, and the last step's
        assert max(r["errors"]) < 1e-6, r["errors"]
        assert r["theta"] < 1e-6 and r["rounds"] == pytest.approx(7 / 2)
        assert r["identical"]  # the last step leaves every rank with θ


def _late_worker(rank, world, port, results, late_s, timeout_s):
    """H = 4, overlap 3, one fragment, 8 steps: rank 1 reaches its round end at step 4 `late_s`
    late. Rank 0 records how long each of its outer calls took, or the error that ended it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    torch.manual_seed(0)
    model = TinyEmbeddingModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    settings = {**DEFAULTS, "inner_steps": 4, "overlap_steps": 3, "outer_lr": 1.0, "outer_momentum": 0.0}
    outer = DiLoCo(MasterParams(optimizer), settings)
    own_group = outer.groups[0]._get_backend(torch.device("cpu")).options._timeout
    wire = BytesCounter().install()
    waits, sent, started = {}, {}, time.perf_counter()
    try:
        for step in range(1, 9):
            _inner_steps(model, optimizer, rank + 10 * step, 1)
            if rank == 1 and step == 4:
                time.sleep(late_s)
            started, before = time.perf_counter(), wire.snapshot()["bytes_sent"]
            outer.after_step(step, last=step == 8)
            waits[step] = time.perf_counter() - started
            time.sleep(0.05)  # the exchange in flight, if any, ends meanwhile
            sent[step] = wire.snapshot()["bytes_sent"] - before
        results[rank] = {"waits": waits, "sent": sent, "own_group_timeout": own_group.total_seconds(),
                         "identical": all(torch.equal(g, outer.start) for g in _gathered(outer.start))}
    except Exception as exc:  # noqa: BLE001 - what train.py would print of it
        results[rank] = {"waits": waits, "failed_after_s": time.perf_counter() - started,
                         "line": lost_peer_line(exc, str(rank), "host") or repr(exc),
                         "own_group_timeout": own_group.total_seconds()}
    sys.stdout.flush()
    os._exit(0)  # a rank whose peer is gone cannot leave the group politely


def test_a_worker_late_by_less_than_the_overlap_costs_the_others_nothing():
    """The stated rule (docs/slow_links.md): a fragment's update is needed τ steps after its round
    ends, so a peer late by less than that is waited for by nobody; later, the others wait at the
    step the update is due, and only there."""
    late = 2.0
    r = spawn_ranks(_late_worker, 2, late, 60)[0]
    print(r["waits"])
    assert sum(r["waits"][s] for s in (4, 5, 6)) < late / 4  # the exchange started and ran meanwhile
    assert r["waits"][7] > late / 2  # due at step 4 + 3: the wait is here
    assert r["identical"]
    _bytes_counted_when_applied(r["sent"])


def _bytes_counted_when_applied(sent: dict) -> None:
    """The exchange started at step 4 counts at its due step 7, the last step's synchronous
    round in step 8."""
    assert all(sent[s] == 0 for s in (1, 2, 3, 4, 5, 6)), sent
    assert sent[7] > 0 and sent[8] == sent[7], sent


def test_an_overlapped_exchange_counts_its_bytes_in_the_step_that_applies_it():
    """The bytes of an overlapped exchange fall in the step that applies it, on time (here) or
    late (the test above), not in whichever logged step is open when the background thread ends:
    a resumed run's metrics then equal the uninterrupted run's."""
    r = spawn_ranks(_late_worker, 2, 0.0, 60)[0]
    print(r["sent"])
    _bytes_counted_when_applied(r["sent"])


def test_a_worker_that_hangs_stops_the_others_within_the_collective_timeout():
    """The background exchange runs on a group of its own; made without a timeout, torch would give
    it 30 minutes whatever --dist-timeout-minutes says. Beyond the timeout the rank fails with the
    line train.py prints, and the relaunch resumes (tests/test_multihost.py)."""
    r = spawn_ranks(_late_worker, 2, 10.0, 4)[0]
    assert r["own_group_timeout"] == 4
    assert 3 < r["failed_after_s"] < 20, r
    assert r["line"].startswith("train.py: error: rank 0 on host waited for a peer longer than the collective "
                                "timeout ("), r["line"]
