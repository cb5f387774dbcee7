"""Checks made before any training step, so that a bad config or data set stops the job with
one clear line instead of a traceback (or a hang) minutes into a multi-node launch."""
from __future__ import annotations

import json
from pathlib import Path

from commodity_bert.comm import diloco, topology
from commodity_bert.comm.mode import mode_class
from commodity_bert.data.dataset import ShardSet
from commodity_bert.data.vocab import VocabError, model_vocabulary
from commodity_bert.optim import head_warmup, onebit_lamb, zero_one_adam
from commodity_bert.optim.build import (
    DEEPSPEED_BUILT,
    LAMB_IMPLEMENTATIONS,
    PROJECT_OPTIMIZERS,
    bf16_enabled,
    lamb_implementation,
    optimizer_name,
)
from commodity_bert.project_block import PROJECT_BLOCK, section
from commodity_bert.run_dir import CHECKPOINTS, HF_MODEL

# the project's block of the DeepSpeed config, "commodity_bert": {...}: its sections and their keys
PROJECT_SECTIONS = {
    "bucketwise_clipping": {"enabled", "bucket_mb", "max_norm"},
    "diloco": set(diloco.DEFAULTS),
    "hierarchy": set(topology.DEFAULTS),
    "activation_checkpointing": {"enabled"},
    "attention": {"layout"},
    "head_warmup": set(head_warmup.DEFAULTS),
    "lamb": {"implementation"},
    "pretraining": {"mask_prob", "dropout"},
}

PARAMS_CHECKS = {"onebitlamb": onebit_lamb.check_params, "zerooneadam": zero_one_adam.check_params}


class LaunchError(Exception):
    pass


SUPPORTED = "Adam, AdamW, Lamb, OneBitLamb, ZeroOneAdam"


