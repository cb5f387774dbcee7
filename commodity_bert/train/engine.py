"""The engine a run trains with: the communication mode chosen from the config, the optimizer
it names, and DeepSpeed's engine around both. train.py builds it once per run; `bert-plan
preflight` builds the same one to time a training step, so that what it times is what trains."""
from __future__ import annotations

from typing import Any, NamedTuple

import deepspeed
import torch.distributed as dist

from commodity_bert.comm import mode as comm_mode
from commodity_bert.optim import head_warmup
from commodity_bert.optim.build import build_optimizer
from commodity_bert.optim.precision import one_pass_master_step
from commodity_bert.run_config import RunConfig
from commodity_bert.train.metrics import without_our_monitors


class Engine(NamedTuple):
    engine: Any           # deepspeed.DeepSpeedEngine
    optimizer: Any        # the client optimizer (the engine wraps it under fp16/bf16)
    scheduler: Any        # the config's scheduler, or None
    mode: comm_mode.CommMode
    ds_config: dict       # the JSON as DeepSpeed got it, with the mode's changes


class OneRankGroup:
    """DeepSpeed's model-parallel unit (`deepspeed.initialize(mpu=...)`) whose data-parallel group
    is this rank alone: the engine's own gradient allreduce then runs all its memory passes
    (flatten, average, copy back) without the wire. For measuring a step while every rank of the
    world measures at once (preflight); a run trains with mpu=None, over the world."""

    def __init__(self):
        rank = dist.get_rank()
        for r in range(dist.get_world_size()):  # every rank takes part in making every group
            group = dist.new_group([r])
            if r == rank:
                self.group = group

    def get_data_parallel_group(self):
        return self.group

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1

    # no model parallelism: the same one-rank group
    get_model_parallel_group = get_data_parallel_group
    get_model_parallel_rank = get_data_parallel_rank
    get_model_parallel_world_size = get_data_parallel_world_size


def build_engine(config: RunConfig | dict, model, mpu: OneRankGroup | None = None,
                 node_local_checkpoints: bool = False, batch: tuple[int, int, int] | None = None) -> Engine:
    """`batch`: (global, micro, accumulation) as the launch resolved them for its world size."""
    config = RunConfig.of(config)
    mode = comm_mode.select(config)
    optimizer, parameters = build_optimizer(config, model)
    ds_config = mode.deepspeed_config(config.for_deepspeed(without_optimizer=optimizer is not None,
                                                           node_local_checkpoints=node_local_checkpoints,
                                                           batch=batch))
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=parameters,
                                                   config=without_our_monitors(ds_config), mpu=mpu)
    one_pass_master_step(engine)  # fp16/bf16 at ZeRO 0: the wrapper's step on all tensors at once
    scheduler = head_warmup.install(engine, config)  # the encoder's rate scaled while a fresh head learns
    return Engine(engine, optimizer, scheduler, mode, ds_config)
