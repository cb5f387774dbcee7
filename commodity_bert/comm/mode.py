"""A communication mode is one object: how the ranks' gradients (or parameters) travel, behind
the handful of hooks train.py's loop calls. The loop reads batch → forward → backward → step →
log/eval/save and names no mode; each mode says, in one class, what it changes:

    deepspeed_config(config)  the config DeepSpeed gets (its own allreduce and clipping off where
                              the mode replaces them)
    attach(engine, optimizer, model, topology) / resume(state, rank_state, where) / ready()
                              wiring into the engine (and, for the compressed exchanges, into
                              the nodes: comm/topology.py), rank-local checkpoint state, objects
                              built from the weights the run starts from
    micro_batch(boundary)     around forward and backward (DiLoCo: the engine's allreduce off)
    after_backward()          on the last micro-batch, before engine.step(): the gradient norm
                              (measured without extra traffic where it can be), clipping
    after_step(step, last)    after engine.step() (DiLoCo: the outer step at a round's end)
    grad_norm()               the step's norm for the metrics, and whether it is this rank's own
    shared_model()            the model every rank shares, for evaluation and export
    state()                   (checkpoint state shared by the ranks, this rank's own state)
    metric_fields()           the mode's fields in a logged row
    refusal(config, stage)    what it cannot be combined with, as one line (launch checks)

`select(config)` picks the mode from the DeepSpeed config once. A new mode is a subclass here
(or beside its machinery) added to MODES, and a line in MODE_CASES (tests/conftest.py), which
tests/test_comm_modes.py runs.

Written here, not as DeepSpeed engine hooks, because DeepSpeed has none for "allreduce something
else instead of the gradients" or "no allreduce for H steps": its 1-bit optimizers did it from
inside the optimizer with `enable_backward_allreduce`, which is what these objects switch.
"""
from __future__ import annotations

import contextlib

import torch

from commodity_bert.comm.bucketwise import BucketwiseClipAllreduce, bucketwise_settings
from commodity_bert.comm.diloco import DiLoCo, check_settings, diloco_settings
from commodity_bert.comm.grad_norm import gradient_norm
from commodity_bert.comm.topology import Hierarchy, Topology, hierarchy_setting
from commodity_bert.optim.precision import MasterParams, current_loss_scale
from commodity_bert.optim.registry import of_config
from commodity_bert.run_config import RunConfig


def compressing_optimizer(config: RunConfig) -> bool:
    """The config's optimizer sends its own compressed exchange instead of the gradient allreduce."""
    entry = of_config(config)
    return entry is not None and entry.compresses


class ModeStateError(Exception):
    """A checkpoint this mode cannot resume from; the message is the one line to print."""


