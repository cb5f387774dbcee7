"""`bert-plan preflight`: measure a cluster before training on it, under the training's launcher.

    deepspeed --hostfile H --module commodity_bert.plan preflight --model large --seq-len 128 --out profile.json
    deepspeed --num_gpus 2 --module commodity_bert.plan preflight ...          (one machine)

Every rank measures, at the same time as the others (as in training, where they share the
host's CPUs, memory bandwidth and PCIe): a square matmul in the training precision, and one
BERT training step split into forward + backward of a micro-batch, DeepSpeed's gradient
allreduce without the wire, the optimizer's step and 1-bit LAMB's compression work, on the
engine train.py trains with (train/engine.py), each rank alone in its data-parallel group. Then, across hosts: allreduce time for 1–256 MB on the
training backend (nccl or gloo), and each pair of hosts' one-way bandwidth, both directions,
between one rank per host. Problems (a host that never joins, ranks on different interfaces,
a link much slower than the others) are printed one line each and kept in profile.json.

Why its own rendezvous: torch's waits for the whole world and then says only how many ranks
joined. preflight's TCPStore lets rank 0 name the host whose ranks did not come.
"""
from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import platform
import socket
import statistics
import struct
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from commodity_bert.data.masking import MASK_PROB
from commodity_bert.host import cpu_model, speaker
from commodity_bert.run_config import RunConfig
from commodity_bert.train.balance import SLOW_RANKS_ENV, slow_ranks

SLOW_LINK_RATIO = 0.5   # a direction below this share of the fastest one is reported
SIOCGIFADDR = 0x8915


say = speaker("bert-plan preflight")


# ---------------------------------------------------------------- where a rank is
def local_addresses() -> dict[str, str]:
    """This host's IPv4 address on each of its interfaces that has one."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                found[name] = socket.inet_ntoa(packed[20:24])
    return found


def interface_of(address: str) -> str | None:
    """The local interface that holds IPv4 `address`."""
    return next((name for name, held in local_addresses().items() if held == address), None)


def route_to(master_addr: str) -> tuple[str, str | None]:
    """The local address (and its interface) this host uses to reach the master."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(master_addr), 9))  # UDP: no packet is sent
        local = s.getsockname()[0]
    return local, interface_of(local)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model() or platform.processor() or 'cpu'} ({torch.get_num_threads()} threads)"


def launcher_hosts() -> list[tuple[str, int]] | None:
    """(host, ranks on it) in rank order, from DeepSpeed's launch.py (our parent) --world_info (in
    WORLD_INFO_ENV where bert-launch forked launch.py), or from srun's step (its node list and tasks
    a node: srun places ranks node by node)."""
    from commodity_bert.launcher_env import WORLD_INFO_ENV
    with contextlib.suppress(Exception):
        import psutil
        encoded = next((arg.split("=", 1)[1] for arg in psutil.Process(os.getppid()).cmdline()
                        if arg.startswith("--world_info=")), os.environ.get(WORLD_INFO_ENV))
        if encoded:
            info = json.loads(base64.urlsafe_b64decode(encoded))
            return [(host, len(slots)) for host, slots in info.items()]
    if "SLURM_STEP_NODELIST" in os.environ and "SLURM_STEP_TASKS_PER_NODE" in os.environ:
        from commodity_bert.launcher_env import expand_counts, expand_hostlist
        hosts = expand_hostlist(os.environ["SLURM_STEP_NODELIST"])
        counts = expand_counts(os.environ["SLURM_STEP_TASKS_PER_NODE"])
        if len(hosts) == len(counts):
            return list(zip(hosts, counts))
    return None


