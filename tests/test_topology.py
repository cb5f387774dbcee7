"""The two-level exchange (comm/topology.py) on real gloo ranks placed as 2 nodes of 2, and as
nodes of 3 and 2 (by CROSS_RANK, as DeepSpeed's launcher sets it): the nodes found, the 1-bit
allreduce and DiLoCo's average in two levels against the flat ones and the exact mean over all
ranks, and the bytes that cross between nodes."""
import os
from pathlib import Path

import torch
import torch.distributed as dist
from conftest import spawn_ranks
from test_comm import _join_gloo

from commodity_bert.collectives.onebit_allreduce import CompressedAllreduce, TwoLevelCompressedAllreduce
from commodity_bert.comm.bytes_counter import BytesCounter
from commodity_bert.comm.diloco import average
from commodity_bert.comm.topology import Topology
from commodity_bert.run_config import RunConfig

NUMEL = 4 * 256 * 12  # slices of whole 256-element scale blocks, split evenly over 2 servers


def exact_mean(x: torch.Tensor) -> torch.Tensor:
    total = x.clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def relative(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _worker(rank, world, port, results, node_of):
    os.environ["CROSS_RANK"] = str(node_of[rank])
    _join_gloo(rank, world, port)
    topology = Topology.discover()
    hierarchy = topology.hierarchy()
    out = {"node_of": topology.node_of, "local_rank": hierarchy.local_rank, "holds_slice": hierarchy.holds_slice,
           "choices": {str(s): topology.choose(s)[0] for s in ("auto", True, False)}}

    if len(set(topology.ranks_per_node)) == 1:
        # 1. the same buffer on both ranks of a node: the node's sum is exact, so two levels must
        # be bit for bit the flat 1-bit allreduce between the nodes alone (ranks 0 and 2, 1 and 3)
        torch.manual_seed(100 + node_of[rank])
        per_node = torch.randn(NUMEL)
        two_level = TwoLevelCompressedAllreduce(NUMEL, "cpu", hierarchy, scale_block=256)
        first_nodes, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
        flat_between_nodes = CompressedAllreduce(NUMEL, "cpu", group=first_nodes, scale_block=256)
        same = [torch.equal(two_level(per_node), flat_between_nodes(per_node)) for _ in range(3)]
        out["node_buffers_as_flat_between_nodes"] = all(same[:1]) if hierarchy.local_rank else all(same)

    # 2. every rank its own buffer: error of one call, and of the running mean (error feedback)
    torch.manual_seed(rank)
    mine = torch.randn(NUMEL) * (rank + 1) + rank
    exact = exact_mean(mine)
    for name, compressor in (("two_level", TwoLevelCompressedAllreduce(NUMEL, "cpu", hierarchy, scale_block=256)),
                             ("flat", CompressedAllreduce(NUMEL, "cpu", scale_block=256))):
        wire = BytesCounter(topology.node_of).install()
        first = compressor(mine)
        between = wire.total_between
        wire.uninstall()
        running = first.clone()
        for _ in range(29):
            running += compressor(mine)
        gathered = [torch.empty_like(first) for _ in range(world)]
        dist.all_gather(gathered, first)
        out[name] = {"one_call": relative(first, exact), "mean_of_30": relative(running / 30, exact),
                     "alike": all(torch.equal(g, gathered[0]) for g in gathered),
                     "between_sent": between, "sent": wire.total}

    # 3. DiLoCo's average: fp32 in two levels is the mean; int8 within its quantization
    for compression in ("none", "int8"):
        got = hierarchy.average(mine.clone(), lambda part: average(part, compression, hierarchy.cross))
        out[f"diloco_{compression}"] = relative(got, exact)
    # the same through the node's collectives, the path GPUs take (NCCL's there, gloo's here)
    between = (lambda part: average(part, "none", hierarchy.cross)) if hierarchy.holds_slice else None
    got = hierarchy._average_with_collectives(mine.clone(), hierarchy.slice_numel(NUMEL), between, hierarchy.divisor)
    out["collectives_none"] = relative(got, exact)

    # 4. on one node (the local group alone), with nothing between: the exact mean of the node
    node_mean = hierarchy.average(mine.clone(), None)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    node = [g for r, g in enumerate(gathered) if node_of[r] == node_of[rank]]
    out["one_node_error"] = float((node_mean - sum(node) / len(node)).abs().max())
    results[rank] = out
    dist.destroy_process_group()


def one_bit_share(numel: int) -> int:
    """Bytes of `numel` elements in 1-bit form: a bit an element, a 4-byte scale per 256."""
    return numel // 8 + numel // 256 * 4


def check_two_levels(results: dict, node_of: list[int]) -> dict:
    world, nodes = len(node_of), sorted(set(node_of))
    sizes = [node_of.count(n) for n in nodes]
    for rank, out in results.items():
        assert out["node_of"] == node_of and out["local_rank"] == rank - node_of.index(node_of[rank])
        assert out["holds_slice"] == (out["local_rank"] < min(sizes))
        assert out["choices"] == {"auto": True, "True": True, "False": False}
        two, flat = out["two_level"], out["flat"]
        assert two["alike"] and flat["alike"]
        # the compression error of 2 workers, not of every rank; both feed their error back
        assert two["one_call"] < flat["one_call"] < 1.0, (two, flat)
        assert two["mean_of_30"] < 0.1 and flat["mean_of_30"] < 0.1, (two, flat)
        # the mean over all ranks, each node's sum weighted by its ranks (not the mean of nodes)
        assert out["diloco_none"] < 1e-6 and out["diloco_int8"] < 0.01 and out["collectives_none"] < 1e-6, out
        assert out["one_node_error"] < 1e-5
        if not out["holds_slice"]:
            assert two["between_sent"] == 0, (rank, two)
    # inside a CPU node the fp32 steps go through shared memory, not gloo: all that is sent crosses,
    # and no segment is left in /dev/shm
    assert all(results[r]["two_level"]["sent"] == results[r]["two_level"]["between_sent"] for r in range(world))
    assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith("commodity_bert_")]
    per_node = {kind: [sum(results[r][kind]["between_sent"] for r in range(world) if node_of[r] == n)
                       for n in nodes] for kind in ("two_level", "flat")}
    print(f"bytes sent between nodes per node in one call ({sizes} ranks): {per_node}")
    # over a node's link, in two levels: each of the S slices' holders sends half its slice's signs
    # and scales to the other node and gathers the other half, whatever the node's size
    slices = min(sizes)
    assert per_node["two_level"] == [slices * one_bit_share(NUMEL // slices // 2) * 2] * 2, per_node
    return per_node


def test_two_levels_on_two_nodes_of_two_ranks():
    node_of = [0, 0, 1, 1]
    results = spawn_ranks(_worker, len(node_of), node_of)
    for out in results.values():
        assert out["node_buffers_as_flat_between_nodes"]
    per_node = check_two_levels(results, node_of)
    # flat, each rank's all-to-all sends the chunks of the 2 ranks on the other node (L = 2 shares
    # on the link), and the ring all-gather crosses once per node
    signs, scales = NUMEL // 8, NUMEL // 256 * 4
    flat_rank = (signs + scales) // 2 + 3 * (signs + scales) // 4 // 2  # a2a to 2 of 4 ranks; ring: 1 of 2 neighbours
    assert per_node["flat"] == [2 * flat_rank] * 2, per_node


def test_two_levels_on_nodes_of_three_and_two_ranks():
    """Unequal nodes: 2 slices (the smaller node's ranks); the larger node's third rank sums and
    gathers only. Flat, the 3-rank node's link carries 3 ranks' shares against 2 in two levels."""
    node_of = [0, 0, 0, 1, 1]
    per_node = check_two_levels(spawn_ranks(_worker, len(node_of), node_of), node_of)
    assert per_node["flat"][0] > per_node["two_level"][0] and per_node["flat"][1] > per_node["two_level"][1]


def test_topology_choices_from_the_node_keys():
    def ranks(keys):
        return Topology(keys)

    two_by_two = ranks(["CROSS_RANK=0", "CROSS_RANK=0", "CROSS_RANK=1", "CROSS_RANK=1"])
    assert two_by_two.nodes == [[0, 1], [2, 3]] and two_by_two.describe() == "2 nodes of 2 ranks each"
    assert two_by_two.choose("auto") == (True, None)
    one_node = ranks(["host=a", "host=a"])
    assert one_node.choose("auto") == (False, None) and one_node.choose(True) == (True, None)
    one_each = ranks(["CROSS_RANK=0", "CROSS_RANK=1"])
    assert one_each.choose(True) == (False, None)
    uneven = ranks(["CROSS_RANK=0", "CROSS_RANK=0", "CROSS_RANK=1"])
    assert uneven.choose("auto") == (True, None) and uneven.describe() == "2 nodes of [2, 1] ranks"
    assert ranks(["CROSS_RANK=1", "CROSS_RANK=0"]).node_of == [0, 1]  # numbered by first rank
    def problem(config: dict) -> str | None:
        return RunConfig.parse(config).problems()
    assert problem({"commodity_bert": {"hierarchy": {"enabled": "yes"}}}) == \
        "hierarchy enabled 'yes': give \"auto\", true or false"
    assert problem({"commodity_bert": {"hierarchy": {"enabled": False}}}) is None
    assert problem({}) is None


def test_torchrun_and_srun_name_the_rank_as_deepspeeds_launcher_does():
    """Uneven nodes under a bare srun (4 + 4 + 2 tasks): the last node's second task is rank 9 of
    10, local rank 1 of its node's 2, on node 2, meeting at the step's first host; torchrun's
    LOCAL_WORLD_SIZE and GROUP_RANK become LOCAL_SIZE and CROSS_RANK; what is set stays."""
    from commodity_bert.launcher_env import expand_hostlist, launched_by, rank_environment
    assert expand_hostlist("gpu[08-10,12],login1") == ["gpu08", "gpu09", "gpu10", "gpu12", "login1"]
    srun = {"SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "10", "SLURM_NODEID": "2",
            "SLURM_STEP_TASKS_PER_NODE": "4(x2),2", "SLURM_STEP_NODELIST": "localhost,gpu[02-03]",
            "SLURM_JOB_ID": "4321987"}
    assert launched_by(srun) == "srun"
    assert rank_environment(srun) == {"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "10", "LOCAL_SIZE": "2",
                                      "CROSS_RANK": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "16987"}
    assert rank_environment({**srun, "MASTER_PORT": "29500"})["MASTER_ADDR"] == "localhost"
    assert "MASTER_PORT" not in rank_environment({**srun, "MASTER_PORT": "29500"})
    torchrun = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "2",
                "TORCHELASTIC_RUN_ID": "bert", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    assert launched_by(torchrun) == "torchrun"
    assert rank_environment(torchrun) == {"LOCAL_SIZE": "2", "CROSS_RANK": "2"}
    deepspeed = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_SIZE": "2", "CROSS_RANK": "0",
                 "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}  # bert-launch under srun: DeepSpeed's names
    assert launched_by(deepspeed) == "deepspeed" and rank_environment(deepspeed) == {}
