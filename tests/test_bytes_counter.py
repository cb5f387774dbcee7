"""BytesCounter on 3 real gloo ranks: every collective, with its group, root and peers given by
position or by keyword, on a subgroup that leaves rank 2 out, and the object collectives, each
rank's sent and received counts against the volumes of the model in BytesCounter's docstring,
and over the ranks the received bytes against the sent."""
import pickle

import pytest

import torch
import torch.distributed as dist
from conftest import spawn_ranks
from test_comm import _join_gloo
from torch.distributed import distributed_c10d as c10d

from commodity_bert.comm.bytes_counter import BytesCounter

WORLD = 3
NUMEL = 600            # float32: 2400 bytes, a multiple of 2 and 3 (equal chunks)
SIZE = NUMEL * 4
SUB = (0, 1)           # the subgroup; rank 2 is outside it
NODE_OF = [0, 0, 1]    # ranks 0 and 1 share a node: the subgroup sends nothing between nodes
WRAPPED = ("all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_single",
           "all_gather_into_tensor", "_all_gather_base", "all_gather_coalesced", "reduce_scatter",
           "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all_single",
           "all_to_all", "gather", "scatter", "send", "isend", "recv", "irecv", "batch_isend_irecv",
           "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
           "send_object_list", "recv_object_list")


def f32(numel=NUMEL, value=1.0):
    return torch.full((numel,), value)


def split_rows(sender, receiver):
    """all_to_all_single with uneven splits: rows of 4 floats that `sender` sends to `receiver`."""
    return sender + 2 * receiver + 1


def gathered_obj(rank):
    return "x" * (100 * (rank + 1))    # pickles of different sizes: the padding to the largest counts


BROADCAST_OBJS = ["hello", {"step": 3, "lr": [0.1, 0.2]}]
SCATTER_OBJS = [("r", 0), ("r", 1, "longer"), ("r", 2, "longest" * 3)]
SENT_OBJS = [list(range(50)), "tail"]


def pickled(obj) -> int:
    return len(pickle.dumps(obj))      # torch.distributed pickles objects with pickle's default protocol