class CommMode:
    """DeepSpeed's own gradient allreduce, after every step's backward (ZeRO 0, 1 or 2): the
    default mode, and what every hook does where a mode changes nothing there."""

    name = "allreduce"
    ranks_step_alone = False  # each rank steps on its own gradients between exchanges

    @staticmethod
    def enabled(config: RunConfig) -> bool:
        return True

    @classmethod
    def refusal(cls, config: RunConfig, stage: int) -> str | None:
        return None

    def __init__(self, config: RunConfig):
        self.config = config
        self.zero_stage = config.zero_stage
        self.local_clip = 0.0
        self.unlogged = contextlib.nullcontext
        self._measure, self._norm = False, (None, False)
        self.hierarchy_setting = hierarchy_setting(config)
        self.hierarchy: Hierarchy | None = None

    # ---- set-up
    def deepspeed_config(self, config: dict) -> dict:
        """The JSON DeepSpeed gets (RunConfig.for_deepspeed's), with this mode's changes."""
        return config

    def attach(self, engine, optimizer, model, topology: Topology | None = None) -> list[str]:
        """Wire into the engine; returns lines for rank 0 to print. `topology`: which ranks share a
        node (None: as if each had its own)."""
        self.engine, self.optimizer, self.params = engine, optimizer, list(model.parameters())
        self.masters = MasterParams(engine.optimizer)  # the fp32 tensors stepped, and the way into the model
        return []

    def _two_levels(self, topology: Topology | None, between: str) -> list[str]:
        """For modes whose exchange is compressed: full precision inside a node and `between` (what
        travels) between nodes, where the topology and the config's hierarchy block say so."""
        if topology is None:
            return []
        chosen, line = topology.choose(self.hierarchy_setting)
        if not chosen:
            return [line] if line else []
        self.hierarchy = topology.hierarchy()  # collective: every rank makes the same choice
        line = f"exchange in two levels ({topology.describe()}): fp32 inside a node, {between} between nodes"
        if len(set(topology.ranks_per_node)) > 1:
            slices = self.hierarchy.slices
            line += (f", in {slices} slice{'s' if slices > 1 else ''} (the smallest node's ranks), each node's sum "
                     f"weighted by its ranks")
        return [line]

    def resume(self, state: dict, rank_state: dict, where) -> None:
        """After DeepSpeed's checkpoint is loaded: the mode's part of it."""

    def ready(self) -> list[str]:
        """The weights the run starts from are in place (fresh, resumed or --init-from)."""
        return []

    def begin(self, unlogged) -> None:
        """The loop starts; collectives inside `unlogged()` are the loop's own, not training's."""
        self.unlogged = unlogged

    # ---- the loop
    def start_step(self, logged: bool) -> None:
        # free to measure every step where DeepSpeed averaged the gradients; else at logged steps
        self._measure = self.zero_stage == 0 and (logged or self.grads_averaged())
        self._norm = (None, False)

    def micro_batch(self, boundary: bool):
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        if self._measure:
            self._norm = self._gradient_norm()
        if self.local_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.local_clip)

    def after_step(self, step: int, last: bool) -> None:
        pass

    def balance(self, weight: float) -> None:
        """This rank now trains `weight` times the equal split's micro-batches a step (data/deal.py).
        Where DeepSpeed averages the gradients nothing changes: each micro-batch's loss is divided
        by the same accumulation on every rank, so the average is over the step's micro-batches,
        whoever trained them. 1-bit LAMB's and 0/1 Adam's averaged momenta and updates are linear
        in those gradients, so they too weigh each rank by its micro-batches."""

    def grad_norm(self) -> tuple:
        """(the norm or None, whether it is this rank's own, to be combined in the row)."""
        norm, own = self._norm
        if norm is None and (self.zero_stage or self._measure):  # ZeRO, or DeepSpeed's own flat buffers
            norm = self.engine.get_global_grad_norm()
        return norm, own

    def grads_averaged(self) -> bool:
        """Whether the gradients are averaged over the ranks when backward returns."""
        return self.engine.enable_backward_allreduce

    def _gradient_norm(self) -> tuple:
        """Before clipping and the optimizer step. Where backward has not averaged the gradients
        (bucket-wise clipping, 1-bit LAMB after its freeze, 0/1 Adam, DiLoCo) each rank takes its
        own gradient's norm, which the logged row combines (bookkeeping.py): no gradient-sized
        allreduce just for the metrics."""
        own = not self.grads_averaged()
        return gradient_norm(self.params, current_loss_scale(self.engine.optimizer)), own

    # ---- evaluation, export, checkpoints, metrics
    def shared_model(self):
        return contextlib.nullcontext()

    def state(self) -> tuple[dict, dict | None]:
        """(client state every rank shares, this rank's own state or None) for the checkpoint."""
        return {}, None

    def metric_fields(self) -> dict:
        return {}


