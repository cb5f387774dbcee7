"""Every communication mode keeps the promises the loop relies on (commodity_bert/comm/mode.py),
tested the same way for each: a new mode is tested by adding one line to MODE_CASES
(conftest.py, where test_training_paths.py reads the same runs).

For each mode, in bf16 (DeepSpeed's FP16_UnfusedOptimizer wrapper, the path users run) on 2 gloo
ranks through DeepSpeed's launcher: the config selects it; a run killed after a mid-run
checkpoint and relaunched continues bit for bit as the uninterrupted run did (losses, gradient
norms, bytes on the wire, validation); every logged row carries the mode's fields; the ranks
hold identical parameters at the end; and the combination it cannot run with is refused in one
line before anything starts."""
import json

import pytest
from conftest import MODE_CASES, REPO, changed, relaunched, rows

from commodity_bert.comm.mode import mode_class
from commodity_bert.optim.zero_one_adam import step_kinds
from commodity_bert.train.launch_checks import LaunchError, check_deepspeed_config

CONFIGS = REPO / "ds_configs"


@pytest.fixture(scope="module", params=list(MODE_CASES))
def mode_runs(request, mode_run):
    """(name, the case, its runs): the table is MODE_CASES in conftest.py, whose runs
    test_training_paths.py also reads."""
    return request.param, MODE_CASES[request.param], mode_run(request.param)


def test_the_config_selects_the_mode(mode_runs):
    name, case, runs = mode_runs
    assert mode_class(json.loads(open(runs.config).read())).name == case.mode
    assert json.loads((runs.whole / "run_config.json").read_text())["comm_mode"] == case.mode


def test_a_relaunch_after_a_checkpoint_continues_bit_for_bit(mode_runs):
    """Killed one logged step after its checkpoint, with a torn metrics line (conftest.crashed_after):
    the relaunch resumes from the checkpoint and the history ends as the uninterrupted run's."""
    _, case, runs = mode_runs
    relaunched(runs.relaunch, runs.whole, runs.pieces, case.resume_at)
    assert any(r.get("val_loss") is not None for r in rows(runs.pieces) if r["step"] > case.resume_at)


def test_every_logged_row_carries_the_modes_fields(mode_runs):
    _, case, runs = mode_runs
    logged = [r for r in rows(runs.whole) if "loss" in r]
    assert len(logged) == case.steps
    for row in logged:
        assert all(field in row for field in case.fields), row
        assert row["grad_norm"] > 0 and row["bytes_sent"] >= 0, row


def test_the_ranks_end_with_identical_parameters(mode_runs):
    _, _, runs = mode_runs
    for run in (runs.whole, runs.pieces):
        assert json.loads((run / "summary.json").read_text())["params_identical_across_ranks"] is True


def test_the_memory_model_holds_each_ranks_tensors(mode_runs):
    """bert-plan fit's state term (plan/memory.py) against what each rank held at the end
    (summary.json's tensor_mb: its live tensors, each storage once): the weights, the master copy,
    the optimizer's moments and the mode's error feedback or outer state, per mode, on 2 ranks."""
    from commodity_bert.data.shard_format import load_manifest
    from commodity_bert.model.bert import build_config
    from commodity_bert.plan.memory import Setup, Shape, state_bytes
    _, _, runs = mode_runs
    manifest = load_manifest(runs.data)
    shape = Shape.of(build_config("tiny", manifest["vocab"]["size"]), nsp=manifest["nsp"])
    modelled = sum(state_bytes(shape.params, Setup.of(json.loads(open(runs.config).read())), world=2).values())
    held = json.loads((runs.whole / "summary.json").read_text())["tensor_mb"]
    # beyond the model: position ids, masks, RNG states, the loop's counters (~0.1 MB)
    assert all(modelled <= mb * 2**20 <= modelled * 1.01 + 2**19 for mb in held), (held, modelled / 2**20)


def test_the_schedules_put_the_resume_where_the_mode_is_mid_flight():
    """The table's resume steps mean what their comments say, by the modes' own rules."""
    zero_one = MODE_CASES["zero_one_adam"]
    params = json.loads((CONFIGS / zero_one.config).read_text())["optimizer"]["params"]
    kinds = list(step_kinds(zero_one.steps, *(params[k] for k in ("var_freeze_step", "var_update_scaler",
                                                                   "local_step_scaler", "local_step_clipper"))))
    assert kinds[zero_one.resume_at - 1] == "local" and kinds[-1] == "sync"
    onebit = MODE_CASES["onebit_lamb"]
    freeze = json.loads((CONFIGS / onebit.config).read_text())["optimizer"]["params"]["freeze_step"]
    assert onebit.resume_at < freeze < onebit.steps
    diloco = MODE_CASES["diloco"]
    inner = json.loads((CONFIGS / diloco.config).read_text())["commodity_bert"]["diloco"]["inner_steps"]
    assert diloco.resume_at % inner != 0 and diloco.steps % inner == 0
    streaming = MODE_CASES["diloco_streaming"].changes
    inner, fragments = streaming["commodity_bert.diloco.inner_steps"], streaming["commodity_bert.diloco.fragments"]
    overlap = streaming["commodity_bert.diloco.overlap_steps"]
    ends = [t for t in range(1, MODE_CASES["diloco_streaming"].steps) if t % inner in
            {p * inner // fragments for p in range(fragments)}]
    resume = MODE_CASES["diloco_streaming"].resume_at
    assert any(end < resume < end + overlap for end in ends)  # an update in flight at the checkpoint
    warmup = MODE_CASES["diloco_warmup"]
    assert warmup.resume_at < warmup.changes["commodity_bert.diloco.warmup_steps"]  # resumed mid-warm-up


@pytest.mark.parametrize("name", list(MODE_CASES))
def test_what_a_mode_cannot_run_with_is_refused_in_one_line(name):
    case = MODE_CASES[name]
    config = json.loads((CONFIGS / case.config).read_text())
    assert mode_class(config).name == case.mode
    check_deepspeed_config(config, 2)  # the shipped config itself passes
    if case.refused is None:
        return
    changes, phrase = case.refused
    with pytest.raises(LaunchError) as error:
        check_deepspeed_config(changed(config, changes), 2)
    assert phrase in str(error.value) and "\n" not in str(error.value)
