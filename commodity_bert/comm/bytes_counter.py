"""Bytes this rank sends and receives, and of them those between nodes, counted for every collective whoever calls it."""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _group_rank(group, global_rank: int | None, group_rank: int | None, default_global: int | None = None) -> int:
    """A peer's or root's rank in `group`, given as a group rank or as a global rank (gather and
    scatter take global rank 0 when given neither)."""
    if group_rank is not None:
        return group_rank
    if global_rank is None:
        global_rank = default_global
    return dist.get_group_rank(group if group is not None else dist.group.WORLD, global_rank)


def _allreduce(size: int, n: int) -> int:
    """Ring: a reduce-scatter, then an all-gather, each (N−1)/N of the tensor."""
    return 2 * (n - 1) * size // n


def _reduce_scatter(size: int, n: int, group, tensor: torch.Tensor) -> int:
    # gloo has no reduce-scatter of its own: it allreduces the whole input and keeps a chunk
    backend = str(dist.get_backend(group))
    if backend == "gloo" or f"{tensor.device.type}:gloo" in backend:
        return _allreduce(size, n)
    return (n - 1) * size // n


def _broadcast_sends(n: int, me: int, root: int) -> int:
    """How many copies a rank sends in a binomial tree (gloo's broadcast): counted from the root,
    rank v passes the tensor on to v + 2^k for every 2^k > v that is still in the group."""
    v = (me - root) % n
    step, sends = 1, 0
    while v + step < n:
        sends += step > v
        step *= 2
    return sends


def _all_to_all_single(a, n: int, me: int) -> int:
    tensor, splits = a["input"], a["input_split_sizes"]
    if not splits:                                 # equal chunks, one per rank
        return (n - 1) * _nbytes(tensor) // n
    row = _nbytes(tensor) // tensor.shape[0]       # splits count rows (dim 0)
    return row * (sum(splits) - splits[me])


def _sent_to_peer(a, n: int, me: int) -> int:
    peer = _group_rank(a["group"], a["dst"], a["group_dst"])
    return 0 if peer == me else _nbytes(a["tensor"])  # isend may send to itself: no wire


def _batch_sent(a, n: int, me: int) -> int:
    return sum(_nbytes(op.tensor) for op in a["p2p_op_list"]
               if op.op.__name__ == "isend" and op.group_peer != me)


# bytes one rank sends, from the bound arguments `a`, the group's size n and the rank's place in it
Volume = Callable[[dict, int, int], int]
_SENT: dict[str, Volume] = {
    "all_reduce": lambda a, n, me: _allreduce(_nbytes(a["tensor"]), n),
    "all_reduce_coalesced": lambda a, n, me: _allreduce(_nbytes(a["tensors"]), n),
    # gloo's reduce: a ring reduce-scatter, then every rank but the root sends its reduced chunk to it
    "reduce": lambda a, n, me: (n - 1) * _nbytes(a["tensor"]) // n + (
        0 if me == _group_rank(a["group"], a["dst"], a["group_dst"]) else _nbytes(a["tensor"]) // n),
    "broadcast": lambda a, n, me: _nbytes(a["tensor"]) * _broadcast_sends(
        n, me, _group_rank(a["group"], a["src"], a["group_src"])),
    "all_gather": lambda a, n, me: (n - 1) * _nbytes(a["tensor"]),
    "all_gather_single": lambda a, n, me: (n - 1) * _nbytes(a["input_tensor"]),
    "all_gather_into_tensor": lambda a, n, me: (n - 1) * _nbytes(a["input_tensor"]),
    "_all_gather_base": lambda a, n, me: (n - 1) * _nbytes(a["input_tensor"]),
    "all_gather_coalesced": lambda a, n, me: (n - 1) * _nbytes(a["input_tensor_list"]),
    "reduce_scatter": lambda a, n, me: _reduce_scatter(_nbytes(a["input_list"]), n, a["group"], a["output"]),
    "reduce_scatter_single": lambda a, n, me: _reduce_scatter(_nbytes(a["input"]), n, a["group"], a["input"]),
    "reduce_scatter_tensor": lambda a, n, me: _reduce_scatter(_nbytes(a["input"]), n, a["group"], a["input"]),
    "_reduce_scatter_base": lambda a, n, me: _reduce_scatter(_nbytes(a["input"]), n, a["group"], a["input"]),
    "all_to_all_single": _all_to_all_single,
    "all_to_all": lambda a, n, me: _nbytes([t for i, t in enumerate(a["input_tensor_list"]) if i != me]),
    "gather": lambda a, n, me: 0 if me == _group_rank(a["group"], a["dst"], a["group_dst"], 0) else _nbytes(
        a["tensor"]),
    "scatter": lambda a, n, me: 0 if me != _group_rank(a["group"], a["src"], a["group_src"], 0) else _nbytes(
        [t for i, t in enumerate(a["scatter_list"]) if i != me]),
    "send": _sent_to_peer,
    "isend": _sent_to_peer,
    "recv": lambda a, n, me: 0,
    "irecv": lambda a, n, me: 0,
    "batch_isend_irecv": _batch_sent,
}
def _received_from_peer(a, n: int, me: int) -> int:
    source = a["src"] if a["src"] is not None or a["group_src"] is not None else None
    peer = _group_rank(a["group"], a["src"], a["group_src"]) if source is not None else None
    return 0 if peer == me else _nbytes(a["tensor"])  # src None: from any rank