class BucketwiseClipping(CommMode):
    """Bucket-wise clipping before the allreduce (bucketwise.py): buckets clipped and allreduced
    as backward produces them; DeepSpeed neither allreduces nor clips."""

    name = "bucketwise_clipping"

    @staticmethod
    def enabled(config: RunConfig) -> bool:
        return bucketwise_settings(config) is not None

    @classmethod
    def refusal(cls, config: RunConfig, stage: int) -> str | None:
        if stage >= 1:
            return (f"bucket-wise clipping cannot run under ZeRO stage {stage}: it replaces the gradient "
                    f"allreduce that ZeRO turns into a reduce-scatter; use stage 0")
        if compressing_optimizer(config):
            return (f"bucket-wise clipping and {config.optimizer_type} both replace the gradient allreduce; "
                    f"enable one of them")
        return None

    def __init__(self, config: RunConfig):
        super().__init__(config)
        self.settings = bucketwise_settings(config)

    def deepspeed_config(self, config: dict) -> dict:
        return {**super().deepspeed_config(config), "gradient_clipping": 0.0}

    def attach(self, engine, optimizer, model, topology=None) -> list[str]:
        lines = super().attach(engine, optimizer, model, topology)
        engine.enable_backward_allreduce = False
        self.clipper = BucketwiseClipAllreduce(self.params, self.settings["bucket_mb"], self.settings["max_norm"],
                                               lambda: current_loss_scale(engine.optimizer))
        return lines

    @contextlib.contextmanager
    def micro_batch(self, boundary: bool):
        if boundary:  # its gradients are the ones communicated, bucket by bucket during backward
            self.clipper.start_boundary_backward()
        yield

    def after_backward(self) -> None:
        super().after_backward()
        self.clipper.finish()

    def grads_averaged(self) -> bool:
        return False  # backward returns this rank's own gradients; the clipped buckets are in flight


class CompressingOptimizer(CommMode):
    """Modes whose optimizer runs its own compressed allreduce (1-bit LAMB, 0/1 Adam): selected by
    the optimizer's type, refused under ZeRO, and its error-feedback buffers are the rank's own."""

    optimizer_type = ""  # DeepSpeed's name, as the config and the messages spell it

    @classmethod
    def enabled(cls, config: RunConfig) -> bool:
        return config.optimizer_name == cls.optimizer_type.lower()

    @classmethod
    def refusal(cls, config: RunConfig, stage: int) -> str | None:
        if stage >= 1:
            return (f"{cls.optimizer_type} cannot run under ZeRO stage {stage}: it replaces the gradient allreduce "
                    f"with its own compressed one, which ZeRO's partitioned gradients bypass; use stage 0")
        return None

    def attach(self, engine, optimizer, model, topology=None) -> list[str]:
        lines = super().attach(engine, optimizer, model, topology)
        lines += self._two_levels(topology, "1-bit")
        optimizer.hierarchy = self.hierarchy  # before its compressor is built (at the freeze or a resume)
        return lines

    def resume(self, state: dict, rank_state: dict, where) -> None:
        self.optimizer.load_rank_state_dict(rank_state.get("optimizer", {}))

    def state(self) -> tuple[dict, dict | None]:
        return {}, {"optimizer": self.optimizer.rank_state_dict()}


class OneBitLambMode(CompressingOptimizer):
    """1-bit LAMB (optim/onebit_lamb.py): DeepSpeed's allreduce until the freeze step, then the
    optimizer's compressed allreduce of momenta instead."""

    name = "onebit_lamb"
    optimizer_type = "OneBitLamb"

    def attach(self, engine, optimizer, model, topology=None) -> list[str]:
        lines = super().attach(engine, optimizer, model, topology)
        # from the freeze step on, momenta travel compressed instead of gradients
        optimizer.on_freeze = lambda: setattr(engine, "enable_backward_allreduce", False)
        return lines

    def metric_fields(self) -> dict:
        fields = {"onebit_frozen": self.optimizer.frozen}
        if not self.optimizer.frozen:
            fields["variance_change"] = self.optimizer.variance_change
        return fields


class LocalSteps(CommMode):
    """Modes in which a rank steps on its own gradients between exchanges (0/1 Adam, DiLoCo)."""

    ranks_step_alone = True

    def deepspeed_config(self, config: dict) -> dict:
        config = super().deepspeed_config(config)
        if self.config.precision == "fp32":
            # DeepSpeed clips fp32 gradients by the norm averaged over the ranks: an allreduce at
            # every step, which local steps exist to avoid. Each rank clips its own gradient
            # instead, as DeepSpeed's fp16/bf16 wrapper does.
            self.local_clip = self.config.gradient_clipping
            config = {**config, "gradient_clipping": 0.0}
        return config


