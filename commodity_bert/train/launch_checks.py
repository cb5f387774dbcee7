"""Checks made before any training step, so that a bad config or data set stops the job with
one clear line instead of a traceback (or a hang) minutes into a multi-node launch."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from commodity_bert.comm import bucketwise, diloco, topology  # noqa: F401  (their sections of the block)
from commodity_bert.comm.mode import mode_class
from commodity_bert.data.dataset import ShardSet
from commodity_bert.data.vocab import VocabError, model_vocabulary
from commodity_bert.model.sections import pretraining_recipe
from commodity_bert.optim import build  # noqa: F401  (the optimizers register themselves)
from commodity_bert.optim import head_warmup  # noqa: F401  (its section of the block)
from commodity_bert.optim import lamb
from commodity_bert.optim.registry import of_config, supported
from commodity_bert.run_config import ConfigError, RunConfig
from commodity_bert.run_dir import CHECKPOINTS, HF_MODEL
from commodity_bert.train import balance  # noqa: F401  (its section of the block)


class LaunchError(Exception):
    pass


def run_config(config: RunConfig | dict) -> RunConfig:
    """`config` read (RunConfig.of), its problems as LaunchErrors."""
    try:
        return RunConfig.of(config)
    except ConfigError as exc:
        raise LaunchError(str(exc)) from None


def load_deepspeed_config(path: str | None, flag: str = "--deepspeed_config") -> RunConfig:
    """The config in `path`, or a LaunchError that names `flag` (the option that gave it)."""
    try:
        return RunConfig.load(path, flag)
    except ConfigError as exc:
        raise LaunchError(str(exc)) from None


BATCH_RULE = ("kept where micro-batch × accumulation × ranks can make it with a micro-batch in [½, 1] × the "
              "config's, else the nearest multiple of micro-batch × ranks; the schedule is unchanged")


@dataclass(frozen=True)
class BatchSizes:
    """What every rank trains with: `total` sequences an optimizer step, `micro` a forward pass,
    `accumulation` passes a step; `asked` the global batch the config (or the checkpoint being
    resumed) asked for, which `total` differs from where the world size cannot make it. Unpacks
    as (total, micro, accumulation)."""
    total: int
    micro: int
    accumulation: int
    asked: int

    def __iter__(self):
        return iter((self.total, self.micro, self.accumulation))

    def note(self, world: int, micro_asked: int) -> str | None:
        """One line where the batch is not the config's as written (None where it is)."""
        if self.total == self.asked and self.micro == micro_asked:
            return None
        what = (f"global batch {self.asked} → {self.total} ({(self.total - self.asked) / self.asked:+.1%})"
                if self.total != self.asked else f"global batch {self.total} kept")
        micro = f", micro-batch {micro_asked} → {self.micro}" if self.micro != micro_asked else ""
        return f"batch: {what} on {ranks(world)}{micro}, accumulation {self.accumulation} ({BATCH_RULE})"


def ranks(count: int) -> str:
    return f"{count} rank" if count == 1 else f"{count} ranks"