def _batch_received(a, n: int, me: int) -> int:
    return sum(_nbytes(op.tensor) for op in a["p2p_op_list"]
               if op.op.__name__ == "irecv" and op.group_peer != me)


def _all_to_all_single_received(a, n: int, me: int) -> int:
    tensor, splits = a["output"], a["output_split_sizes"]
    if not splits:
        return (n - 1) * _nbytes(tensor) // n
    row = _nbytes(tensor) // tensor.shape[0]
    return row * (sum(splits) - splits[me])


# bytes one rank receives: what the others send it, by the same algorithms (over a group, the
# sum of what its ranks receive is the sum of what they send)
_RECEIVED: dict[str, Volume] = {
    **{name: _SENT[name] for name in ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_single",
                                      "all_gather_into_tensor", "_all_gather_base", "all_gather_coalesced",
                                      "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
                                      "_reduce_scatter_base")},  # symmetric: each rank receives what it sends
    # the ring reduce-scatter's share, and on the root every other rank's reduced chunk
    "reduce": lambda a, n, me: (n - 1) * _nbytes(a["tensor"]) // n + (
        (n - 1) * (_nbytes(a["tensor"]) // n) if me == _group_rank(a["group"], a["dst"], a["group_dst"]) else 0),
    "broadcast": lambda a, n, me: 0 if me == _group_rank(a["group"], a["src"], a["group_src"]) else _nbytes(
        a["tensor"]),
    "all_to_all_single": _all_to_all_single_received,
    "all_to_all": lambda a, n, me: _nbytes([t for i, t in enumerate(a["output_tensor_list"]) if i != me]),
    "gather": lambda a, n, me: 0 if me != _group_rank(a["group"], a["dst"], a["group_dst"], 0) else _nbytes(
        [t for i, t in enumerate(a["gather_list"]) if i != me]),
    "scatter": lambda a, n, me: 0 if me == _group_rank(a["group"], a["src"], a["group_src"], 0) else _nbytes(
        a["tensor"]),
    "send": lambda a, n, me: 0,
    "isend": lambda a, n, me: 0,
    "recv": _received_from_peer,
    "irecv": _received_from_peer,
    "batch_isend_irecv": _batch_received,
}

# ---- which of those bytes cross between nodes, on a group with ranks on several nodes and more than
# one on some (a group within one node sends none between nodes; one of a rank per node, all).
# `other(p)`: whether the group's rank p is on another node than this rank.
def _ring_share(n: int, me: int, other) -> float:
    """Ring collectives pass chunks to a neighbour: gloo's allreduce sends half each way round the
    ring, its all-gather one way. Counted as half to each neighbour, which for a node's ranks
    taken together (consecutive ranks, as launchers place them) is exact either way: the node's
    link carries one rank's share in each direction."""
    peers = {(me + 1) % n, (me - 1) % n}
    return sum(other(p) for p in peers) / len(peers)


def _ring_across(a, n, me, other, sent, received):
    share = _ring_share(n, me, other)
    return sent * share, received * share


def _tree_parent(v: int) -> int:
    """In the binomial tree counted from the source, rank v gets the tensor from v − 2^k, 2^k ≤ v < 2^(k+1)."""
    return v - (1 << (v.bit_length() - 1))


def _broadcast_across(a, n, me, other, sent, received):
    root = _group_rank(a["group"], a["src"], a["group_src"])
    v, size, step, out = (me - root) % n, _nbytes(a["tensor"]), 1, 0
    while v + step < n:
        if step > v:
            out += size * other((v + step + root) % n)
        step *= 2
    return out, (size * other((_tree_parent(v) + root) % n) if v else 0)