def rendezvous(rank: int, world: int, timeout_s: float) -> dist.Store:
    """Every rank announces where it runs; rank 0 names the hosts whose ranks never came."""
    master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    try:
        store = dist.TCPStore(master_addr, port, world, is_master=rank == 0, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - whatever the transport says, the line is the same
        with contextlib.suppress(OSError):
            own = {a: i for i, a in local_addresses().items()}.get(socket.gethostbyname(master_addr))
            if rank != 0 and own:
                say(f"problem: rank {rank} on {socket.gethostname()} cannot reach rank 0 at {master_addr}:{port}: "
                    f"{master_addr} is an address of this host too ({own}; every host with docker has 172.17.0.1), "
                    f"so it does not lead to rank 0's host; give --master_addr the address of rank 0's host on "
                    f"the interface the hosts share (bert-plan preflight prints it; docs/clusters.md)")
                sys.exit(1)
        say(f"problem: rank {rank} on {socket.gethostname()} cannot reach rank 0 at {master_addr}:{port} "
            f"within {timeout_s:.0f} s ({exc.__class__.__name__}): check that host's address, firewall and "
            f"--master_addr")
        sys.exit(1)
    local, iface = route_to(master_addr)
    here = {"host": socket.gethostname(), "address": local,
            "interface": os.environ.get("NCCL_SOCKET_IFNAME") or os.environ.get("GLOO_SOCKET_IFNAME") or iface,
            "routed_interface": iface, "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "addresses": local_addresses(),
            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "nccl_ifname": os.environ.get("NCCL_SOCKET_IFNAME")}
    store.set(f"where/{rank}", json.dumps(here))
    if rank == 0:
        keys = [f"where/{r}" for r in range(world)]
        deadline = time.time() + timeout_s
        while not store.check(keys) and time.time() < deadline:
            time.sleep(0.2)
        missing = [r for r in range(world) if not store.check([f"where/{r}"])]
        if missing:
            layout = launcher_hosts()
            names = []
            if layout:
                first = 0
                for host, count in layout:
                    ranks = set(range(first, first + count))
                    if ranks & set(missing):
                        names.append(f"{host} (rank {first})" if count == 1 else
                                     f"{host} (ranks {first}–{first + count - 1})")
                    first += count
            who = ", ".join(names) or f"ranks {', '.join(map(str, missing))}"
            say(f"problem: host unreachable: {who} did not join within {timeout_s:.0f} s; check ssh to it "
                f"(the launcher's output above), that it can reach {master_addr}:{port}, and --join-timeout")
            store.set("verdict", "abort")
            sys.exit(1)
        store.set("verdict", "go")
    store.wait(["verdict"], timedelta(seconds=timeout_s + 60))
    if store.get("verdict") != b"go":
        sys.exit(1)
    return store


# ---------------------------------------------------------------- compute
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 5) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times) / 1e12