def fit_global_batch(asked: int, micro: int, world: int) -> BatchSizes:
    """`asked` sequences a step on `world` ranks with a micro-batch of at most `micro` (BATCH_RULE):
    exact where the ranks' share has a divisor in [micro/2, micro] (the largest); otherwise micro
    (at most the ranks' share) × the nearest whole accumulation × world."""
    if asked % world == 0:
        share = asked // world
        top = min(micro, share)
        for m in range(top, (top + 1) // 2 - 1, -1):
            if share % m == 0:
                return BatchSizes(asked, m, share // m, asked)
    micro = max(1, min(micro, round(asked / world)))
    accumulation = max(1, round(asked / (micro * world)))
    return BatchSizes(micro * accumulation * world, micro, accumulation, asked)


def resolve_batch_sizes(config: RunConfig | dict, world_size: int) -> BatchSizes:
    """(train_batch_size, micro_batch, accumulation) for `world_size` ranks, or an error that says
    which number to change. A config that fixes the global batch (`train_batch_size`) keeps it
    where the world size can make it, and otherwise trains the nearest one (BATCH_RULE, said at
    launch): clusters of 10, 6 or 12 GPUs cannot divide the recipes' powers of two. A config that
    fixes micro-batch and accumulation instead trains micro × accumulation × ranks."""
    config = run_config(config)
    total, micro, accumulation = config.train_batch_size, config.micro_batch, config.accumulation
    for name, value in (("train_batch_size", total), ("train_micro_batch_size_per_gpu", micro),
                        ("gradient_accumulation_steps", accumulation)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise LaunchError(f"{name} = {value!r} in the DeepSpeed config; it must be a positive integer")
    if total is None:
        if micro is None:
            raise LaunchError("set train_micro_batch_size_per_gpu (and train_batch_size or "
                              "gradient_accumulation_steps) in the DeepSpeed config")
        accumulation = accumulation or 1
        return BatchSizes(micro * accumulation * world_size, micro, accumulation, micro * accumulation * world_size)
    if micro is not None and accumulation is not None:
        expected = micro * accumulation * world_size
        if total != expected:
            raise LaunchError(f"train_batch_size {total} ≠ train_micro_batch_size_per_gpu {micro} × "
                              f"gradient_accumulation_steps {accumulation} × {world_size} ranks = {expected}; "
                              f"drop gradient_accumulation_steps to let it follow from the world size, or fix "
                              f"one of them")
        return BatchSizes(total, micro, accumulation, total)
    if micro is None:  # the global batch and accumulation given: the micro-batch follows
        accumulation = accumulation or 1
        micro = max(1, -(-total // (accumulation * world_size)))
    return fit_global_batch(total, micro, world_size)


def batch_for_resume(config: RunConfig | dict, world_size: int, saved: dict, tag: str,
                     allow_change: bool) -> tuple[BatchSizes, str | None]:
    """The batch sizes a run resumed from checkpoint `tag` trains with on `world_size` ranks: its
    global batch (`saved`: what the checkpoint recorded) with a micro-batch of at most the
    config's, and one line naming what changed against the checkpoint (None: nothing did). Where
    the world size cannot make that global batch, a LaunchError naming the flag that accepts the
    change (`allow_change`: the config's batch for this world size instead)."""
    config = run_config(config)
    fresh = resolve_batch_sizes(config, world_size)
    micro_asked = config.micro_batch or fresh.micro
    total = saved["global_batch"]
    kept = fit_global_batch(total, micro_asked, world_size)
    if kept.total == total:
        batch = kept
    elif allow_change:
        batch = fresh
    else:
        raise LaunchError(f"{tag} trained at global batch {total} ({ranks(saved['world_size'])} × micro-batch "
                          f"{saved['micro_batch']} × accumulation {saved['accumulation']}); {ranks(world_size)} with a "
                          f"micro-batch of at most {micro_asked} cannot make it (the nearest is {kept.total}); relaunch "
                          f"on a world size that divides {total}, or give --allow-batch-change to go on at "
                          f"{fresh.total} a step ({world_size} × {fresh.micro} × {fresh.accumulation})")
    changes = [f"{name} {before} → {after}" for name, before, after in (
        ("ranks", saved["world_size"], world_size), ("micro-batch", saved["micro_batch"], batch.micro),
        ("accumulation", saved["accumulation"], batch.accumulation), ("global batch", total, batch.total))
        if before != after]
    if not changes and batch.micro == micro_asked:
        return batch, None
    kept_line = f"global batch {total} kept" if batch.total == total else "--allow-batch-change"
    asked = f"; the config asks micro-batch {micro_asked}" if batch.micro != micro_asked else ""
    return batch, (f"relaunch against {tag}: {', '.join(changes) or f'micro-batch {batch.micro} kept'} "
                   f"({kept_line}{asked})")


def check_deepspeed_config(config: RunConfig | dict, world_size: int) -> BatchSizes:
    config = run_config(config)
    if not config.optimizer_type:
        raise LaunchError(f'the DeepSpeed config has no "optimizer": {{"type": ...}}; use one of {supported()}')
    optimizer = of_config(config)
    if optimizer is None:
        raise LaunchError(f"optimizer {config.optimizer_type!r} is not supported; use one of {supported()}")
    stage = config.zero_stage
    if stage not in (0, 1, 2):
        raise LaunchError(f"ZeRO stage {stage} is not supported; use stage 0, 1 or 2 (BERT fits on one GPU)")
    try:  # each optimizer of the project checks its own hyperparameters, here and when built
        optimizer.check_params(config.optimizer_params)
    except ValueError as exc:
        raise LaunchError(str(exc)) from exc
    check_optimizer_numbers(config)
    check_scheduler(config)
    check_project_block(config)
    problem = mode_class(config).refusal(config, stage)  # what the communication mode cannot run with
    if problem:
        raise LaunchError(problem)
    if optimizer.whole_tensors and stage >= 1:
        raise LaunchError(f"{optimizer.type} cannot run under ZeRO stage {stage}: its per-layer trust ratio needs "
                          f"whole tensors, which ZeRO flattens and partitions; use stage 0 with {optimizer.type}, "
                          f"or AdamW with ZeRO")
    if config.fp16 and config.bf16:
        raise LaunchError("fp16 and bf16 are both enabled in the DeepSpeed config; enable one")
    return resolve_batch_sizes(config, world_size)


def check_project_block(config: RunConfig | dict) -> None:
    """A key the project's block does not know would be ignored silently (a misspelt
    `bucketwise_clipping` trains without it): refuse it, naming the known ones; then each
    section's owner checks its values (RunConfig.problems)."""
    if problem := run_config(config).problems():
        raise LaunchError(problem)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# the optimizers' params every type shares, by the range each may take
POSITIVE = {"lr", "eps", "max_coeff", "min_coeff"}
NOT_NEGATIVE = {"weight_decay"}
FLAGS = {"bias_correction", "adam_w_mode", "amsgrad", "torch_adam", "fused", "foreach", "nesterov"}
# params that may be words: OneBitLamb's "freeze_step": "auto" (its check_params reads it), and
# DeepSpeed's 1-bit optimizers' backend, which configs written for them carry
WORDS = {"freeze_step", "comm_backend_name"}


def check_optimizer_numbers(config: RunConfig) -> None:
    """Every value of the optimizer's params a number of its range (a flag true or false): a
    string where a number belongs ("lr": "fast") would otherwise train, the scheduler's rate
    silently taking its place, or fail minutes later inside the optimizer."""
    params = config.optimizer_params
    if not isinstance(params, dict):
        raise LaunchError(f'the optimizer\'s "params" must be an object, not {params!r}')
    for key, value in params.items():
        where = f'optimizer param "{key}" = {value!r} in the DeepSpeed config'
        if key in FLAGS:
            if not isinstance(value, bool):
                raise LaunchError(f"{where}: give true or false")
        elif key == "betas":
            if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_number(b) and 0 <= b < 1
                                                                              for b in value)):
                raise LaunchError(f"{where}: give two numbers in [0, 1), e.g. [0.9, 0.999]")
        elif key in WORDS or (value is None and key not in POSITIVE | NOT_NEGATIVE):
            continue  # None: the optimizer's default (e.g. OneBitLamb's scale_block: one scale for all)
        elif not _is_number(value):
            raise LaunchError(f"{where}: give a number")
        elif key in POSITIVE and not value > 0:
            raise LaunchError(f"{where}: give a number above 0")
        elif key in NOT_NEGATIVE and value < 0:
            raise LaunchError(f"{where}: give 0 or more")
    if _is_number(params.get("min_coeff")) and _is_number(params.get("max_coeff")) \
            and params["min_coeff"] > params["max_coeff"]:
        raise LaunchError(f'optimizer params "min_coeff" {params["min_coeff"]} > "max_coeff" {params["max_coeff"]}: '
                          f"the trust ratio's floor must not exceed its ceiling")
    clip = config.gradient_clipping
    if not _is_number(clip) or clip < 0:
        raise LaunchError(f'"gradient_clipping" = {clip!r} in the DeepSpeed config: give 0 (off) or a norm above 0')


STEP_COUNTS = ("warmup_num_steps", "total_num_steps", "cycle_first_step_size", "cycle_second_step_size",
               "decay_step_size", "cycle_first_stair_count", "cycle_second_stair_count", "lr_range_test_step_size")


def check_scheduler(config: RunConfig) -> None:
    """The scheduler's type one of DeepSpeed's, its params the ones that type takes, each of its
    range, and a warm-up that ends within the schedule (WarmupDecayLR and WarmupCosineLR would
    otherwise decay from a peak never reached, with no word)."""
    if not config.has_scheduler:
        return
    from deepspeed.runtime import lr_schedules
    kind = config.scheduler_type
    if kind not in lr_schedules.VALID_LR_SCHEDULES:
        raise LaunchError(f"scheduler type {kind!r} in the DeepSpeed config is not one of DeepSpeed's: "
                          f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)}")
    params = config.scheduler_params
    if not isinstance(params, dict):
        raise LaunchError(f'the scheduler\'s "params" must be an object, not {params!r}')
    import inspect
    takes = [name for name in inspect.signature(getattr(lr_schedules, kind).__init__).parameters
             if name not in ("self", "optimizer", "last_batch_iteration")]
    for key, value in params.items():
        where = f'scheduler param "{key}" = {value!r} ({kind}) in the DeepSpeed config'
        if key not in takes:
            raise LaunchError(f'{where}: {kind} takes no such param; it takes {", ".join(takes)}')
        if key == "warmup_type":
            if value not in ("linear", "log"):
                raise LaunchError(f'{where}: give "linear" or "log"')
        elif key in ("lr_range_test_staircase", "cycle_momentum"):
            if not isinstance(value, bool):
                raise LaunchError(f"{where}: give true or false")
        elif key in STEP_COUNTS:
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "total_num_steps" else 0):
                raise LaunchError(f"{where}: give a whole number of steps, "
                                  f"{'1' if key == 'total_num_steps' else '0'} or more")
        elif not _is_number(value) or value < 0:
            raise LaunchError(f"{where}: give a number, 0 or more")
    warmup, total = params.get("warmup_num_steps"), params.get("total_num_steps")
    if warmup is not None and total is not None and warmup > total:
        raise LaunchError(f"the scheduler's warmup_num_steps ({warmup}) exceeds its total_num_steps ({total}): "
                          f"the rate would never reach its peak; shorten the warm-up or lengthen the schedule")


def schedule_end_warning(config: RunConfig | dict, max_steps: int) -> str | None:
    """A schedule that ends before --max-steps: a warning, not a refusal (the quickstart's STEPS
    knob trains past a shipped schedule on purpose)."""
    total = run_config(config).total_num_steps
    if total is not None and total < max_steps:
        return (f"warning: the scheduler's total_num_steps ({total}) ends before --max-steps ({max_steps}): from "
                f"step {total + 1} the learning rate stays where the schedule ends")
    return None


# train.py's numeric flags: the least each may be (0 where 0 means "off" or "all")
COMMAND_LINE_FLOORS = {"max_steps": 0, "log_every": 1, "eval_every": 0, "save_every": 0, "save_every_minutes": 0,
                       "keep_checkpoints": 0, "num_workers": 0, "trim_host_memory_every": 0,
                       "shards_in_memory": 0, "plateau_check_samples": 0}


def check_command_line(args) -> None:
    for name, floor in COMMAND_LINE_FLOORS.items():
        value = getattr(args, name, None)
        if value is not None and value < floor:
            meaning = " (0: the scheduler's total_num_steps)" if name == "max_steps" else ""
            raise LaunchError(f"--{name.replace('_', '-')} {value}: give {floor} or more{meaning}")
    if args.dist_timeout_minutes <= 0:
        raise LaunchError(f"--dist-timeout-minutes {args.dist_timeout_minutes}: give a number of minutes above 0")
    if args.time_budget is not None and args.time_budget <= 0:
        raise LaunchError(f"--time-budget {args.time_budget:g}: give a duration above 0, e.g. 24h")


def precision_twin(path: str | Path | None, precision: str) -> str | None:
    """The config beside `path` in the other half precision, `precision` ("fp16" or "bf16"):
    ds_configs/bert_base_phase1_lamb_bf16.json and ..._fp16.json; None where there is none."""
    other = {"bf16": "fp16", "fp16": "bf16"}[precision]
    path = Path(path) if path else None
    twin = path.with_name(path.name.replace(other, precision)) if path and other in path.name else None
    return str(twin) if twin is not None and twin.is_file() else None


def fp16_counterpart(path: str | Path | None) -> str:
    """The fp16 config beside a bf16 one, or what to look for."""
    return precision_twin(path, "fp16") or "an fp16 config (ds_configs/*_fp16.json)"


def check_against_device(config: RunConfig | dict, on_cuda: bool, bf16_native: bool = True,
                         path: str | Path | None = None, device_name: str = "this GPU") -> None:
    """What the config asks of the device. `bf16_native`: whether the GPU computes in bf16 (compute
    capability 8.0 or more: A100, RTX 30xx/40xx, H100; not V100, T4 or RTX 20xx, where torch
    emulates it many times slower)."""
    config = run_config(config)
    if on_cuda and config.bf16 and not bf16_native:
        raise LaunchError(f'"bf16" is enabled, but {device_name} has no bf16 arithmetic (compute capability below '
                          f'8.0: V100, T4, RTX 20xx); use {fp16_counterpart(path)}, fp16 with dynamic loss scaling')
    if not on_cuda and config.fp16:
        raise LaunchError('"fp16" is enabled, but fp16 needs a GPU (DeepSpeed\'s CPU accelerator refuses it); on a '
                          'CPU use bf16 (e.g. ds_configs/cpu_quickstart_lamb_bf16.json) or fp32 (e.g. '
                          'ds_configs/cpu_tiny_lamb.json)')
    if config.optimizer_name != "lamb" or lamb.implementation(config) != "deepspeed":
        return
    if not on_cuda:
        raise LaunchError('"commodity_bert.lamb.implementation": "deepspeed" is FusedLamb, which needs CUDA; '
                          'use "project" (the default)')
    if config.bf16:
        raise LaunchError('"commodity_bert.lamb.implementation": "deepspeed" (FusedLamb) has no bf16 kernel in '
                          'DeepSpeed 0.19; use "project" (the default) or fp16')


def pretraining_settings(config: RunConfig | dict, data: ShardSet) -> dict:
    """The config's "commodity_bert.pretraining" section (the keys it sets), checked against the
    data: a masking rate other than the shards' needs shards masked as they are read (dynamic),
    since static shards hold their masks."""
    settings = pretraining_recipe(run_config(config))
    if "mask_prob" in settings and data.manifest["splits"]["train"]["masking"] == "static":
        raise LaunchError(f'"commodity_bert.pretraining.mask_prob" needs dynamically masked shards, but {data.path} '
                          f'holds static masks (at {data.mask_prob}); prepare it '
                          f'again with bert-data-prep shards --masking dynamic, or drop the key')
    return settings


WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def init_source(source: Path) -> tuple[str, Path]:
    """What --init-from names, checked before anything loads: ("weights", the directory) for a
    RUN, its hf_model or a Hugging Face BERT directory (with or without its pretraining heads),
    ("checkpoint", the directory) for DeepSpeed checkpoints. A weights directory must be a BERT's
    and hold its tokenizer: the shards must be made with the model's own vocabulary, and without
    one nothing can show they were."""
    from commodity_bert.train import checkpoint  # here: deepspeed only where a launch asks
    weights = source / HF_MODEL if (source / HF_MODEL).is_dir() else source
    if any(any(weights.glob(pattern)) for pattern in WEIGHT_FILES):
        try:
            config = json.loads((weights / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise LaunchError(f"--init-from {source}: weights but no readable config.json beside them ({exc}); "
                              f"save the model with save_pretrained(DIR)") from None
        from commodity_bert.model.bert import not_a_bert  # here: transformers only where it is asked
        if problem := not_a_bert(config):
            raise LaunchError(f"--init-from {source}: {problem}")
        if model_vocabulary(weights) is None:
            raise LaunchError(f"--init-from {source}: weights but no tokenizer (vocab.txt or tokenizer.json); put the "
                              f"model's own tokenizer files beside them (tokenizer.save_pretrained(DIR)), then make "
                              f"shards with it: bert-data-prep shards --vocab {source} ...")
        return "weights", weights
    for candidate in (source, source / CHECKPOINTS):
        if checkpoint.latest(candidate):
            return "checkpoint", candidate
    if not source.exists():
        raise LaunchError(f"--init-from {source}: no such directory")
    if (weights / "config.json").is_file():
        raise LaunchError(f"--init-from {source}: config.json but no weights (model.safetensors or "
                          f"pytorch_model.bin); copy the weights beside it")
    raise LaunchError(f"--init-from {source}: neither a RUN, an hf_model, a Hugging Face BERT directory nor a "
                      f"checkpoint directory")


def check_vocabulary_against_source(data: ShardSet, source: Path) -> None:
    """A model to continue from (--init-from) and the shards must share their tokens, not only
    their count: the same ids must mean the same word pieces, and the text must be cased as the
    model was trained. Checked where the source has a tokenizer (an export, a Hugging Face BERT)."""
    try:
        found = model_vocabulary(source)
    except VocabError as exc:
        raise LaunchError(f"--init-from {source}: {exc}") from None
    if found is None:
        return
    theirs, model_lowercase = found
    fix = f"make shards with its vocabulary: bert-data-prep shards --vocab {source} ..."
    ours = data.vocab_path.read_text(encoding="utf-8").splitlines()
    if ours != theirs:
        differ = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise LaunchError(f"--init-from {source}: its vocabulary ({len(theirs)} tokens) is not the one {data.path} was "
                          f"tokenized with ({len(ours)} tokens; they differ from id {differ}); {fix}")
    lowercase = data.lowercase
    if model_lowercase != lowercase:
        raise LaunchError(f"--init-from {source}: the model is {'uncased' if model_lowercase else 'cased'} but "
                          f"{data.path} was made {'lower-cased' if lowercase else 'with its case kept'}; {fix}")


def check_data_against_model(data: ShardSet, model_config) -> None:
    if data.manifest["seq_len"] > model_config.max_position_embeddings:
        raise LaunchError(f"{data.path} has sequences of {data.manifest['seq_len']} tokens but the model has "
                          f"{model_config.max_position_embeddings} positions; raise max_position_embeddings "
                          f"or use shorter shards")
    if data.vocab_size != model_config.vocab_size:
        raise LaunchError(f"{data.path} was tokenized with {data.vocab_size} tokens but the model's "
                          f"vocab_size is {model_config.vocab_size}; use matching data and model")
