"""DiLoCo's sparse pseudo-gradients (collectives/sparse.py): the top-k coding's payload and bounds,
and the all-gathered average on 2 real gloo ranks against a dense reference built here from what
each rank sent; the choice between the sparse and the dense exchange by bytes. A resume with a
sparse update in flight, through train.py: MODE_CASES["diloco_sparse"] (tests/test_comm_modes.py);
bytes on the wire against eth0: tests/test_multihost.py."""
import pytest
import torch
import torch.distributed as dist
from conftest import rows, spawn_ranks
from test_diloco import _gathered
from test_precision import _join

from commodity_bert.collectives.lowbit import dense_bytes
from commodity_bert.collectives.sparse import (
    CHUNK,
    SparseAverage,
    decode_into,
    encode,
    kept_per_chunk,
    payload_bytes,
    sparse_bytes,
)
from commodity_bert.comm.bytes_counter import BytesCounter
from commodity_bert.comm.diloco import DEFAULTS, DiLoCo
from commodity_bert.optim.precision import MasterParams


@pytest.mark.parametrize("density,bits", [(0.01, 2), (0.05, 4)])
def test_the_top_k_of_each_chunk_coded_within_a_level(density, bits):
    torch.manual_seed(0)
    x = torch.randn(CHUNK * 6) * torch.logspace(-3, 1, 6).repeat_interleave(CHUNK)  # chunks of every scale
    payload, stands_for = encode(x, density, bits)
    assert payload.dtype == torch.uint8 and payload.numel() == payload_bytes(x.numel(), density, bits)
    back = torch.zeros_like(x)
    decode_into(back, payload, density, bits)
    assert torch.equal(back, stands_for)  # what the receivers rebuild is what the sender counted
    k, top = kept_per_chunk(density), 2 ** (bits - 1)
    for chunk, sent in zip(x.view(-1, CHUNK), stands_for.view(-1, CHUNK)):
        kept = sent != 0
        assert int(kept.sum()) == k
        assert chunk.abs()[kept].min() >= chunk.abs()[~kept].max()  # the largest k, no other
        assert bool((torch.sign(sent[kept]) == torch.sign(chunk[kept])).all())
        scale = chunk.abs()[kept].max()
        assert bool(((sent[kept] - chunk[kept]).abs() <= scale / top * (1 + 1e-5)).all())  # within a level
        assert len(set(sent[kept].abs().tolist())) <= top  # M magnitudes a chunk


def _sparse_worker(rank, world, port, results):
    _join(rank, world, port)
    torch.manual_seed(rank)
    x = torch.randn(3 * CHUNK + 100) * (rank + 1) + rank  # not a multiple of the chunks: padded
    exact = torch.stack(_gathered(x)).mean(dim=0)
    average = SparseAverage(x.numel(), 0.05, 2, "cpu")
    out = {"identity": [], "reference": [], "bound": [], "alike": True}
    outputs = []
    for _ in range(40):
        before = average.residual.clone()
        wanted = before.clone()
        wanted[: x.numel()] += x
        _, sent = encode(wanted, 0.05, 2)  # what this rank sends, recomputed here
        with BytesCounter() as wire:
            output = average(x)
        # what is sent plus the new residual is the input plus the old residual
        out["identity"].append(float((sent + average.residual - wanted).abs().max()))
        # the dense reference: the mean of every rank's sent values
        reference = torch.stack(_gathered(sent)).mean(dim=0)[: x.numel()]
        out["reference"].append(float((output - reference).abs().max()))
        # the average within the coding's bound of the mean of what each rank wanted to send, sparsified
        top_k = torch.where(sent != 0, wanted, torch.zeros_like(wanted))
        scales = wanted.view(-1, CHUNK).abs().amax(dim=1).repeat_interleave(CHUNK)  # ≥ each chunk's kept
        bound = torch.stack(_gathered(scales / 2)).mean(dim=0)[: x.numel()]
        out["bound"].append(bool(((output - torch.stack(_gathered(top_k)).mean(dim=0)[: x.numel()]).abs()
                                  <= bound * (1 + 1e-5)).all()))
        out["alike"] &= all(torch.equal(o, output) for o in _gathered(output))
        outputs.append(output)
    out["bytes"] = wire.total
    out["one"] = float((outputs[0] - exact).norm() / exact.norm())
    out["mean_of_40"] = float((torch.stack(outputs).mean(dim=0) - exact).norm() / exact.norm())
    # the exchange DiLoCo takes: sparse at 5% in 2 bits on 2 ranks; dense int4 where 50% in 4 bits would cost more
    model = torch.nn.Linear(500, 200)  # 100,200 values: 25 chunks (a payload pads to whole chunks)
    masters = MasterParams(torch.optim.SGD(model.parameters(), lr=0.1))
    chosen = {}
    for density, bits in ((0.05, 2), (0.5, 4)):
        outer = DiLoCo(masters, {**DEFAULTS, "compression": "sparse", "error_feedback": True, "density": density,
                                 "value_bits": bits})
        chosen[density] = (outer.sparse_exchange, type(outer.fragments[0].average).__name__, outer.describe())
    out["chosen"] = chosen
    results[rank] = out
    dist.destroy_process_group()