def load_deepspeed_config(path: str | None, flag: str = "--deepspeed_config") -> dict:
    """The JSON object in `path`, or a LaunchError that names `flag` (the option that gave it)."""
    if not path:
        raise LaunchError(f"{flag} is required: a DeepSpeed JSON config, e.g. ds_configs/cpu_tiny_lamb.json")
    p = Path(path)
    if not p.is_file():
        raise LaunchError(f"{flag} {path} not found; see ds_configs/ for the shipped configs")
    try:
        config = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LaunchError(f"{flag} {path} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise LaunchError(f"{flag} {path} must hold a JSON object")
    return config


def resolve_batch_sizes(config: dict, world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, micro_batch, accumulation) as DeepSpeed derives them, or an error
    that says which number to change."""
    total = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    accumulation = config.get("gradient_accumulation_steps")
    for name, value in (("train_batch_size", total), ("train_micro_batch_size_per_gpu", micro),
                        ("gradient_accumulation_steps", accumulation)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise LaunchError(f"{name} = {value!r} in the DeepSpeed config; it must be a positive integer")
    if micro is None and total is not None:
        accumulation = accumulation or 1
        if total % (accumulation * world_size):
            raise LaunchError(f"train_batch_size {total} is not divisible by gradient_accumulation_steps "
                              f"{accumulation} × {world_size} ranks")
        micro = total // (accumulation * world_size)
    if micro is None:
        raise LaunchError("set train_micro_batch_size_per_gpu (and train_batch_size or "
                          "gradient_accumulation_steps) in the DeepSpeed config")
    if accumulation is None:
        if total is None:
            accumulation = 1
        elif total % (micro * world_size):
            raise LaunchError(f"train_batch_size {total} is not a multiple of train_micro_batch_size_per_gpu "
                              f"{micro} × {world_size} ranks; change train_batch_size or the micro-batch")
        else:
            accumulation = total // (micro * world_size)
    expected = micro * accumulation * world_size
    if total is not None and total != expected:
        raise LaunchError(f"train_batch_size {total} ≠ train_micro_batch_size_per_gpu {micro} × "
                          f"gradient_accumulation_steps {accumulation} × {world_size} ranks = {expected}; "
                          f"fix one of them for this world size")
    return expected, micro, accumulation


def check_deepspeed_config(config: dict, world_size: int) -> tuple[int, int, int]:
    block = config.get("optimizer")
    if not block or "type" not in block:
        raise LaunchError(f'the DeepSpeed config has no "optimizer": {{"type": ...}}; use one of {SUPPORTED}')
    name = optimizer_name(config)
    if name not in DEEPSPEED_BUILT | PROJECT_OPTIMIZERS:
        raise LaunchError(f"optimizer {block['type']!r} is not supported; use one of {SUPPORTED}")
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2):
        raise LaunchError(f"ZeRO stage {stage} is not supported; use stage 0, 1 or 2 (BERT fits on one GPU)")
    try:  # each optimizer of the project checks its own hyperparameters, here and when built
        PARAMS_CHECKS.get(name, lambda params: None)(block.get("params", {}))
    except ValueError as exc:
        raise LaunchError(str(exc)) from exc
    check_optimizer_numbers(config)
    check_scheduler(config)
    check_project_block(config)
    problem = topology.check_setting(config) or mode_class(config).refusal(config, stage)  # what the communication mode cannot run with
    if problem:
        raise LaunchError(problem)
    if name == "lamb" and stage >= 1:
        raise LaunchError(f"Lamb cannot run under ZeRO stage {stage}: its per-layer trust ratio needs whole "
                          f"tensors, which ZeRO flattens and partitions; use stage 0 with Lamb, or AdamW with ZeRO")
    if config.get("fp16", {}).get("enabled") and config.get("bf16", {}).get("enabled"):
        raise LaunchError("fp16 and bf16 are both enabled in the DeepSpeed config; enable one")
    return resolve_batch_sizes(config, world_size)


def check_project_block(config: dict) -> None:
    """A key the project's block does not know would be ignored silently (a misspelt
    `bucketwise_clipping` trains without it): refuse it, naming the known ones."""
    block = config.get(PROJECT_BLOCK)
    if block is None:
        return
    if not isinstance(block, dict):
        raise LaunchError(f'"{PROJECT_BLOCK}" in the DeepSpeed config must be an object, not {block!r}')
    for name, value in block.items():
        if name not in PROJECT_SECTIONS:
            raise LaunchError(f'unknown key "{PROJECT_BLOCK}.{name}" in the DeepSpeed config; '
                              f'the known ones are {", ".join(sorted(PROJECT_SECTIONS))}')
        if not isinstance(value, dict):
            raise LaunchError(f'"{PROJECT_BLOCK}.{name}" must be an object, not {value!r}')
        for key in value:
            if key not in PROJECT_SECTIONS[name]:
                raise LaunchError(f'unknown key "{PROJECT_BLOCK}.{name}.{key}" in the DeepSpeed config; '
                                  f'the known ones are {", ".join(sorted(PROJECT_SECTIONS[name]))}')
    enabled = section(config, "activation_checkpointing").get("enabled", False)
    if not isinstance(enabled, bool):
        raise LaunchError(f'"commodity_bert.activation_checkpointing.enabled" must be true or false, not {enabled!r}')
    if "layout" in section(config, "attention"):
        from commodity_bert.model.bert import ATTENTION_LAYOUTS  # here: transformers only where it is asked
        layout = section(config, "attention")["layout"]
        if layout not in ATTENTION_LAYOUTS:
            raise LaunchError(f'"commodity_bert.attention.layout" {layout!r}: give one of '
                              f'{", ".join(map(repr, ATTENTION_LAYOUTS))} (default "padded")')
    if problem := head_warmup.check_settings(config):
        raise LaunchError(problem)
    for key, value in section(config, "pretraining").items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1 \
                or (key == "mask_prob" and value == 0):
            allowed = "(0, 1), e.g. 0.15 (BERT) or 0.4" if key == "mask_prob" else "[0, 1), e.g. 0.0 or 0.1 (BERT)"
            raise LaunchError(f'"commodity_bert.pretraining.{key}" {value!r}: give a number in {allowed}')
    clipping = section(config, "bucketwise_clipping")
    if not isinstance(clipping.get("enabled", False), bool):
        raise LaunchError(f'"commodity_bert.bucketwise_clipping.enabled" must be true or false, not '
                          f'{clipping["enabled"]!r}')
    for key in ("bucket_mb", "max_norm"):
        if key in clipping and not (_is_number(clipping[key]) and clipping[key] > 0):
            raise LaunchError(f'"commodity_bert.bucketwise_clipping.{key}" {clipping[key]!r}: give a number above 0')
    implementation = section(config, "lamb").get("implementation", "project")
    if implementation not in LAMB_IMPLEMENTATIONS:
        raise LaunchError(f'"commodity_bert.lamb.implementation" {implementation!r}: give "deepspeed" '
                          f'(FusedLamb, CUDA only) or "project" (commodity_bert/optim/lamb.py)')


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# the optimizers' params every type shares, by the range each may take
POSITIVE = {"lr", "eps", "max_coeff", "min_coeff"}
NOT_NEGATIVE = {"weight_decay"}
FLAGS = {"bias_correction", "adam_w_mode", "amsgrad", "torch_adam", "fused", "foreach", "nesterov"}
# params that may be words: OneBitLamb's "freeze_step": "auto" (its check_params reads it), and
# DeepSpeed's 1-bit optimizers' backend, which configs written for them carry
WORDS = {"freeze_step", "comm_backend_name"}


def check_optimizer_numbers(config: dict) -> None:
    """Every value of the optimizer's params a number of its range (a flag true or false): a
    string where a number belongs ("lr": "fast") would otherwise train, the scheduler's rate
    silently taking its place, or fail minutes later inside the optimizer."""
    params = config["optimizer"].get("params", {})
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
    clip = config.get("gradient_clipping", 0.0)
    if not _is_number(clip) or clip < 0:
        raise LaunchError(f'"gradient_clipping" = {clip!r} in the DeepSpeed config: give 0 (off) or a norm above 0')


STEP_COUNTS = ("warmup_num_steps", "total_num_steps", "cycle_first_step_size", "cycle_second_step_size",
               "decay_step_size", "cycle_first_stair_count", "cycle_second_stair_count", "lr_range_test_step_size")


def check_scheduler(config: dict) -> None:
    """The scheduler's type one of DeepSpeed's, its params the ones that type takes, each of its
    range, and a warm-up that ends within the schedule (WarmupDecayLR and WarmupCosineLR would
    otherwise decay from a peak never reached, with no word)."""
    block = config.get("scheduler")
    if block is None:
        return
    from deepspeed.runtime import lr_schedules
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in lr_schedules.VALID_LR_SCHEDULES:
        raise LaunchError(f"scheduler type {kind!r} in the DeepSpeed config is not one of DeepSpeed's: "
                          f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)}")
    params = block.get("params", {})
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


def schedule_end_warning(config: dict, max_steps: int) -> str | None:
    """A schedule that ends before --max-steps: a warning, not a refusal (the quickstart's STEPS
    knob trains past a shipped schedule on purpose)."""
    total = config.get("scheduler", {}).get("params", {}).get("total_num_steps")
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


def check_against_device(config: dict, on_cuda: bool) -> None:
    """What the config asks of the device."""
    if not on_cuda and config.get("fp16", {}).get("enabled"):
        raise LaunchError('"fp16" is enabled, but fp16 needs a GPU (DeepSpeed\'s CPU accelerator refuses it); on a '
                          'CPU use bf16 (e.g. ds_configs/cpu_quickstart_lamb_bf16.json) or fp32 (e.g. '
                          'ds_configs/cpu_tiny_lamb.json)')
    if optimizer_name(config) != "lamb" or lamb_implementation(config) != "deepspeed":
        return
    if not on_cuda:
        raise LaunchError('"commodity_bert.lamb.implementation": "deepspeed" is FusedLamb, which needs CUDA; '
                          'use "project" (the default)')
    if bf16_enabled(config):
        raise LaunchError('"commodity_bert.lamb.implementation": "deepspeed" (FusedLamb) has no bf16 kernel in '
                          'DeepSpeed 0.19; use "project" (the default) or fp16')


def pretraining_settings(config: dict, data: ShardSet) -> dict:
    """The config's "commodity_bert.pretraining" section, checked against the data: a masking rate
    other than the shards' needs shards masked as they are read (dynamic), since static shards
    hold their masks."""
    settings = section(config, "pretraining")
    if "mask_prob" in settings and data.manifest["splits"]["train"]["masking"] == "static":
        raise LaunchError(f'"commodity_bert.pretraining.mask_prob" needs dynamically masked shards, but {data.path} '
                          f'holds static masks (at {data.manifest.get("args", {}).get("mask_prob", 0.15)}); prepare it '
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