def _reduce_across(a, n, me, other, sent, received):
    root, size = _group_rank(a["group"], a["dst"], a["group_dst"]), _nbytes(a["tensor"])
    ring = (n - 1) * size // n * _ring_share(n, me, other)
    if me == root:
        return ring, ring + sum(size // n * other(p) for p in range(n) if p != me)
    return ring + size // n * other(root), ring


def _split_across(splits, rows_bytes, n, me, other):
    return sum(rows_bytes * splits[p] * other(p) for p in range(n) if p != me)


def _all_to_all_single_across(a, n, me, other, sent, received):
    def across(tensor, splits):
        if not splits:
            return _nbytes(tensor) // n * sum(other(p) for p in range(n) if p != me)
        return _split_across(splits, _nbytes(tensor) // tensor.shape[0], n, me, other)
    return across(a["input"], a["input_split_sizes"]), across(a["output"], a["output_split_sizes"])


def _listed_across(tensors, n, me, other):
    return sum(_nbytes(t) * other(p) for p, t in enumerate(tensors) if p != me)


def _peer_across(a, n, me, other, sent, received, key):
    peer = None if a[key] is None and a[f"group_{key}"] is None else _group_rank(a["group"], a[key], a[f"group_{key}"])
    crosses = other(peer) if peer is not None else True  # from any rank: counted as crossing
    return sent * crosses, received * crosses


def _batch_across(a, n, me, other, sent, received):
    def total(kind):
        return sum(_nbytes(op.tensor) * other(op.group_peer) for op in a["p2p_op_list"]
                   if op.op.__name__ == kind and op.group_peer != me)
    return total("isend"), total("irecv")


def _gather_across(a, n, me, other, sent, received):
    root = _group_rank(a["group"], a["dst"], a["group_dst"], 0)
    if me != root:
        return sent * other(root), 0
    return 0, _listed_across(a["gather_list"], n, me, other)


def _scatter_across(a, n, me, other, sent, received):
    root = _group_rank(a["group"], a["src"], a["group_src"], 0)
    if me != root:
        return 0, received * other(root)
    return _listed_across(a["scatter_list"], n, me, other), 0


Across = Callable[[dict, int, int, Callable[[int], bool], int, int], tuple]
_ACROSS: dict[str, Across] = {
    **{name: _ring_across for name in ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_single",
                                       "all_gather_into_tensor", "_all_gather_base", "all_gather_coalesced",
                                       "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
                                       "_reduce_scatter_base")},
    "reduce": _reduce_across,
    "broadcast": _broadcast_across,
    "all_to_all_single": _all_to_all_single_across,
    "all_to_all": lambda a, n, me, other, sent, received: (
        _listed_across(a["input_tensor_list"], n, me, other), _listed_across(a["output_tensor_list"], n, me, other)),
    "gather": _gather_across,
    "scatter": _scatter_across,
    "send": lambda a, n, me, other, sent, received: _peer_across(a, n, me, other, sent, received, "dst"),
    "isend": lambda a, n, me, other, sent, received: _peer_across(a, n, me, other, sent, received, "dst"),
    "recv": lambda a, n, me, other, sent, received: _peer_across(a, n, me, other, sent, received, "src"),
    "irecv": lambda a, n, me, other, sent, received: _peer_across(a, n, me, other, sent, received, "src"),
    "batch_isend_irecv": _batch_across,
}

# Object collectives pickle their objects into byte tensors and move them (and their sizes) with the
# collectives above, which they call through the module's globals: those calls are what is counted.
_COUNTED_INSIDE = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                   "send_object_list", "recv_object_list")


def _group_of(a: dict):
    return a["p2p_op_list"][0].group if "p2p_op_list" in a else a.get("group")


_INSTALLED: list[BytesCounter] = []  # the counters counting now, the latest last


def installed() -> BytesCounter | None:
    """The counter installed last (train.py's), or None: for code that holds back its counts
    (`BytesCounter.held`) without being handed the counter."""
    return _INSTALLED[-1] if _INSTALLED else None