def synthetic_batches(micro_batch: int, seq_len: int, vocab_size: int, count: int, nsp: bool):
    """Full-length sequences with 15% of positions masked: the worst case, no padding."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(count):
        ids = torch.randint(1000, vocab_size, (micro_batch, seq_len), generator=generator)
        picks = max(1, int(MASK_PROB * seq_len))
        positions = torch.stack([torch.randperm(seq_len - 1, generator=generator)[:picks] + 1
                                 for _ in range(micro_batch)])
        flat = (positions + torch.arange(micro_batch).unsqueeze(1) * seq_len).reshape(-1)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids),
                 "masked_index": flat, "masked_labels": ids.reshape(-1)[flat],
                 "real_tokens": torch.tensor(micro_batch * seq_len)}
        if nsp:
            batch["next_sentence_labels"] = torch.zeros(micro_batch, dtype=torch.long)
        yield batch


def measure_training_step(args, given: RunConfig, device: torch.device, rank: int, world: int) -> dict:
    """Forward + backward of one micro-batch and the optimizer's step, with DeepSpeed's engine
    and precision wrappers but without its gradient allreduce; then 1-bit LAMB's step in its
    compression stage, its compressed allreduce on a one-rank group (the work, not the wire)."""
    from commodity_bert.data.dataset import ShardSet
    from commodity_bert.data.loader import TrainingBatches
    from commodity_bert.model.bert import build_config, training_flops
    from commodity_bert.model.sections import pretraining_recipe

    measured_optimizer = given.optimizer_type or "Lamb"
    # one rank's config: its data-parallel group is itself, and one step has no schedule
    config = {k: v for k, v in given.for_deepspeed().items() if k not in ("scheduler", "gradient_accumulation_steps")}
    config["train_micro_batch_size_per_gpu"] = args.micro_batch
    config["train_batch_size"] = args.micro_batch
    params_block = dict(given.optimizer_params)
    onebit_params = {"lr": params_block.get("lr", 1e-3), "weight_decay": params_block.get("weight_decay", 0.01),
                     "scale_block": params_block.get("scale_block", 256)}
    if given.optimizer_type == "OneBitLamb":  # its warmup step is LAMB's
        params = {k: v for k, v in params_block.items() if not k.startswith(("freeze", "factor"))
                  and k not in ("coeff_beta", "scale_block")}
        config["optimizer"] = {"type": "Lamb", "params": params}
    if args.data:
        data = ShardSet.open(args.data)
        vocab_size, nsp = data.vocab_size, data.nsp
        seq_len = data.manifest.get("seq_len", args.seq_len)
        # with the loader's worker processes, as train.py runs them: on a CPU they share its cores
        # at the config's masking rate, which sets the MLM head's work
        batches = iter(TrainingBatches(data, rank, world, args.micro_batch, seed=0, num_workers=args.num_workers,
                                       mask_prob=pretraining_recipe(given).get("mask_prob")))
    else:
        vocab_size, nsp, seq_len = args.vocab_size, True, args.seq_len
        batches = synthetic_batches(args.micro_batch, seq_len, vocab_size, 2 * args.steps + 4, nsp)
    model_config = build_config(args.model, vocab_size)

    from commodity_bert.train.engine import OneRankGroup
    alone = OneRankGroup()  # each rank measures its own step, all at once
    lamb = timed_steps(config, model_config, nsp, batches, device, args.steps, alone)
    onebit_config = {**config, "optimizer": {"type": "OneBitLamb", "params": {**onebit_params, "freeze_step": 1}}}
    onebit = timed_steps(onebit_config, model_config, nsp, batches, device, args.steps, alone, compress=True)
    del batches
    lowbit_s = time_lowbit_average(lamb["params"], device, alone.group, args.steps)
    sparse_encode_s, sparse_decode_s = time_sparse_coding(lamb["params"], device, args.steps)
    fb_s, optimizer_s = statistics.median(lamb["fb"]), statistics.median(lamb["opt"])
    fb_s *= slow_ranks(os.environ.get(SLOW_RANKS_ENV), rank)[0]  # a rank slowed on purpose (tests, benchmarks)
    flops = [training_flops(model_config, tokens, args.micro_batch * width * width, masked)
             for tokens, width, masked in lamb["shapes"]]
    return {"model": args.model, "params": lamb["params"], "seq_len": seq_len, "micro_batch": args.micro_batch,
            "vocab_size": vocab_size, "nsp": nsp, "optimizer": measured_optimizer,
            "data": str(args.data) if args.data else "synthetic full-length sequences",
            "real_token_share": statistics.mean(lamb["real"]),
            "forward_backward_s": fb_s, "optimizer_s": optimizer_s,
            # waiting for the batch and moving it, beyond forward + backward + optimizer
            "loop_overhead_s": max(0.0, statistics.median(lamb["whole"]) - fb_s - optimizer_s
                                   - statistics.median(lamb["sync"])),
            # DeepSpeed's gradient allreduce without the network (flatten, scale, unflatten, copy
            # back) and train.py's gradient norm of the averaged gradients
            "grad_sync_local_s": statistics.median(lamb["sync"]),
            "onebit_optimizer_s": statistics.median(onebit["opt"]), "scale_block": onebit_params["scale_block"],
            "lowbit_average_s": lowbit_s,
            "sparse_encode_s": sparse_encode_s, "sparse_decode_s": sparse_decode_s,
            "model_flops_per_micro_batch": statistics.mean(flops),
            "model_tflops": statistics.mean(flops) / fb_s / 1e12}


def time_sparse_coding(params: int, device: torch.device, calls: int) -> tuple[float, float]:
    """DiLoCo's sparse exchange's own passes (collectives/sparse.py) on a parameter-sized Δ, 1% in
    2 bits: the top-k, coding and feedback a round takes once, and the decoding of one payload it
    takes once per rank (medians of `calls` after one to warm up). Not the wire."""
    from commodity_bert.collectives.sparse import CHUNK, decode_into, encode
    delta = torch.randn(-(-params // CHUNK) * CHUNK, device=device) * 1e-3
    encode_times, decode_times = [], []
    for _ in range(calls + 1):
        sync(device)
        start = time.perf_counter()
        payload, sent = encode(delta, 0.01, 2)
        residual = delta - sent
        sync(device)
        middle = time.perf_counter()
        decode_into(torch.zeros_like(residual), payload, 0.01, 2)
        sync(device)
        encode_times.append(middle - start)
        decode_times.append(time.perf_counter() - middle)
    return statistics.median(encode_times[1:]), statistics.median(decode_times[1:])


def time_lowbit_average(params: int, device: torch.device, group, calls: int) -> float:
    """DiLoCo's int4 average with error feedback (collectives/lowbit.py) of a parameter-sized pseudo-
    gradient on this rank's one-rank group: its quantize, pack, unpack and feedback passes, not
    the wire (median of `calls` after one to warm up). On CPU ranks these passes take as long as
    several inner steps' optimizer and are no less in a streamed exchange: they share its cores."""
    from commodity_bert.collectives.lowbit import LowBitAverage
    average = LowBitAverage(params, 4, device, group, "nearest", True, 0)
    delta = torch.randn(params, device=device) * 1e-3
    times = []
    for _ in range(calls + 1):
        sync(device)
        start = time.perf_counter()
        average(delta)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def timed_steps(config: dict, model_config, nsp: bool, batches, device: torch.device, steps: int,
                alone, compress: bool = False) -> dict:
    """Two steps to warm up (and, for 1-bit LAMB, to freeze), then `steps` timed ones, on the
    engine train.py builds (train/engine.py) with this rank alone as its data-parallel group
    (`alone`): DeepSpeed's own gradient allreduce runs between backward and the optimizer step,
    timed apart, its memory passes without the wire. With `compress`, 1-bit LAMB's compressed
    allreduce runs on that group too."""
    from commodity_bert.collectives.onebit_allreduce import CompressedAllreduce
    from commodity_bert.comm.grad_norm import gradient_norm
    from commodity_bert.model.bert import PretrainingModel, build_model
    from commodity_bert.model.sections import attention_layout
    from commodity_bert.optim.precision import current_loss_scale, loss_for_backward
    from commodity_bert.train.engine import build_engine

    torch.manual_seed(0)
    model = PretrainingModel(build_model(model_config, nsp=nsp), attention=attention_layout(config))
    engine, optimizer, _, mode, _ = build_engine(config, model, mpu=alone)
    mode.attach(engine, optimizer, model)
    engine.enable_backward_allreduce = False  # called below, timed apart
    loss_to_backward = loss_for_backward(engine)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if compress:
        optimizer.compressor = CompressedAllreduce(params, device, group=alone.group, scale_block=optimizer.scale_block)
    out = {"params": params, "fb": [], "opt": [], "sync": [], "whole": [], "shapes": [], "real": []}
    for i in range(steps + 2):
        sync(device)
        fetch = time.perf_counter()
        batch = next(batches)
        batch = {k: v.to(device) for k, v in batch.items()}
        sync(device)
        start = time.perf_counter()
        loss, _ = engine(batch)
        engine.backward(loss_to_backward(loss))
        sync(device)
        middle = time.perf_counter()
        if not compress:
            engine.allreduce_gradients()
            # train.py reads the gradient norm at every step where DeepSpeed averaged the gradients
            gradient_norm(model.parameters(), current_loss_scale(engine.optimizer))
            sync(device)
        synced = time.perf_counter()
        engine.step()
        sync(device)
        end = time.perf_counter()
        if i >= 2:
            out["fb"].append(middle - start)
            out["sync"].append(synced - middle)
            out["opt"].append(end - synced)
            out["whole"].append(end - fetch)
            mask = batch["attention_mask"]
            out["shapes"].append((int(batch["real_tokens"]), mask.shape[1], int(batch["masked_index"].numel())))
            out["real"].append(int(batch["real_tokens"]) / mask.numel())
    if compress and not optimizer.frozen:
        raise RuntimeError("preflight: 1-bit LAMB did not reach its compression stage")
    del engine, model, optimizer
    return out


