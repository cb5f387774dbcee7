"""What the two-level exchange saves besides the link: the 1-bit allreduce's own work per rank,
flat over 4 ranks against two levels of 2 nodes × 2 (comm/topology.py), timed on 4 gloo ranks of
this machine with no rate limit (loopback), so the difference is the compression arithmetic and
the in-node copies, not the network. One thread per rank, as the namespace benchmarks run.

    python benchmarks/two_level_compute.py [--numel 11300000] [--calls 10] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from commodity_bert.collectives.onebit_allreduce import CompressedAllreduce, TwoLevelCompressedAllreduce  # noqa: E402
from commodity_bert.comm.topology import Topology  # noqa: E402

NODE_OF = [0, 0, 1, 1]


def worker(rank, port, numel, calls, results):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CROSS_RANK=str(NODE_OF[rank]))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    hierarchy = Topology.discover().hierarchy()
    x = torch.randn(numel)
    timings = {}
    for name, compressor in (("flat", CompressedAllreduce(numel, "cpu", scale_block=256)),
                             ("two_levels", TwoLevelCompressedAllreduce(numel, "cpu", hierarchy, scale_block=256))):
        compressor(x)  # warm up
        each = []
        for _ in range(calls):
            dist.barrier()
            started = time.perf_counter()
            compressor(x)
            each.append(time.perf_counter() - started)
        timings[name] = each
    results[rank] = timings
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=11_300_000)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(worker, args=(port, args.numel, args.calls, results), nprocs=4)
    out = {name: statistics.median(max(results[r][name][i] for r in range(4)) for i in range(args.calls))
           for name in ("flat", "two_levels")}  # a call lasts until its slowest rank is done
    print(f"{args.numel:,} elements, 4 ranks on this machine, one thread each: median of {args.calls} calls, "
          f"slowest rank: flat {out['flat']:.3f} s, two levels {out['two_levels']:.3f} s, "
          f"saved {out['flat'] - out['two_levels']:+.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "median_s": out,
                                               "per_rank": {str(r): results[r] for r in range(4)}}, indent=1))


if __name__ == "__main__":
    main()
