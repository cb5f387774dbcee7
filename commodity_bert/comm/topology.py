"""Which ranks share a node, and the two-level exchange built on it: full precision inside a
node, the mode's compressed exchange between nodes only.

A node's GPUs share one network link. A flat compressed allreduce over all N·L ranks (N nodes,
L ranks each) puts L ranks' compressed traffic on every link; reduced inside the node first
(NVLink or PCIe on GPUs, shared memory between CPU ranks), the link carries one share:

    reduce-scatter inside the node (fp32)   local rank i holds the node's sum of slice i
    the mode's exchange between nodes       local rank i averages slice i with the local rank i
                                            of every other node (1-bit, int8, bf16 or fp32)
    all-gather inside the node              every rank holds the whole average

The L slices travel between nodes at once, one per local rank, so the compression's arithmetic
is split L ways too. Inside a node the two fp32 steps are NCCL's on GPUs; between CPU ranks
(gloo) they go through shared memory (`SharedBuffers`): gloo's reduce-scatter is an allreduce of
the whole buffer over loopback TCP, which on 2 namespace hosts of 2 ranks made the two-level
1-bit step slower than the flat one at 100 Mbit/s although the link carried 1.75× fewer bytes. Over a node's link the bytes are those of a flat exchange among N ranks,
and the compression error is that of N workers, not N·L. With one node (N = 1) nothing is
compressed: the average is exact.

Nodes of unequal size (a hostfile's slots 4, 4 and 2): the buffer is cut into as many slices as
the smallest node has ranks (S), and local ranks 0…S−1 of every node run the exchange between
nodes, one slice each; a larger node's other ranks only sum and gather inside it. Each node's
link still carries the whole buffer's compressed bytes once, and the busiest rank compresses
1/S of it, as the smallest node's would in any split. A node's sum stands for its ranks: scaled
by N/W (N nodes, W ranks) before the mean between nodes, it weighs L_n/W in the average, so the
result is the mean over all W ranks, not over nodes.

Which node a rank is on comes from the launcher, not a setting: DeepSpeed's launch.py exports
CROSS_RANK, the node's line in the hostfile (whose slots say how many ranks it runs); torchrun
GROUP_RANK; `srun` SLURM_NODEID; else the host name (mpirun). Ranks gather these once at start.

Selected by the project block of the DeepSpeed config:
    "commodity_bert": {"hierarchy": {"enabled": "auto"}}
"auto" (the default): two levels where the run has more than one node and some node runs more
than one rank; true: two levels whenever a node runs more than one rank (on one node, an exact
average instead of a compressed one); false: the flat exchange over all ranks.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from commodity_bert.run_config import RunConfig, register_section

DEFAULTS = {"enabled": "auto"}


def hierarchy_setting(config: RunConfig | dict):
    return RunConfig.of(config).section("hierarchy")["enabled"]


def check_setting(settings: dict, config: RunConfig) -> str | None:
    """The problem with a hierarchy block, as one line, or None."""
    value = settings["enabled"]
    if value != "auto" and not isinstance(value, bool):
        return f'hierarchy enabled {value!r}: give "auto", true or false'
    return None


register_section("hierarchy", DEFAULTS, check_setting)


def world_timeout():
    """The world group's collective timeout (train.py's --dist-timeout-minutes), for the groups
    made after it: torch gives those its own default (30 minutes on gloo) unless told, so a peer
    that hangs would hold an exchange on them three times longer than the user asked for."""
    backend = dist.distributed_c10d._get_default_group()._get_backend(
        torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu"))
    return getattr(getattr(backend, "options", None), "_timeout", None)


def node_key() -> str:
    """This rank's node, as the launcher knows it."""
    for variable in ("CROSS_RANK", "GROUP_RANK", "SLURM_NODEID"):  # DeepSpeed's launch.py, torchrun, srun
        if os.environ.get(variable):
            return f"{variable}={os.environ[variable]}"
    return f"host={socket.gethostname()}"


class Topology:
    """The node of every rank: nodes numbered in the order of their first rank."""

    def __init__(self, keys: list):
        order: dict = {}
        self.node_of = [order.setdefault(k, len(order)) for k in keys]
        self.nodes = [[r for r, n in enumerate(self.node_of) if n == i] for i in range(len(order))]

    @classmethod
    def discover(cls) -> Topology:
        """Collective: every rank's node key, gathered once."""
        keys = [None] * dist.get_world_size()
        dist.all_gather_object(keys, node_key())
        return cls(keys)

    @property
    def ranks_per_node(self) -> list[int]:
        return [len(n) for n in self.nodes]

    def describe(self) -> str:
        sizes = self.ranks_per_node
        if len(sizes) == 1:
            return f"1 node of {sizes[0]} ranks"
        per_node = f"{sizes[0]} ranks each" if len(set(sizes)) == 1 else f"{sizes} ranks"
        return f"{len(self.nodes)} nodes of {per_node}"

    def choose(self, setting) -> tuple[bool, str | None]:
        """(whether to exchange in two levels, a line to print where the choice needs saying)."""
        several = max(self.ranks_per_node) > 1
        if setting is False or not several or (setting == "auto" and len(self.nodes) == 1):
            return False, None
        return True, None

    def hierarchy(self) -> Hierarchy:
        """Collective (every rank, the same order): the process groups of the two levels."""
        local, _ = dist.new_subgroups_by_enumeration(self.nodes, timeout=world_timeout())
        slices = min(self.ranks_per_node)
        crossing = [[node[i] for node in self.nodes] for i in range(slices)]
        # a rank past the smallest node's size is in no crossing group (cross None): it exchanges nothing
        cross, _ = dist.new_subgroups_by_enumeration(crossing, timeout=world_timeout())
        node = self.node_of[dist.get_rank()]
        return Hierarchy(local, cross, len(self.nodes[node]), len(self.nodes), node, slices=slices)


