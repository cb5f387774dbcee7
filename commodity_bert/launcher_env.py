"""What a rank needs from whichever launcher started it, in the names train.py and DeepSpeed read.

DeepSpeed's launcher exports RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK, MASTER_ADDR
and MASTER_PORT. The other two launchers users run the recipe with say the same in their own
words, and `deepspeed.init_distributed` reads only its own (failing that, it looks for MPI):

  torchrun   RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as DeepSpeed's (from its c10d
             rendezvous), but a node's rank count as LOCAL_WORLD_SIZE and the node as GROUP_RANK
  srun       SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NUM_TASKS, SLURM_NODEID, the step's tasks per
             node (SLURM_STEP_TASKS_PER_NODE, e.g. "4(x2),2" for nodes of 4, 4 and 2) and its hosts
             (SLURM_STEP_NODELIST, e.g. "gpu[01-03]"); no address or port to meet at

`rank_environment` fills in what is missing from what is there (a variable already set is
kept): the rendezvous address of a bare srun is the step's first host (Slurm's NodeAddr for it
where its name does not resolve, as pretrain.sbatch takes it), its port 15000 plus the job id's
last four digits (as PyTorch Lightning picks it), so the tasks of one step agree without talking
and two jobs on one node do not collide."""
from __future__ import annotations

import os
import re
import socket
import subprocess

# DeepSpeed's launch.py holds every host and its slots in its command line (--world_info=, base64
# JSON), which a rank reads from its parent's; a launch.py that bert-launch forked has bert-launch's
# command line, and passes the same value to its ranks in this variable
WORLD_INFO_ENV = "COMMODITY_BERT_WORLD_INFO"


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list ("gpu[01-03,07],cpu1") as names, in order."""
    hosts = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", hostlist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            for n in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{n:0{len(first)}d}")
    return hosts


def expand_counts(counts: str) -> list[int]:
    """Slurm's compressed counts per node ("4(x2),2") as one count a node ([4, 4, 2])."""
    out = []
    for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", counts):
        out.extend([int(count)] * int(repeat or 1))
    return out


def node_address(host: str) -> str:
    """`host` where its name resolves, else its NodeAddr as Slurm knows it (`scontrol show node`)."""
    try:
        socket.getaddrinfo(host, None)
        return host
    except OSError:
        pass
    try:
        shown = subprocess.run(["scontrol", "show", "node", "-o", host], capture_output=True, text=True,
                               timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return host
    found = re.search(r"\bNodeAddr=(\S+)", shown)
    return found.group(1) if found else host


def launched_by(env=os.environ) -> str:
    """Which launcher started this process: "deepspeed", "torchrun", "srun" or "none"."""
    if "CROSS_RANK" in env or ("RANK" in env and "LOCAL_SIZE" in env):
        return "deepspeed"
    if "TORCHELASTIC_RUN_ID" in env or "LOCAL_WORLD_SIZE" in env:
        return "torchrun"
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env and "RANK" not in env:
        return "srun"
    return "none"


def rank_environment(env=os.environ) -> dict[str, str]:
    """The DeepSpeed launcher's variables this rank lacks, from torchrun's or srun's."""
    launcher = launched_by(env)
    found: dict[str, str] = {}
    if launcher == "torchrun":
        found = {"LOCAL_SIZE": env.get("LOCAL_WORLD_SIZE", "1"), "CROSS_RANK": env.get("GROUP_RANK", "")}
    elif launcher == "srun":
        node = int(env.get("SLURM_NODEID", "0"))
        per_node = expand_counts(env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1")))
        hosts = expand_hostlist(env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1")))
        found = {"RANK": env["SLURM_PROCID"], "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
                 "WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"],
                 "LOCAL_SIZE": str(per_node[node] if node < len(per_node) else 1),
                 "CROSS_RANK": str(node), "MASTER_ADDR": env.get("MASTER_ADDR") or node_address(hosts[0]),
                 "MASTER_PORT": str(15000 + int(env.get("SLURM_JOB_ID", "0")[-4:] or 0))}
    return {k: v for k, v in found.items() if v != "" and k not in env}


def adopt_launcher_environment() -> str:
    """Export rank_environment() into this process; returns the launcher's name."""
    launcher = launched_by()
    os.environ.update(rank_environment())
    return launcher