def cases(me, sub, cached_all_gather_into_tensor, early_ops):
    """name → what every rank runs; sub is the group of ranks 0 and 1."""
    def all_to_all_uneven():
        inp = torch.ones(sum(split_rows(me, j) for j in range(WORLD)), 4)
        out = torch.empty(sum(split_rows(i, me) for i in range(WORLD)), 4)
        dist.all_to_all_single(out, inp, [split_rows(i, me) for i in range(WORLD)],
                               [split_rows(me, j) for j in range(WORLD)])

    def send_recv():
        if me == 0:
            dist.send(f32(), 2)
        elif me == 2:
            dist.recv(f32(), 0)

    def send_recv_on_sub_positional():
        if me == 1:
            dist.send(f32(), 0, sub)
        elif me == 0:
            dist.recv(f32(), 1, sub)

    def isend_irecv():
        if me == 1:
            dist.isend(f32(), group_dst=2).wait()
        elif me == 2:
            dist.irecv(f32(), src=1).wait()

    def batch():
        ops = [dist.P2POp(dist.isend, f32(), (me + 1) % WORLD), dist.P2POp(dist.irecv, f32(), (me - 1) % WORLD)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def batch_built_before_install():
        for work in dist.batch_isend_irecv(early_ops):
            work.wait()

    def scatter_object():
        out = [None]
        dist.scatter_object_list(out, SCATTER_OBJS if me == 1 else None, src=1)
        assert out[0] == SCATTER_OBJS[me]

    def send_object():
        if me == 0:
            dist.send_object_list(SENT_OBJS, dst=1)
        elif me == 1:
            received = [None, None]
            dist.recv_object_list(received, src=0)
            assert received == SENT_OBJS

    return {
        "all_reduce": lambda: dist.all_reduce(f32()),
        "all_reduce sub positional": lambda: dist.all_reduce(f32(), dist.ReduceOp.SUM, sub),
        "all_reduce sub keyword": lambda: dist.all_reduce(f32(), group=sub),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([f32(), f32(300)]),
        "broadcast src=1": lambda: dist.broadcast(f32(), src=1),
        "broadcast sub positional": lambda: dist.broadcast(f32(), 0, sub),
        "reduce dst=2": lambda: dist.reduce(f32(), dst=2),
        "reduce sub positional": lambda: dist.reduce(f32(), 1, dist.ReduceOp.SUM, sub),
        "all_gather": lambda: dist.all_gather([f32() for _ in range(WORLD)], f32()),
        "all_gather sub positional": lambda: dist.all_gather([f32(), f32()], f32(), sub),
        "all_gather_into_tensor sub": lambda: dist.all_gather_into_tensor(f32(2 * NUMEL), f32(), group=sub),
        "all_gather_into_tensor kept from before install": lambda: cached_all_gather_into_tensor(
            f32(WORLD * NUMEL), f32()),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(f32(NUMEL // WORLD), f32()),
        "reduce_scatter sub positional": lambda: dist.reduce_scatter(f32(NUMEL // 2), [f32(NUMEL // 2)] * 2,
                                                                     dist.ReduceOp.SUM, sub),
        "all_to_all_single": lambda: dist.all_to_all_single(f32(), f32()),
        "all_to_all_single uneven splits": all_to_all_uneven,
        "all_to_all lists": lambda: dist.all_to_all([f32(100) for _ in range(WORLD)],   # gloo: equal sizes
                                                    [f32(100) for _ in range(WORLD)]),
        "gather dst=1": lambda: dist.gather(f32(), [f32() for _ in range(WORLD)] if me == 1 else None, dst=1),
        "gather sub positional": lambda: dist.gather(f32(), [f32(), f32()] if me == 0 else None, 0, sub),
        "gather, to rank 0 by default": lambda: dist.gather(f32(), [f32() for _ in range(WORLD)] if me == 0 else None),
        "scatter src=2": lambda: dist.scatter(f32(), [f32() for _ in range(WORLD)] if me == 2 else None, src=2),
        "send 0→2, recv": send_recv,
        "send 1→0 on sub positional": send_recv_on_sub_positional,
        "isend 1→2, irecv": isend_irecv,
        "batch_isend_irecv ring": batch,
        "batch_isend_irecv, ops built before install": batch_built_before_install,
        "all_gather_object": lambda: dist.all_gather_object([None] * WORLD, gathered_obj(me)),
        "broadcast_object_list src=0": lambda: dist.broadcast_object_list(
            BROADCAST_OBJS if me == 0 else [None, None], src=0),
        "gather_object sub": lambda: dist.gather_object(gathered_obj(me), [None, None] if me == 0 else None,
                                                        dst=0, group=sub),
        "scatter_object_list src=1": scatter_object,
        "send_object_list 0→1": send_object,
    }


def ring(size, n):
    return 2 * (n - 1) * size // n


def object_payloads() -> tuple[int, int, int, int, int]:
    """What the object collectives move: an int64 size, the largest pickle gathered (of all, of the
    subgroup), the broadcast's sizes and pickles, the largest pickle scattered."""
    int64 = 8
    return (int64, max(pickled(gathered_obj(r)) for r in range(WORLD)), max(pickled(gathered_obj(r)) for r in SUB),
            int64 * len(BROADCAST_OBJS) + sum(pickled(o) for o in BROADCAST_OBJS),
            max(pickled(o) for o in SCATTER_OBJS))


def expected(me) -> dict[str, int]:
    """The model, rank by rank: ring allreduce 2(N−1)/N, gloo's reduce-scatter (an allreduce),
    all-gather (N−1)·chunk, gloo's binomial-tree broadcast, gloo's reduce (reduce-scatter, then
    each chunk to the root), the rest as sent."""

    def tree_sends(n, rank, root):   # binomial tree of 3 or 2 ranks: the root sends to all others
        return n - 1 if rank == root else 0

    def reduce(size, n, rank, root):
        return (n - 1) * size // n + (0 if rank == root else size // n)

    in_sub = me in SUB
    sub_rank = SUB.index(me) if in_sub else None
    int64, max_gathered, max_gathered_sub, broadcast_payload, max_scattered = object_payloads()
    return {
        "all_reduce": ring(SIZE, 3),
        "all_reduce sub positional": ring(SIZE, 2) if in_sub else 0,
        "all_reduce sub keyword": ring(SIZE, 2) if in_sub else 0,
        "all_reduce_coalesced": ring(SIZE + SIZE // 2, 3),
        "broadcast src=1": SIZE * tree_sends(3, me, 1),
        "broadcast sub positional": SIZE * tree_sends(2, sub_rank, 0) if in_sub else 0,
        "reduce dst=2": reduce(SIZE, 3, me, 2),
        "reduce sub positional": reduce(SIZE, 2, sub_rank, 1) if in_sub else 0,
        "all_gather": 2 * SIZE,
        "all_gather sub positional": SIZE if in_sub else 0,
        "all_gather_into_tensor sub": SIZE if in_sub else 0,
        "all_gather_into_tensor kept from before install": 2 * SIZE,
        "reduce_scatter_tensor": ring(SIZE, 3),
        "reduce_scatter sub positional": ring(SIZE, 2) if in_sub else 0,
        "all_to_all_single": 2 * SIZE // 3,
        "all_to_all_single uneven splits": 4 * 4 * sum(split_rows(me, j) for j in range(WORLD) if j != me),
        "all_to_all lists": (WORLD - 1) * 100 * 4,
        "gather dst=1": 0 if me == 1 else SIZE,
        "gather sub positional": SIZE if me == 1 else 0,
        "gather, to rank 0 by default": SIZE if me != 0 else 0,
        "scatter src=2": 2 * SIZE if me == 2 else 0,
        "send 0→2, recv": SIZE if me == 0 else 0,
        "send 1→0 on sub positional": SIZE if me == 1 else 0,
        "isend 1→2, irecv": SIZE if me == 1 else 0,
        "batch_isend_irecv ring": SIZE,
        "batch_isend_irecv, ops built before install": SIZE,
        # object collectives: an all-gather of the pickles' sizes, then of the pickles padded to the largest
        "all_gather_object": 2 * (int64 + max_gathered),
        "broadcast_object_list src=0": 2 * broadcast_payload if me == 0 else 0,
        "gather_object sub": (int64 + (max_gathered_sub if me == 1 else 0)) if in_sub else 0,
        # a broadcast of the largest size, then scatters of the padded pickles and of their sizes
        "scatter_object_list src=1": 2 * (int64 + max_scattered + int64) if me == 1 else 0,
        "send_object_list 0→1": int64 * len(SENT_OBJS) + sum(pickled(o) for o in SENT_OBJS) if me == 0 else 0,
    }


def expected_received(me) -> dict[str, int]:
    """What each rank receives: the ring collectives as sent; a broadcast's other ranks the tensor
    once; reduce's root the others' chunks besides its ring share; gather's destination, scatter's
    other ranks and the receiving end of point-to-point what was sent to them."""

    in_sub = me in SUB
    int64, max_gathered, max_gathered_sub, broadcast_payload, max_scattered = object_payloads()
    return {
        "all_reduce": ring(SIZE, 3),
        "all_reduce sub positional": ring(SIZE, 2) if in_sub else 0,
        "all_reduce sub keyword": ring(SIZE, 2) if in_sub else 0,
        "all_reduce_coalesced": ring(SIZE + SIZE // 2, 3),
        "broadcast src=1": 0 if me == 1 else SIZE,
        "broadcast sub positional": SIZE if me == 1 else 0,
        "reduce dst=2": 2 * SIZE // 3 + (2 * (SIZE // 3) if me == 2 else 0),
        "reduce sub positional": (SIZE // 2 + (SIZE // 2 if me == 1 else 0)) if in_sub else 0,
        "all_gather": 2 * SIZE,
        "all_gather sub positional": SIZE if in_sub else 0,
        "all_gather_into_tensor sub": SIZE if in_sub else 0,
        "all_gather_into_tensor kept from before install": 2 * SIZE,
        "reduce_scatter_tensor": ring(SIZE, 3),
        "reduce_scatter sub positional": ring(SIZE, 2) if in_sub else 0,
        "all_to_all_single": 2 * SIZE // 3,
        "all_to_all_single uneven splits": 4 * 4 * sum(split_rows(i, me) for i in range(WORLD) if i != me),
        "all_to_all lists": (WORLD - 1) * 100 * 4,
        "gather dst=1": 2 * SIZE if me == 1 else 0,
        "gather sub positional": SIZE if me == 0 else 0,
        "gather, to rank 0 by default": 2 * SIZE if me == 0 else 0,
        "scatter src=2": 0 if me == 2 else SIZE,
        "send 0→2, recv": SIZE if me == 2 else 0,
        "send 1→0 on sub positional": SIZE if me == 0 else 0,
        "isend 1→2, irecv": SIZE if me == 2 else 0,
        "batch_isend_irecv ring": SIZE,
        "batch_isend_irecv, ops built before install": SIZE,
        "all_gather_object": 2 * (int64 + max_gathered),
        "broadcast_object_list src=0": 0 if me == 0 else broadcast_payload,
        "gather_object sub": (int64 + (max_gathered_sub if me == 0 else 0)) if in_sub else 0,
        "scatter_object_list src=1": 0 if me == 1 else int64 + max_scattered + int64,
        "send_object_list 0→1": int64 * len(SENT_OBJS) + sum(pickled(o) for o in SENT_OBJS) if me == 1 else 0,
    }


def _worker(rank, world, port, results):
    _join_gloo(rank, WORLD, port)
    sub = dist.new_group(list(SUB))
    before = {(module, name): getattr(module, name) for module in (dist, c10d) for name in WRAPPED}
    kept = dist.all_gather_into_tensor                # as DeepSpeed's backend keeps it, before the counter
    early_ops = [dist.P2POp(dist.isend, f32(), (rank + 1) % WORLD), dist.P2POp(dist.irecv, f32(), (rank - 1) % WORLD)]
    counted, received, between = {}, {}, {}
    with BytesCounter(NODE_OF) as wire:
        wrapped = sum(getattr(module, name) is not function for (module, name), function in before.items())
        for name, case in cases(rank, sub, kept, early_ops).items():
            dist.barrier()                           # carries no payload: not counted
            start, start_received = wire.total, wire.received
            start_between = (wire.total_between, wire.received_between)
            case()
            counted[name] = wire.total - start
            received[name] = wire.received - start_received
            between[name] = (wire.total_between - start_between[0], wire.received_between - start_between[1])
    total_after = wire.total
    dist.all_reduce(f32())                           # uninstalled: no longer counted
    restored = all(getattr(module, name) is function for (module, name), function in before.items())
    results[rank] = (counted, wrapped, restored, wire.total == total_after, received, between)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    """Every case on 3 ranks, once for the module's tests."""
    return spawn_ranks(_worker, WORLD)


def test_every_collective_counts_what_its_rank_sends_and_receives(results):
    for rank in range(WORLD):
        counted, wrapped, restored, still_after_uninstall, received, _ = results[rank]
        assert received == expected_received(rank), f"rank {rank}: " + ", ".join(
            f"{name}: received {received[name]}, model {bytes_}" for name, bytes_ in expected_received(rank).items()
            if received.get(name) != bytes_)
        assert counted == expected(rank), f"rank {rank}: " + ", ".join(
            f"{name}: counted {counted[name]}, model {bytes_}" for name, bytes_ in expected(rank).items()
            if counted.get(name) != bytes_)
        assert wrapped == 2 * len(WRAPPED)           # in torch.distributed and in distributed_c10d's globals
        assert restored and still_after_uninstall
    for name in expected(0):                          # over the ranks, what is received is what was sent
        assert sum(results[r][0][name] for r in range(WORLD)) == sum(results[r][4][name] for r in range(WORLD)), name


def test_broadcast_volume_is_gloos_binomial_tree():
    """Beyond 3 ranks a tree and one-to-all differ: on 4 namespace hosts gloo's source sent 2 copies
    of a broadcast tensor and the rank after it 1 (eth0 counters); in all, N−1 copies."""
    from commodity_bert.comm.bytes_counter import _broadcast_sends
    assert [_broadcast_sends(4, rank, 0) for rank in range(4)] == [2, 1, 0, 0]
    from_3 = [3, 2, 1, 1, 0, 0, 0, 0]                   # counted from the source, rank 3
    assert [_broadcast_sends(8, rank, 3) for rank in range(8)] == from_3[-3:] + from_3[:-3]
    assert all(sum(_broadcast_sends(n, rank, 1 % n) for rank in range(n)) == n - 1 for n in range(1, 40))


def test_bytes_between_nodes_are_conserved_and_none_inside_a_node(results):
    """With ranks 0 and 1 on one node and rank 2 on another, of every collective's bytes: what
    the ranks send to other nodes is what they receive from other nodes, the subgroup of one node
    sends none, and rank 2's ring and direct traffic all crosses."""
    for name in expected(0):
        between = [results[r][5][name] for r in range(WORLD)]
        assert sum(b[0] for b in between) == sum(b[1] for b in between), (name, between)
        for r in range(WORLD):
            assert between[r][0] <= results[r][0][name] and between[r][1] <= results[r][4][name], (name, r)
        if "sub" in name:
            assert between == [(0, 0)] * WORLD, (name, between)
    rank2 = results[2]
    for name in ("all_reduce", "all_gather", "all_to_all_single", "send 0→2, recv", "broadcast src=1"):
        assert rank2[5][name] == (rank2[0][name], rank2[4][name]), name  # every byte of rank 2 crosses
    assert results[0][5]["all_reduce"] == (ring(SIZE, 3) // 2, ring(SIZE, 3) // 2)  # one neighbour of two
