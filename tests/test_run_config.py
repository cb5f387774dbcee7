"""The run config has one owner per setting, and extending it is one registration.

DeepSpeed's keys are read in commodity_bert/run_config.py alone (every other module reads the
RunConfig's fields); each section of the "commodity_bert" block is read by the module that
registers it; an optimizer defined in this file, registered through commodity_bert.optim.registry
alone, trains through train.py's main()."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from commodity_bert.run_config import SECTIONS, RunConfig

DEEPSPEED_KEYS = {"optimizer", "scheduler", "fp16", "bf16", "bfloat16", "zero_optimization", "gradient_clipping",
                  "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
                  "commodity_bert"}
# dicts that share a key's name without being a config: a checkpoint's state, a plan's rows
NOT_CONFIGS = {"state", "rank_state", "r", "row"}


def sources() -> list[Path]:
    return [REPO / "train.py", *sorted((REPO / "commodity_bert").rglob("*.py")), *sorted((REPO / "data_prep").rglob("*.py"))]


def receiver(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def key_reads(tree: ast.AST):
    """(line, key, receiver) of every `x.get("key", ...)` and `x["key"]` read."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args and isinstance(node.args[0], ast.Constant):
            yield node.lineno, node.args[0].value, receiver(node.func.value)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Constant):
            yield node.lineno, node.slice.value, receiver(node.value)


def section_reads(tree: ast.AST):
    """(line, section) of every `.section("name")` / `.given_section("name")`, and the sections
    the module registers."""
    reads, registers = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("section", "given_section"):
                reads.append((node.lineno, node.args[0].value))
            elif name == "register_section":
                registers.add(node.args[0].value)
    return reads, registers


def test_each_setting_is_read_by_its_owner_alone():
    strays = []
    for path in sources():
        if path == REPO / "commodity_bert" / "run_config.py":
            continue
        tree = ast.parse(path.read_text())
        where = path.relative_to(REPO)
        strays += [f"{where}:{line} reads {key!r} by key" for line, key, name in key_reads(tree)
                   if key in DEEPSPEED_KEYS and name not in NOT_CONFIGS]
        reads, registers = section_reads(tree)
        strays += [f"{where}:{line} reads section {name!r}, which another module registers"
                   for line, name in reads if name not in registers]
    assert not strays, "\n".join(strays)


def test_the_shipped_configs_read_back_as_deepspeed_wrote_them():
    """Every shipped config passes its owners' checks; DeepSpeed gets it as written, less the
    project's block; a section the config omits reads as its owner's defaults."""
    import train  # noqa: F401  (every owner registers its section)
    for path in sorted((REPO / "ds_configs").glob("*.json")):
        given = json.loads(path.read_text())
        config = RunConfig.parse(given)
        assert config.problems() is None, path
        assert config.for_deepspeed() == {k: v for k, v in given.items() if k != "commodity_bert"}, path
        for name, section in SECTIONS.items():
            written = given.get("commodity_bert", {}).get(name, {})
            assert config.section(name) == {**{k: v for k, v in section.defaults.items() if v is not None},
                                            **written}, (path, name)


@pytest.mark.parametrize("path", sorted((REPO / "ds_configs").glob("*.json")),
                         ids=lambda p: p.name)