# ---------------------------------------------------------------- network
def timed_allreduce(size_bytes: int, device: torch.device, repeats: int) -> float:
    tensor = torch.ones(size_bytes // 4, device=device)
    times = []
    for _ in range(repeats):
        dist.barrier()
        sync(device)
        start = time.perf_counter()
        dist.all_reduce(tensor)
        sync(device)
        times.append(time.perf_counter() - start)
    # every rank's view: the collective ends when its slowest member does
    worst = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares t = a + b·x; a clipped at 0 (latency cannot be negative). Where the times do
    not grow with the size (a link so fast that noise decides, e.g. loopback on a busy machine:
    4 MB measured faster than 1 MB) the slope is meaningless: t = b·x through the origin instead,
    which bounds the bandwidth from below."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else my / mx
    a = my - b * mx
    if a < 0 or b <= 0:
        b, a = sum(x * y for x, y in points) / sum(x * x for x, _ in points), 0.0
    return a, b


def allreduce_sweep(args, device: torch.device, world: int) -> dict:
    """Allreduce of each size on the training backend; sizes that would overrun the time budget
    at the bandwidth measured so far are skipped (and said so)."""
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    rows, skipped, spent = [], [], 0.0
    timed_allreduce(2**20, device, 1)  # connections up
    for mb in sizes:
        size = int(mb * 2**20)
        repeats = 3
        if rows:
            per_byte = rows[-1]["seconds"] / rows[-1]["bytes"]
            guess = size * per_byte
            repeats = 3 if guess * 3 < 0.2 * args.comm_budget_s else 1
            if spent + guess * repeats > args.comm_budget_s:
                skipped.append(mb)
                continue
        seconds = timed_allreduce(size, device, repeats)
        spent += seconds * repeats
        sent = 2 * (world - 1) / world * size
        rows.append({"mb": mb, "bytes": size, "seconds": seconds, "algbw_gbit_s": size / seconds * 8 / 1e9,
                     "busbw_gbit_s": sent / seconds * 8 / 1e9})
    result = {"world": world, "sizes": rows, "skipped_mb": skipped}
    if world > 1 and len(rows) >= 2:
        latency, per_byte = fit_line([(2 * (world - 1) / world * r["bytes"], r["seconds"]) for r in rows])
        result["fit"] = {"latency_s": latency, "latency_per_hop_s": latency / (2 * (world - 1)),
                         "bus_bytes_per_s": 1 / per_byte, "bus_gbit_s": 8 / per_byte / 1e9}
    return result


def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs covering every pair once (the circle method; a bye when n is odd)."""
    members = list(range(n)) + ([None] if n % 2 else [])
    rounds = []
    for _ in range(len(members) - 1):
        half = len(members) // 2
        pairs = [(members[i], members[-1 - i]) for i in range(half)]
        rounds.append([(a, b) for a, b in pairs if a is not None and b is not None])
        members = [members[0], members[-1], *members[1:-1]]
    return rounds


def link_matrix(leaders: list[int], hosts: list[str], rank: int, device: torch.device, size: int) -> list[dict]:
    """Each pair of hosts' leaders sends `size` bytes one way, then the other, twice; a
    direction's bandwidth is what its receiver saw (the better try). One direction at a time:
    a saturated uplink would also slow the other direction's acknowledgements."""
    mine = []
    payload = torch.ones(size // 4, device=device)
    incoming = torch.empty_like(payload)
    for pairs in round_robin(len(leaders)):
        for a, b in pairs:
            if rank not in (leaders[a], leaders[b]):
                continue
            for sender, receiver in ((leaders[a], leaders[b]), (leaders[b], leaders[a])):
                best = float("inf")
                for _ in range(2):
                    if rank == sender:
                        dist.send(payload, dst=receiver)
                        dist.recv(incoming[:1], src=receiver)  # go-ahead for the next try
                    else:
                        sync(device)
                        start = time.perf_counter()
                        dist.recv(incoming, src=sender)
                        sync(device)
                        best = min(best, time.perf_counter() - start)
                        dist.send(payload[:1], dst=sender)
                if rank == receiver:
                    mine.append({"from": hosts[leaders.index(sender)], "to": hosts[leaders.index(receiver)],
                                 "gbit_s": size * 8 / best / 1e9})
        dist.barrier()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [row for part in everyone for row in part]


def link_problems(links: list[dict]) -> list[str]:
    """Directions much slower than the fastest, put down to the one host they all touch when
    there is one (with two hosts, to the sender: tc and half-duplex ports slow one direction)."""
    if len(links) < 2:
        return []
    fastest = max(links, key=lambda r: r["gbit_s"])
    slow = [r for r in links if r["gbit_s"] < SLOW_LINK_RATIO * fastest["gbit_s"]]
    if not slow:
        return []
    reference = (f"under {SLOW_LINK_RATIO:.0%} of the fastest direction ({fastest['from']} → {fastest['to']}, "
                 f"{fastest['gbit_s'] * 1000:.0f} Mbit/s)")
    fix = "check its NIC's speed and duplex (ethtool), cable, switch port and traffic shaping (tc)"
    common = set.intersection(*({r["from"], r["to"]} for r in slow))
    senders = {r["from"] for r in slow}
    if len(common) > 1 and len(senders) == 1:
        common = senders
    if len(common) == 1:
        host = next(iter(common))
        parts = [f"sends {r['gbit_s'] * 1000:.0f} Mbit/s to {r['to']}" if r["from"] == host else
                 f"receives {r['gbit_s'] * 1000:.0f} Mbit/s from {r['from']}" for r in slow]
        return [f"slow link: {host} {', '.join(parts)}, {reference}; {fix}"]
    return [f"slow link: {r['from']} → {r['to']} at {r['gbit_s'] * 1000:.0f} Mbit/s, {reference}; {fix}"
            for r in slow]


def nccl_accepts(spec: str, iface: str) -> bool:
    """Whether NCCL_SOCKET_IFNAME `spec` lets NCCL use `iface`: a comma list of name prefixes,
    "=" before it for exact names, "^" to exclude those instead."""
    exclude, spec = spec.startswith("^"), spec.lstrip("^")
    exact, spec = spec.startswith("="), spec.lstrip("=")
    hit = any(iface == name if exact else iface.startswith(name) for name in spec.split(",") if name)
    return hit != exclude


def interface_plan(where: list[dict], routes: dict[str, dict[str, str | None]], backend: str) \
        -> tuple[list[str], list[str], bool]:
    """Per host, the interface whose route reaches the other hosts and its address; problems with
    what is configured (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME naming another interface); the
    lines to paste. `routes`: per host, the interface its route to each other host takes. Returns
    (lines to say, problems, whether a problem would hang `backend`'s collectives)."""
    hosts = list(dict.fromkeys(w["host"] for w in where))
    leader = {h: next(w for w in where if w["host"] == h) for h in hosts}
    if len(hosts) < 2:
        return [], [], False
    lines, problems, blocking = [], [], False
    reach = {}
    for host in hosts:
        used = {iface for iface in routes[host].values() if iface}
        reach[host] = next(iter(used)) if len(used) == 1 else None
        if reach[host] is None:
            problems.append(f"{host} reaches the other hosts through several interfaces "
                            f"({', '.join(f'{peer}: {iface}' for peer, iface in sorted(routes[host].items()))}); "
                            f"the collectives need one network: check its routes (ip route)")
            continue
        address = leader[host]["addresses"].get(reach[host], "?")
        lines.append(f"{host}: {reach[host]} {address} reaches {', '.join(p for p in hosts if p != host)}")
    for host in hosts:
        iface = reach[host]
        if iface is None:
            continue
        for variable, key, accepts, used_by in (
                ("GLOO_SOCKET_IFNAME", "gloo_ifname", lambda spec: iface in spec.split(","), "gloo"),
                ("NCCL_SOCKET_IFNAME", "nccl_ifname", lambda spec: nccl_accepts(spec, iface), "nccl")):
            spec = leader[host].get(key)
            if spec and not accepts(spec):
                problems.append(f"{host}: {variable}={spec} does not reach the other hosts ({host} reaches them "
                                f"through {iface}); set {variable}={iface}")
                blocking |= used_by == backend
    names = sorted({iface for iface in reach.values() if iface})
    rank0 = where[0]
    master_iface = reach.get(rank0["host"])
    if names:
        lines.append("to paste into .deepspeed_env (DeepSpeed's launcher) or to export before "
                     "recipes/slurm/pretrain.sbatch (docs/clusters.md, \"Network interface\"):")
        lines.append(f"  NCCL_SOCKET_IFNAME={','.join(names)}")
        if len(names) == 1:
            lines.append(f"  GLOO_SOCKET_IFNAME={names[0]}")
        else:
            lines.append("  GLOO_SOCKET_IFNAME: the hosts' interfaces differ (" + ", ".join(
                f"{h}: {reach[h]}" for h in hosts if reach[h]) + "); set it in each host's own environment")
        if master_iface and master_iface in rank0["addresses"]:
            lines.append(f"  MASTER_ADDR={rank0['addresses'][master_iface]}   "
                         f"(deepspeed: --master_addr; rank 0's host, {rank0['host']}, on {master_iface}; "
                         f"not for Slurm: pretrain.sbatch works it out on every start)")
    return lines, problems, blocking


def check_interfaces(store: dist.Store, rank: int, world: int, backend: str, timeout_s: float) -> list[str]:
    """Before any collective (a wrong interface would hang the first one): each host's first rank
    finds the interface its route to every other host takes; rank 0 says where each host is
    reached, what to paste, and the configured names that lead elsewhere, and stops every rank
    where they would hang this backend. Returns the problems."""
    where = [json.loads(store.get(f"where/{r}")) for r in range(world)]
    hosts = list(dict.fromkeys(w["host"] for w in where))
    first = {h: next(r for r, w in enumerate(where) if w["host"] == h) for h in hosts}
    me = where[rank]["host"]
    if first[me] == rank:
        mine = {}
        for host in hosts:
            if host != me:
                with contextlib.suppress(OSError):
                    mine[host] = route_to(where[first[host]]["address"])[1]
        store.set(f"routes/{rank}", json.dumps(mine))
    if rank != 0:
        store.wait(["interfaces"], timedelta(seconds=timeout_s + 60))
        if store.get("interfaces") != b"go":
            sys.exit(1)
        return []
    store.wait([f"routes/{first[h]}" for h in hosts], timedelta(seconds=timeout_s))
    routes = {h: json.loads(store.get(f"routes/{first[h]}")) for h in hosts}
    lines, problems, blocking = interface_plan(where, routes, backend)
    say(*lines)
    if blocking:
        for problem in problems:
            say(f"problem: {problem}")
        say("stopping before the first collective, which would hang on that interface")
        store.set("interfaces", "abort")
        sys.exit(1)
    store.set("interfaces", "go")
    return problems


def slow_rank_problems(ranks: list[dict], ratio: float = 1.5) -> list[str]:
    """Ranks whose forward + backward takes `ratio` times the median or more: every rank waits for
    the slowest at each step, so one slow GPU sets the cluster's pace."""
    if len(ranks) < 2:
        return []
    median = statistics.median(r["forward_backward_s"] for r in ranks)
    return [f"slow rank: rank {r['rank']} on {r['host']} ({r['device']}) takes {r['forward_backward_s']:.3g} s a "
            f"forward + backward, {r['forward_backward_s'] / median:.1f}x the median {median:.3g} s; every rank "
            f"waits for it at each step: check its clocks and temperature (nvidia-smi -q -d PERFORMANCE), other "
            f"jobs on it, leave it out of the hostfile, or deal it fewer micro-batches: \"balance\": "
            f"{{\"split\": \"speed\"}} (docs/clusters.md)"
            for r in ranks if r["forward_backward_s"] >= ratio * median]


def interface_problems(where: list[dict]) -> list[str]:
    by_host = {}
    for w in where:
        by_host.setdefault(w["host"], set()).add(w["interface"])
    names = {iface for ifaces in by_host.values() for iface in ifaces}
    if len(by_host) < 2 or len(names) < 2:
        return []
    detail = "; ".join(f"{host}: {', '.join(sorted(map(str, ifaces)))}" for host, ifaces in sorted(by_host.items()))
    return [f"ranks on different interfaces ({detail}): the collectives may take a slow or wrong path; "
            f"set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the cluster network's interface in .deepspeed_env"]


# ---------------------------------------------------------------- main
def run(args) -> int:
    from commodity_bert.plan.report import preflight_tables
    from commodity_bert.train.launch_checks import LaunchError, load_deepspeed_config

    from commodity_bert.launcher_env import adopt_launcher_environment
    adopt_launcher_environment()  # torchrun's and srun's names for the rank, as DeepSpeed's launcher gives them
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:  # as train.py: ranks of a host share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", "1"))))
    try:
        config = load_deepspeed_config(args.deepspeed_config) if args.deepspeed_config else RunConfig.parse({
            "optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            **({"bf16": {"enabled": True}} if args.precision == "bf16" else
               {"fp16": {"enabled": True, "initial_scale_power": 16}} if args.precision == "fp16" else {})})
    except LaunchError as exc:
        if rank == 0:
            say(f"error: {exc}")
        return 2
    precision = config.precision
    if args.micro_batch is None:
        args.micro_batch = int(config.micro_batch or 8)

    store = rendezvous(rank, world, args.join_timeout)
    backend = "nccl" if on_cuda else "gloo"
    interface_lines = check_interfaces(store, rank, world, backend, args.join_timeout)
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                            timeout=timedelta(minutes=30))
    import deepspeed
    deepspeed.init_distributed(dist_backend=backend)
    where = [json.loads(store.get(f"where/{r}")) for r in range(world)]
    if rank == 0:
        say(f"{world} ranks on {len({w['host'] for w in where})} hosts joined; measuring compute")

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.float32  # CPUs have no fast fp16 matmul; DeepSpeed's fp16 keeps fp32 masters there too
    mine = {"rank": rank, **where[rank], "device": device_name(device),
            "matmul_tflops": matmul_tflops(device, dtype, args.matmul_size or (8192 if on_cuda else 1024)),
            **measure_training_step(args, config, device, rank, world)}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)

    if rank == 0:
        say("measuring the network" if len({w["host"] for w in where}) > 1 else "measuring allreduce")
    sweep = allreduce_sweep(args, device, world)
    hosts = list(dict.fromkeys(w["host"] for w in where))
    leaders = [next(r for r, w in enumerate(where) if w["host"] == h) for h in hosts]
    links = []
    if len(hosts) > 1:
        fit = sweep.get("fit")
        size = int(min(args.link_mb * 2**20, max(2**20, (fit["bus_bytes_per_s"] if fit else 2**30) * 1.0)))
        links = link_matrix(leaders, hosts, rank, device, size)
    if rank != 0:
        dist.barrier()
        return 0

    problems = interface_lines + interface_problems(where) + link_problems(links) + slow_rank_problems(ranks)
    profile = {
        "version": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv),
        "backend": backend, "precision": precision, "world_size": world, "hosts": len(hosts),
        "gpus_per_node": max(sum(1 for w in where if w["host"] == h) for h in hosts),
        "ranks": ranks, "allreduce": sweep, "links": links, "problems": problems,
        "deepspeed_config": str(args.deepspeed_config) if args.deepspeed_config else None,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(profile, indent=1))
    tmp.replace(out)
    print(preflight_tables(profile), flush=True)
    for problem in problems:
        say(f"problem: {problem}")
    say(f"wrote {out}" + (f" ({len(problems)} problem{'s' * (len(problems) > 1)})" if problems else ""))
    dist.barrier()
    return 1 if problems else 0