class Hierarchy:
    """The two levels: `local` (this rank's node) and `cross` (the same local rank on every node;
    None for a rank that holds no slice)."""

    def __init__(self, local, cross, local_size: int, nodes: int, node: int = 0, slices: int | None = None):
        self.local, self.cross = local, cross
        self.local_size, self.nodes = local_size, nodes
        self.slices = slices or local_size
        self.local_rank = dist.get_rank(local)
        self.node = node
        # the node's sum over the mean between nodes: W/N ranks (the node's size, where all are equal)
        self.divisor = dist.get_world_size() / nodes
        self._shared: dict[int, SharedBuffers] = {}  # CPU ranks: by padded length

    @property
    def holds_slice(self) -> bool:
        return self.local_rank < self.slices

    def slice_numel(self, numel: int) -> int:
        """The length of each slice of a flat tensor of `numel` elements."""
        return -(-numel // self.slices)

    def average(self, flat: torch.Tensor, between: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        """The mean of `flat` (fp32) over all ranks: summed inside the node in full precision, this
        rank's slice averaged between nodes by `between` (a mean over the `cross` group; None: the
        node's mean, as on one node), gathered inside the node."""
        numel, part = flat.numel(), self.slice_numel(flat.numel())
        divisor = self.divisor if between is not None else self.local_size
        if self.nodes == 1 or not self.holds_slice:
            between = None
        if flat.device.type == "cpu":
            return self._average_in_shared_memory(flat, part, between, divisor)
        return self._average_with_collectives(flat, part, between, divisor)

    def _average_with_collectives(self, flat, part, between, divisor) -> torch.Tensor:
        """GPUs: NCCL's reduce-scatter and all-gather inside the node (on CPU ranks, gloo's)."""
        numel = flat.numel()
        # one chunk per local rank; those past the slices carry zeros and come back unused
        padded = torch.zeros(part * self.local_size, device=flat.device)
        padded[:numel] = flat
        mine = torch.empty(part, device=flat.device)
        # torch 2.13 names it reduce_scatter_single, older ones reduce_scatter_tensor (looked up at
        # call time: the byte counter replaces the module's functions)
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(mine, padded, group=self.local)
        mine.div_(divisor)
        if between is not None:
            mine = between(mine)
        out = torch.empty_like(padded)
        dist.all_gather_into_tensor(out, mine.contiguous(), group=self.local)
        return out[:numel]

    def _average_in_shared_memory(self, flat, part, between, divisor) -> torch.Tensor:
        """Each rank writes its buffer into its own shared segment; rank i < S sums slice i of
        every segment, exchanges it between nodes and writes the result back into slice i of its
        own segment, which no other rank reads until the next barrier; then every rank reads each
        slice from its holder. Only barriers (no payload) go through gloo."""
        padded = part * self.slices
        if padded not in self._shared:
            self._shared[padded] = SharedBuffers(self, padded)
        views, me = self._shared[padded].views, self.local_rank
        numel = flat.numel()
        views[me][:numel] = flat
        views[me][numel:] = 0                       # the last slice's padding: the last call wrote it
        dist.barrier(group=self.local)              # every rank's buffer written
        if self.holds_slice:
            mine = views[0][me * part:(me + 1) * part].clone()
            for view in views[1:]:
                mine += view[me * part:(me + 1) * part]
            mine.div_(divisor)
            if between is not None:
                mine = between(mine)
            views[me][me * part:(me + 1) * part] = mine
        dist.barrier(group=self.local)              # every averaged slice written
        out = torch.cat([views[i][i * part:(i + 1) * part] for i in range(self.slices)])[:numel]
        dist.barrier(group=self.local)              # read before the next call writes again
        return out


class SharedBuffers:
    """One fp32 segment of `numel` elements per local rank in /dev/shm, mapped by every rank of the
    node. Each rank creates its own and removes its name once all have mapped it: the mappings
    stay valid until the processes exit, and nothing is left in /dev/shm after a crash."""

    def __init__(self, hierarchy: Hierarchy, numel: int):
        run = f"{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_{os.environ.get('MASTER_PORT', '')}"
        paths = [Path("/dev/shm") / f"commodity_bert_{run}_node{hierarchy.node}_{numel}_{i}"
                 for i in range(hierarchy.local_size)]
        mine = paths[hierarchy.local_rank]
        with open(mine, "wb") as f:
            f.truncate(numel * 4)
        dist.barrier(group=hierarchy.local)         # every segment exists
        self.views = [torch.from_file(str(p), shared=True, size=numel, dtype=torch.float32) for p in paths]
        dist.barrier(group=hierarchy.local)         # every segment mapped
        mine.unlink()