def test_the_sparse_average_against_a_dense_reference():
    results = spawn_ranks(_sparse_worker, 2)
    for rank in (0, 1):
        r = results[rank]
        print(rank, {k: r[k] for k in ("one", "mean_of_40", "bytes")}, r["chosen"])
        assert max(r["identity"]) < 1e-5 and max(r["reference"]) < 1e-6 and all(r["bound"]) and r["alike"]
        # one payload to the one other rank: offsets, codes, scales
        assert r["bytes"] == payload_bytes(3 * CHUNK + 100, 0.05, 2)
        # 5% a call: one average is far off, the residual brings what was held back in later calls
        assert r["mean_of_40"] < r["one"] / 3, r
        assert r["chosen"][0.05][:2] == (True, "SparseAverage") and "all-gathered" in r["chosen"][0.05][2]
        assert r["chosen"][0.5][:2] == (False, "LowBitAverage") and "as dense int4" in r["chosen"][0.5][2]


def test_the_cheaper_exchange_by_bytes():
    """The all-gather's bytes grow with the workers, the dense exchange's hardly: at 1% in 2 bits
    sparse sends fewer up to 28 workers (a payload is 0.0185 byte a value to each of W − 1 peers,
    the dense int2 exchange 0.53 · (W − 1) / W); at 5% in 4 bits up to 10."""
    params = 11_000_000
    for density, bits, last in ((0.01, 2, 28), (0.05, 4, 10)):
        cheaper = [w for w in range(2, 64) if sparse_bytes(params, density, bits, w) <= dense_bytes(params, bits, w)]
        assert cheaper == list(range(2, last + 1)), (density, bits, cheaper[-1])
    assert payload_bytes(params, 0.01, 2) < dense_bytes(params, 2, 2) / 10


def test_a_sparse_run_says_its_exchange_and_what_it_sent(mode_run):
    """MODE_CASES["diloco_sparse"]'s run (tiny, 2 ranks, the top 5% in 2 bits, 2 fragments each
    exchanged behind 2 inner steps): the rows say the payloads are all-gathered and, from the first
    update applied (step 4: the round that ended at 2) on, the share of the pending update its
    round sent: above nothing, below all of it (none while the pending update is zero: the first
    steps' lr is 0 or nearly)."""
    logged = {r["step"]: r for r in rows(mode_run("diloco_sparse").whole) if "loss" in r}
    assert all(r["sparse_exchange"] is True for r in logged.values())
    assert [logged[step]["sparse_sent_share"] for step in (1, 2, 3)] == [None] * 3
    shares = [r["sparse_sent_share"] for step, r in logged.items() if step >= 4]
    print(shares)
    assert shares[-1] is not None and all(0 < s < 1 for s in shares if s is not None)
    assert len({s for s in shares if s is not None}) >= 2