class BytesCounter:
    """Counts the bytes this rank's collectives send and receive, whoever calls them (DeepSpeed's gradient
    allreduce, ZeRO's reduce and all-gather, the 1-bit exchange, object collectives), by wrapping
    torch.distributed's functions.

    Each function is wrapped both in the `torch.distributed` namespace and in the globals of
    `torch.distributed.distributed_c10d`, because torch's functions call one another through those
    globals: object collectives move pickles with broadcast/all_gather/gather/scatter/send,
    all_gather_into_tensor calls all_gather_single, send calls isend, and DeepSpeed keeps references
    to functions taken before this counter was installed. Only the outermost counted call on a thread
    counts, so none is counted twice; object collectives count nothing themselves, the collectives
    they call count their size tensors and padded pickles.

    The figures are the volumes of the algorithms, not of the wire (no TCP/IP headers), per call
    on a group of N ranks that this rank is in (ranks outside the group and groups of one send 0).
    Where gloo departs from the ring, the model follows gloo, as eth0's counters showed on 3 and 4
    namespace hosts (tools/netns_cluster.py):
      allreduce               2(N−1)/N·size (ring: reduce-scatter, then all-gather)
      reduce-scatter          (N−1)/N·input (ring); on gloo, which allreduces the input, 2(N−1)/N·input
      all-gather              (N−1)·the rank's own chunk
      all_to_all_single       every row of the input but this rank's split ((N−1)/N·size if equal)
      all_to_all (lists)      every input tensor but this rank's own
      broadcast               size × the sends of a binomial tree, gloo's algorithm: ceil(log2 N)
                              copies from the source, none from its last half (one-to-all and the
                              ring send the same (N−1)·size in all, spread differently over ranks)
      reduce                  gloo's: a ring reduce-scatter, then every rank but the root sends its
                              reduced chunk to the root: size from others, (N−1)/N·size from the root
      gather                  the rank's tensor, except on the destination (0)
      scatter                 every chunk but its own, from the source; 0 from the others
      send, isend             size (0 to itself); recv, irecv 0; batch_isend_irecv its isends
    Received, by the same algorithms: what a rank sends in a ring (allreduce, all-gather,
    reduce-scatter) it also receives; a broadcast's ranks other than the source receive the tensor
    once; reduce's root receives the other ranks' chunks besides its ring share; gather's
    destination and scatter's other ranks receive what the others send them; recv, irecv and the
    irecvs of batch_isend_irecv their tensors. Over a group the received bytes sum to the sent.
    Barriers carry no payload and are not counted. tests/test_multihost.py checks the figures
    against the hosts' interface counters in a training run.

    Between nodes (`node_of`, each global rank's node: comm/topology.py): of those bytes, the ones
    to and from ranks on other nodes, which is what a node's network link carries; the rest stay
    on the node (NVLink, PCIe, loopback). A group on one node sends none between nodes, a group of
    one rank per node all; a group with several ranks on some node counts per peer: ring
    collectives half to each ring neighbour (exact for a node's consecutive ranks together,
    whichever way gloo turns the ring), broadcasts along the binomial tree, reduce's ring and its
    chunk to the root, all-to-all, gather, scatter and point-to-point by their peers. On 2
    namespace hosts of 2 ranks, the two hosts' eth0 agreed within 0.5% (tests/test_multihost.py).
    """

    def __init__(self, node_of: list[int] | None = None):
        self.total = 0     # bytes sent: `bytes_sent`
        self.received = 0  # bytes received: `bytes_received`
        # of those, the bytes to and from ranks on other nodes: `bytes_sent_between_nodes`, ...
        self.total_between = 0
        self.received_between = 0
        self.node_of = node_of  # each global rank's node (comm/topology.py); None: a node per rank
        self._group_nodes: dict = {}
        self._per_thread: dict[int, dict[str, int]] = {}  # thread → its own counters (snapshot)
        self.calls = 0  # collective calls this rank took part in (outermost only): `comm_rounds`
        self._replaced: list[tuple[object, str, Callable]] = []  # (module, name, original)
        self._depth = threading.local()  # this counter's nesting depth per thread
        self._held = threading.local()   # this thread's tally while inside held()
        self._lock = threading.Lock()

    # the counters a metrics row reports, as a window's differences (train/bookkeeping.py)
    FIELDS = {"bytes_sent": "total", "bytes_received": "received", "bytes_sent_between_nodes": "total_between",
              "bytes_received_between_nodes": "received_between", "comm_rounds": "calls"}

    def snapshot(self, this_thread: bool = False) -> dict[str, int]:
        """The counters so far: every thread's, or (this_thread) the calling thread's alone, which
        tells the loop's own collectives from those of an exchange running beside it (DiLoCo's
        overlapped outer steps)."""
        if this_thread:
            mine = self._per_thread.get(threading.get_ident(), {})
            return {field: mine.get(field, 0) for field in self.FIELDS}
        return {field: getattr(self, attribute) for field, attribute in self.FIELDS.items()}

    @contextlib.contextmanager
    def held(self):
        """Collectives inside, on this thread, are counted into the yielded tally (FIELDS' names →
        counts) and not into the totals until `credit(tally)`. Why: an exchange running beside the
        loop (DiLoCo's overlapped outer steps) ends at a moment no two runs share, so counted as it
        ends its bytes fell in whichever logged step was open then (or in none, between a row's
        snapshot and the next window's); credited when its result is used they fall in the same
        step in every run, a resumed one included."""
        tally = dict.fromkeys(self.FIELDS, 0)
        outer = getattr(self._held, "tally", None)
        self._held.tally = tally
        try:
            yield tally
        finally:
            self._held.tally = outer

    def credit(self, tally: dict[str, int]) -> None:
        """Adds a tally from `held()` to the totals (not to any thread's own counts: it is no
        collective of the crediting thread's)."""
        with self._lock:
            for field, attribute in self.FIELDS.items():
                setattr(self, attribute, getattr(self, attribute) + int(tally.get(field, 0)))

    def install(self) -> BytesCounter:
        if self._replaced:
            return self
        _INSTALLED.append(self)
        for name in (*_SENT, *_COUNTED_INSIDE):
            original = getattr(c10d, name, None)
            if original is None:
                continue
            counted = self._counted(original, name)
            for module in (c10d, dist):
                if getattr(module, name, None) is original:
                    setattr(module, name, counted)
                    self._replaced.append((module, name, original))
        return self

    def uninstall(self) -> None:
        for module, name, original in reversed(self._replaced):
            setattr(module, name, original)
        self._replaced.clear()
        if self in _INSTALLED:
            _INSTALLED.remove(self)

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()

    def _counted(self, original: Callable, name: str) -> Callable:
        signature = inspect.signature(original)
        batch = original.__name__ == "batch_isend_irecv"
        counts = name in _SENT

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if not counts:                           # counted by what it calls
                return original(*args, **kwargs)
            if batch:
                _point_ops_to_current_functions(args, kwargs)
            depth = getattr(self._depth, "value", 0)
            volumes = self._volumes(signature, name, args, kwargs) if depth == 0 else None
            self._depth.value = depth + 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._depth.value = depth
            if volumes is not None:
                sent, got, sent_between, got_between = volumes
                tally = getattr(self._held, "tally", None)
                if tally is not None:                # held(): credited later, by the caller
                    for field, value in zip(self.FIELDS, (sent, got, sent_between, got_between, 1)):
                        tally[field] += value
                    return result
                with self._lock:
                    self.total += sent
                    self.received += got
                    self.total_between += sent_between
                    self.received_between += got_between
                    self.calls += 1
                    mine = self._per_thread.setdefault(threading.get_ident(), dict.fromkeys(self.FIELDS, 0))
                    for field, value in zip(self.FIELDS, (sent, got, sent_between, got_between, 1)):
                        mine[field] += value
            return result
        return counted

    def _volumes(self, signature: inspect.Signature, name: str, args, kwargs) -> tuple[int, ...] | None:
        """(sent, received, sent to other nodes, received from them) by this call; None when this
        rank takes no part in a multi-rank collective."""
        if not dist.is_initialized():
            return None                              # the collective itself will say why it cannot run
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return None                              # likewise: torch reports the bad arguments
        bound.apply_defaults()
        a = bound.arguments
        group = _group_of(a)
        n, me = dist.get_world_size(group), dist.get_rank(group)  # -1 outside the group
        if n <= 1 or me < 0:
            return None
        sent, received = int(_SENT[name](a, n, me)), int(_RECEIVED[name](a, n, me))
        nodes = self._nodes_of(group)
        if nodes is None or len(set(nodes)) == n:    # a rank per node: every byte crosses
            return sent, received, sent, received
        if len(set(nodes)) == 1:                     # one node: none does
            return sent, received, 0, 0
        sent_between, received_between = _ACROSS[name](a, n, me, lambda p: nodes[p] != nodes[me], sent, received)
        return sent, received, int(sent_between), int(received_between)

    def _nodes_of(self, group) -> list[int] | None:
        """The node of each of the group's ranks, in group order."""
        if self.node_of is None:
            return None
        key = id(group)
        if key not in self._group_nodes:
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            self._group_nodes[key] = (group, [self.node_of[r] for r in ranks])  # the group kept: its id stays its own
        return self._group_nodes[key][1]


def _point_ops_to_current_functions(args, kwargs) -> None:
    """batch_isend_irecv tells sends from receives by identity (`op.op is isend`, the module's
    current global): an op built before install holds the unwrapped isend, so it is pointed at the
    current one, which sends the same."""
    ops = args[0] if args else kwargs.get("p2p_op_list", ())
    for op in ops if isinstance(ops, list) else ():
        name = getattr(op.op, "__name__", "")
        if name in ("isend", "irecv"):
            op.op = getattr(c10d, name)
