"""Every communication mode keeps the promises the loop relies on (commodity_bert/comm/mode.py),
tested the same way for each: a new mode is tested by adding one line to MODES.

For each mode, in bf16 (DeepSpeed's FP16_UnfusedOptimizer wrapper, the path users run) on 2 gloo
ranks through DeepSpeed's launcher: the config selects it; a run killed right after a
mid-run checkpoint and relaunched continues bit for bit as the uninterrupted run did (losses,
gradient norms, bytes on the wire, validation); every logged row carries the mode's fields; the
ranks hold identical parameters at the end; and the combination it cannot run with is refused in
one line before anything starts."""
import json

import pytest
from conftest import REPO, config_file, crashed_after, rows, train

from commodity_bert.comm.mode import mode_class
from commodity_bert.optim.zero_one_adam import step_kinds
from commodity_bert.train.launch_checks import LaunchError, check_deepspeed_config

CONFIGS = REPO / "ds_configs"
ZERO_ONE = {"optimizer.params.var_freeze_step": 4, "optimizer.params.var_update_scaler": 2,
            "optimizer.params.local_step_scaler": 2, "optimizer.params.local_step_clipper": 4}

# a case: (the mode, shipped config, changes for a short run, steps, checkpoint resumed from,
#          fields in every logged row, a change the mode refuses and the phrase of its refusal, or None)
MODES = {
    "allreduce": ("allreduce", "cpu_tiny_lamb.json", {}, 8, 4, (), None),
    # DeepSpeed's FusedAdam under ZeRO-2, shipped as is: resumed at 15, β1^16 computed by pow in a
    # fresh process differed from the chained product (optim/cpu_adam_resume.py)
    "allreduce_zero2_adamw": ("allreduce", "cpu_tiny_adamw_zero2_bf16.json", {}, 18, 15, (), None),
    "bucketwise_clipping": (
        "bucketwise_clipping", "cpu_tiny_lamb_bucketwise_clip.json", {}, 8, 4, (),
        ({"zero_optimization.stage": 1}, "bucket-wise clipping cannot run under ZeRO stage 1")),
    # the freeze after step 4: resumed before it, the run crosses it after the relaunch
    "onebit_lamb": (
        "onebit_lamb", "cpu_tiny_onebit_lamb.json", {"optimizer.params.freeze_step": 4}, 8, 3, ("onebit_frozen",),
        ({"zero_optimization.stage": 1}, "OneBitLamb cannot run under ZeRO stage 1")),
    # variance frozen after step 4; step 10 is a local step (ranks apart), step 12 a sync
    "zero_one_adam": (
        "zero_one_adam", "cpu_tiny_zero_one_adam.json", ZERO_ONE, 12, 10, ("variance_frozen", "local_step_interval"),
        ({"zero_optimization.stage": 1}, "ZeroOneAdam cannot run under ZeRO stage 1")),
    # rounds of 4 inner steps of 2 micro-batches: step 6 is in the middle of round 2; the last
    # step ends a round
    "diloco": (
        "diloco", "cpu_tiny_diloco_lamb.json",
        {"commodity_bert.diloco.inner_steps": 4, "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2},
        10, 6, ("outer_rounds",),
        ({"commodity_bert.bucketwise_clipping": {"enabled": True}}, "DiLoCo and bucket-wise clipping cannot be combined")),
}
KEYS = ("step", "samples", "loss", "mlm_acc", "grad_norm", "loss_scale", "lr", "bytes_sent", "comm_rounds",
        "val_mlm_acc", "val_loss")


@pytest.fixture(scope="module")
def modes_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("modes")


@pytest.fixture(scope="module", params=list(MODES))
def mode_runs(request, modes_dir, train_data):
    """(mode, config, the uninterrupted run, the run killed after its checkpoint and relaunched)."""
    name = request.param
    _, shipped, changes, steps, resume_at, _, _ = MODES[name]
    config = config_file(modes_dir, shipped, **{"bf16.enabled": True, **changes})
    common = ["--deepspeed_config", config, "--model", "tiny", "--data", train_data, "--log-every", 1,
              "--num-workers", 1, "--eval-every", resume_at, "--max-steps", steps]
    whole, pieces = modes_dir / name / "whole", modes_dir / name / "pieces"
    train(2, *common, "--output-dir", whole, "--save-every", resume_at)
    crashed_after(whole, resume_at, pieces)
    train(2, *common, "--output-dir", pieces)
    return name, config, whole, pieces


def test_the_config_selects_the_mode(mode_runs):
    name, config, whole, _ = mode_runs
    assert mode_class(json.loads(open(config).read())).name == MODES[name][0]
    assert json.loads((whole / "run_config.json").read_text())["comm_mode"] == MODES[name][0]


def test_a_relaunch_after_a_checkpoint_continues_bit_for_bit(mode_runs):
    name, _, whole, pieces = mode_runs
    resume_at = MODES[name][4]
    resumed = [[r.get(k) for k in KEYS] for r in rows(pieces)]
    assert [r[0] for r in resumed] == list(range(resume_at + 1, MODES[name][3] + 1))
    assert resumed == [[r.get(k) for k in KEYS] for r in rows(whole) if r["step"] > resume_at]
    assert any(r.get("val_loss") is not None for r in rows(pieces))  # an evaluation after the resume


def test_every_logged_row_carries_the_modes_fields(mode_runs):
    name, _, whole, _ = mode_runs
    logged = [r for r in rows(whole) if "loss" in r]
    assert len(logged) == MODES[name][3]
    for row in logged:
        assert all(field in row for field in MODES[name][5]), row
        assert row["grad_norm"] > 0 and row["bytes_sent"] >= 0, row


def test_the_ranks_end_with_identical_parameters(mode_runs):
    _, _, whole, pieces = mode_runs
    for run in (whole, pieces):
        assert json.loads((run / "summary.json").read_text())["params_identical_across_ranks"] is True


def test_the_schedules_put_the_resume_where_the_mode_is_mid_flight():
    """The table's resume steps mean what their comments say, by the modes' own rules."""
    kinds = list(step_kinds(12, 4, 2, 2, 4))
    assert kinds[10 - 1] == "local" and kinds[12 - 1] == "sync"
    assert 6 % MODES["diloco"][2]["commodity_bert.diloco.inner_steps"] != 0


@pytest.mark.parametrize("name", list(MODES))
def test_what_a_mode_cannot_run_with_is_refused_in_one_line(name):
    mode, shipped, _, _, _, _, refused = MODES[name]
    config = json.loads((CONFIGS / shipped).read_text())
    assert mode_class(config).name == mode
    check_deepspeed_config(config, 2)  # the shipped config itself passes
    if refused is None:
        return
    changes, phrase = refused
    for dotted, value in changes.items():
        node = config
        *path, last = dotted.split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    with pytest.raises(LaunchError) as error:
        check_deepspeed_config(config, 2)
    assert phrase in str(error.value) and "\n" not in str(error.value)