class ZeroOneAdamMode(CompressingOptimizer, LocalSteps):
    """0/1 Adam (optim/zero_one_adam.py): the optimizer decides step by step whether DeepSpeed
    allreduces the gradients, sends 1-bit momenta, or sends nothing (a local step)."""

    name = "zero_one_adam"
    optimizer_type = "ZeroOneAdam"

    def attach(self, engine, optimizer, model, topology=None) -> list[str]:
        lines = super().attach(engine, optimizer, model, topology)
        warning = optimizer.short_variance_warning()
        self.local_stage = False  # whether the step under way is a local-stage step
        self.loss_scale = getattr(engine.optimizer, "loss_scale_config", None)
        if self.loss_scale is not None and not self.loss_scale.dynamic_loss_scale:
            self.loss_scale = None  # bf16, or a static fp16 scale: nothing to reconcile
        # step by step, the optimizer says whether the engine allreduces the next step's gradients
        optimizer.engine_allreduce = self._engine_allreduce
        optimizer.engine_allreduce(optimizer.next_step_allreduced())
        return lines + [warning] if warning else lines

    def _engine_allreduce(self, allreduced: bool) -> None:
        """Off only on the variance stage's 1-bit steps. In the local-step stage it stays on and
        backward runs under engine.no_sync() instead (micro_batch): no gradient allreduce either
        way, but with it on DeepSpeed's fp16/bf16 wrapper does not allreduce its overflow flag, so
        a local step sends nothing and each rank skips its own overflows (after_step)."""
        self.engine.enable_backward_allreduce = allreduced or self.optimizer.frozen

    def start_step(self, logged: bool) -> None:
        self.local_stage = self.optimizer.frozen
        super().start_step(logged)

    def micro_batch(self, boundary: bool):
        return self.engine.no_sync() if self.local_stage else contextlib.nullcontext()

    def grads_averaged(self) -> bool:
        return self.engine.enable_backward_allreduce and not self.local_stage

    def after_step(self, step: int, last: bool) -> None:
        if not self.local_stage:
            return
        if not self.engine.was_step_applied():  # this rank's own overflow: the step counts all the same
            self.optimizer.skipped_local_step()
            if self.engine.lr_scheduler is not None:  # DeepSpeed does not step it on a skipped step
                self.engine.lr_scheduler.step()
        if self.optimizer.synced_last_step and self.loss_scale is not None:
            self._agree_on_the_loss_scale()

    def _agree_on_the_loss_scale(self) -> None:
        """At a sync, under a dynamic fp16 loss scale: every rank takes the smallest scale and the
        latest overflow, so the next raise waits a whole window after any rank's overflow and the
        ranks leave the sync alike (a checkpoint there resumes every rank as it was). 16 bytes."""
        config = self.loss_scale
        last = config.last_overflow_iter if config.last_overflow_iter is not None else -1
        agreed = torch.tensor([float(config.cur_scale), -float(last)], dtype=torch.float64, device=self.engine.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        config.cur_scale, config.last_overflow_iter = float(agreed[0]), int(-agreed[1])

    def resume(self, state: dict, rank_state: dict, where) -> None:
        super().resume(state, rank_state, where)
        if "local" in rank_state:  # between two syncs: this rank's own parameters and moments
            self.masters.load_rank_state(rank_state["local"])

    def shared_model(self):
        return self.optimizer.shared_params(self.masters.push_to_model)

    def state(self) -> tuple[dict, dict | None]:
        _, rank_state = super().state()
        if not self.optimizer.synced_last_step:
            rank_state["local"] = self.masters.rank_state()
        return {}, rank_state

    def metric_fields(self) -> dict:
        return {"variance_frozen": self.optimizer.frozen,
                "local_step_interval": self.optimizer.schedule["local_interval"] if self.optimizer.frozen else 0}


class DiLoCoMode(LocalSteps):
    """DiLoCo (diloco.py): H inner steps with no communication, then one outer step on the
    averaged pseudo-gradient."""

    name = "diloco"

    @staticmethod
    def enabled(config: RunConfig) -> bool:
        return diloco_settings(config) is not None

    @classmethod
    def refusal(cls, config: RunConfig, stage: int) -> str | None:
        problem = check_settings(diloco_settings(config))
        if problem:
            return problem
        if compressing_optimizer(config):
            return (f"DiLoCo and {config.optimizer_type} cannot be combined: both decide when the ranks "
                    f"communicate; use Lamb or AdamW inside DiLoCo")
        if BucketwiseClipping.enabled(config):
            return ("DiLoCo and bucket-wise clipping cannot be combined: bucket-wise clipping allreduces "
                    "gradients every step, DiLoCo's inner steps send none; disable one of them")
        if stage >= 1:
            return (f"DiLoCo cannot run under ZeRO stage {stage}: ZeRO splits the optimizer state across "
                    f"ranks, so no rank can take an inner step alone; use stage 0")
        return None

    def __init__(self, config: RunConfig):
        super().__init__(config)
        self.settings = diloco_settings(config)
        self.diloco: DiLoCo | None = None

    def attach(self, engine, optimizer, model, topology=None) -> list[str]:
        lines = super().attach(engine, optimizer, model, topology)
        self.names = {p: n for n, p in model.named_parameters()}  # for the fragments' layers
        sent = {"none": "fp32"}.get(self.settings["compression"], self.settings["compression"])
        return lines + self._two_levels(topology, f"the pseudo-gradient in {sent}")

    def _diloco(self) -> DiLoCo:
        return DiLoCo(self.masters, self.settings, self.hierarchy, self.names)

    def resume(self, state: dict, rank_state: dict, where) -> None:
        if "diloco" not in state:
            raise ModeStateError(f"{where} was not trained with DiLoCo; resume it with its own config, or start "
                                 f"from its weights with --init-from {where} --resume none")
        self.masters.load_rank_state(rank_state["diloco"])  # this rank's place in the round
        self.diloco = self._diloco()
        self.diloco.load_state_dict(state["diloco"])
        self.diloco.load_rank_state_dict(rank_state.get("diloco_exchange", []))

    def ready(self) -> list[str]:
        if self.diloco is None:  # θ is the weights the run starts from
            self.diloco = self._diloco()
        return [f"DiLoCo: {self.diloco.describe()}"]

    def micro_batch(self, boundary: bool):
        # inner steps: no gradient allreduce (nor the fp16 wrapper's overflow flag's); warm-up
        # steps are ordinary data-parallel ones
        return contextlib.nullcontext() if self.diloco.warming_up else self.engine.no_sync()

    def after_step(self, step: int, last: bool) -> None:
        # the last step ends every round too: what the run evaluates and exports is one model
        self.diloco.after_step(step, last)

    def balance(self, weight: float) -> None:
        # the inner optimizer normalises the gradient's scale away, so the pseudo-gradients are
        # weighted by the samples each rank trained, where the average is taken
        self.diloco.weight = weight

    def grads_averaged(self) -> bool:
        return self.diloco is not None and self.diloco.warming_up

    def shared_model(self):
        return self.diloco.global_model()

    def state(self) -> tuple[dict, dict | None]:
        # θ and the outer momentum are shared; the rank's parameters and inner optimizer are its own
        shared = {"diloco": self.diloco.state_dict()}  # first: it waits for an update in flight
        return shared, {"diloco": self.masters.rank_state(), "diloco_exchange": self.diloco.rank_state_dict()}

    def metric_fields(self) -> dict:
        fields = {"outer_rounds": self.diloco.rounds}
        if self.settings["compression"] == "sparse":
            fields["sparse_exchange"] = self.diloco.sparse_exchange
            fields["sparse_sent_share"] = self.diloco.sent_share()
        return fields


# the first enabled one is the run's mode; each refuses the combinations it cannot run with
MODES = (DiLoCoMode, BucketwiseClipping, OneBitLambMode, ZeroOneAdamMode, CommMode)


def mode_class(config: RunConfig | dict) -> type[CommMode]:
    config = RunConfig.of(config)
    return next(mode for mode in MODES if mode.enabled(config))


def select(config: RunConfig | dict) -> CommMode:
    """The run's communication mode, chosen once from the DeepSpeed config (checked beforehand
    by launch_checks, which asks the mode for its refusals)."""
    config = RunConfig.of(config)
    return mode_class(config)(config)