def test_shipped_configs_pass_the_launch_checks(path):
    """On any world size, uneven ones included (4 + 4 + 2 GPUs, 6, 12): a config that fixes the
    global batch trains it, or the nearest multiple of micro-batch × ranks, said in one line; a
    micro-batch is never raised, as it was sized for a card's memory."""
    from commodity_bert.train.launch_checks import check_deepspeed_config, load_deepspeed_config
    config = load_deepspeed_config(str(path))
    for world in (1, 2, 3, 6, 8, 10, 12, 16):
        batch = check_deepspeed_config(config, world)
        total, micro, accumulation = batch
        assert total == micro * accumulation * world
        if config.train_batch_size is None:
            assert (micro, accumulation) == (config.micro_batch, config.accumulation or 1)
            continue
        assert micro <= config.micro_batch and batch.asked == config.train_batch_size
        if config.train_batch_size % world == 0 and (config.train_batch_size // world) % config.micro_batch == 0:
            assert batch.note(world, config.micro_batch) is None and total == config.train_batch_size
        else:
            assert abs(total - config.train_batch_size) <= micro * world / 2, (world, batch)  # the nearest
            assert batch.note(world, config.micro_batch).startswith("batch: global batch ")


def test_the_batch_rule_on_ten_ranks_is_one_line():
    from commodity_bert.train.launch_checks import check_deepspeed_config, load_deepspeed_config
    config = load_deepspeed_config(str(REPO / "ds_configs" / "bert_base_phase1_lamb_bf16.json"))
    batch = check_deepspeed_config(config, 10)
    assert tuple(batch) == (65280, 64, 102)
    assert batch.note(10, 64) == (
        "batch: global batch 65536 → 65280 (-0.4%) on 10 ranks, accumulation 102 (kept where micro-batch × "
        "accumulation × ranks can make it with a micro-batch in [½, 1] × the config's, else the nearest multiple "
        "of micro-batch × ranks; the schedule is unchanged)")
    assert tuple(check_deepspeed_config({**config.given, "train_micro_batch_size_per_gpu": 48}, 8)) == (65536, 32, 256)


@pytest.mark.parametrize("block, words", [
    ({"bucketwise_clippng": {}}, 'unknown key "commodity_bert.bucketwise_clippng" in the DeepSpeed config; the known '
                                 'ones are activation_checkpointing, attention, balance, bucketwise_clipping, diloco'),
    ({"lamb": {"implemntation": "project"}}, 'unknown key "commodity_bert.lamb.implemntation"'),
    ({"lamb": {"implementation": "fast"}}, '"commodity_bert.lamb.implementation" \'fast\': give "deepspeed"'),
    ({"hierarchy": []}, '"commodity_bert.hierarchy" must be an object, not []'),
])
def test_a_section_no_owner_declares_or_its_owner_refuses_is_one_line(block, words):
    import train  # noqa: F401
    assert words in RunConfig.parse({"optimizer": {"type": "Lamb"}, "commodity_bert": block}).problems()


def test_an_optimizer_is_one_name_in_configs_and_in_bert_plan():
    """Configs keep DeepSpeed's type in any case, bert-plan its snake-case names: both reach the
    same registered optimizer (and bert-plan's step model of it), with no warning."""
    from commodity_bert.optim.registry import registered
    from commodity_bert.plan.cli import step_model_of
    for spellings, step_model in ((("Lamb", "lamb", "LAMB"), "lamb"),
                                  (("OneBitLamb", "onebitlamb", "onebit_lamb"), "onebit_lamb"),
                                  (("ZeroOneAdam", "zerooneadam", "zero_one_adam"), "zero_one_adam")):
        assert {registered(name).type for name in spellings} == {spellings[0]}
        assert {step_model_of(name) for name in spellings} == {step_model}
    assert step_model_of("bucketwise") == "bucketwise" and step_model_of("diloco") == "diloco"  # modes
    assert step_model_of("AdamW") is None and step_model_of("sgd") is None  # no step model: refused in one line


# ---- a toy optimizer: plain SGD, registered here and nowhere else
TOY = '''
import sys, torch
from commodity_bert.optim.registry import OptimizerEntry, PlannedStep, StepPlan, register_optimizer

def check(params):
    if params.get("momentum", 0) < 0:
        raise ValueError(f"ToySgd momentum {params['momentum']!r}: give 0 or more")

register_optimizer(OptimizerEntry("ToySgd", frozenset({"lr", "momentum", "weight_decay"}),
                                  build=lambda groups, params, config: torch.optim.SGD(groups, **params),
                                  check_params=check,
                                  # bert-plan's model of it: a made-up schedule, every other step local
                                  plan=StepPlan("toy_sgd", kinds={"full": PlannedStep(),
                                                                  "local": PlannedStep(gradient_allreduce=False)},
                                                sequence=lambda steps, schedule: ["full" if t % 2 else "local"
                                                                                  for t in range(1, steps + 1)])))
'''


def toy_run(tmp_path: Path, data: Path, params: dict) -> subprocess.CompletedProcess:
    config = json.loads((REPO / "ds_configs" / "cpu_tiny_lamb.json").read_text())
    config["optimizer"] = {"type": "toy_sgd", "params": params}  # any spelling of the registered name
    (tmp_path / "toy.json").write_text(json.dumps(config))
    script = TOY + f'''
from commodity_bert.plan.cli import main as plan_main
assert plan_main(["estimate", "--gpu-tflops", "100", "--link", "1gbit", "--config", {str(tmp_path / "toy.json")!r},
                  "--model", "tiny", "--steps", "10", "--optimizer", "ToySgd,lamb", "--nodes", "2",
                  "--json", {str(tmp_path / "plan.json")!r}]) == 0
sys.path.insert(0, {str(REPO / "benchmarks")!r})
from bench_common import single_rank_environment
single_rank_environment()
import train
train.main(["--deepspeed_config", {str(tmp_path / "toy.json")!r}, "--data", {str(data)!r}, "--model", "tiny",
            "--output-dir", {str(tmp_path / "run")!r}, "--max-steps", "2", "--log-every", "1",
            "--num-workers", "0", "--plateau-check-samples", "0"])
'''
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_a_toy_optimizer_registered_here_trains_two_steps_through_train_main(tmp_path, train_data):
    proc = toy_run(tmp_path, train_data, {"lr": 0.05, "momentum": 0.9})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] != rows[0]["loss"]
    recorded = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert "optimizer" not in recorded["deepspeed_config_effective"]  # built here, not by DeepSpeed
    toy, lamb = json.loads((tmp_path / "plan.json").read_text())  # bert-plan priced its registration
    assert toy["optimizer"] == "toy_sgd" and lamb["comm_s"] > 0 and toy["comm_s"] == pytest.approx(lamb["comm_s"] / 2)
    assert {k: v["steps"] for k, v in toy["phases"][0]["stages"].items()} == {"full": 5, "local": 5}
    refused = toy_run(tmp_path, train_data, {"lr": 0.05, "momentum": -1})  # its own check, before any step
    assert refused.returncode == 2 and "train.py: error: ToySgd momentum -1: give 0 or more" in refused.stderr, \
        refused.stderr[-2000:]
