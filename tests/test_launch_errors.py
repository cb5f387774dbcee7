"""Mistakes a user makes at launch end in one line from one rank before any step, with the same
non-zero status on every rank and no "lost a peer"; an error one rank meets mid-run stops every
rank together, the others naming that rank (train/bookkeeping.py, hold_error)."""
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import CPU_CONFIG, REPO, launch_cmd, refused_in_process

from commodity_bert.train.launch_checks import (
    LaunchError,
    check_against_device,
    check_command_line,
    check_deepspeed_config,
    schedule_end_warning,
)

TINY = ["--model", "tiny", "--num-workers", 1]


def config_with(tmp_path, name: str, change) -> str:
    config = json.loads(CPU_CONFIG.read_text())
    change(config)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


def launch(args: list, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(launch_cmd(2, *args), cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, check=False)


def no_wandb(tmp_path) -> dict:
    """An environment where `import wandb` fails, as where it is not installed."""
    stub = tmp_path / "no_wandb" / "wandb"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'wandb'\", name='wandb')\n")
    return {"PYTHONPATH": f"{stub.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def launches(tmp_path) -> dict:
    """name → (train.py's arguments but data and output, environment, the phrase of its line)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory\n")

    def wandb_block(c):
        c["wandb"] = {"enabled": True, "project": "p"}

    def tensorboard_under_a_file(c):
        c["tensorboard"] = {"enabled": True, "output_path": str(blocker / "tb")}

    def fp16(c):
        c["fp16"] = {"enabled": True}

    def lr_word(c):
        c["optimizer"]["params"]["lr"] = "fast"

    def warmup_past_total(c):
        c["scheduler"]["params"].update(warmup_num_steps=5, total_num_steps=1)

    plain = config_with(tmp_path, "plain", lambda c: None)
    return {
        "wandb_missing": (["--deepspeed_config", config_with(tmp_path, "wandb", wandb_block)], no_wandb(tmp_path),
                          'the "wandb" block of the DeepSpeed config needs the wandb package, which is not installed'),
        "tensorboard_path": (["--deepspeed_config", config_with(tmp_path, "tb", tensorboard_under_a_file)], None,
                             f'the "tensorboard" block writes to {blocker / "tb"}, which cannot be made or written'),
        "fp16_on_cpu": (["--deepspeed_config", config_with(tmp_path, "fp16", fp16)], None,
                        '"fp16" is enabled, but fp16 needs a GPU'),
        "negative_max_steps": (["--deepspeed_config", plain, "--max-steps", -5], None,
                               "--max-steps -5: give 0 or more (0: the scheduler's total_num_steps)"),
        "lr_word": (["--deepspeed_config", config_with(tmp_path, "lr", lr_word)], None,
                    "optimizer param \"lr\" = 'fast' in the DeepSpeed config: give a number"),
        "warmup_past_total": (["--deepspeed_config", config_with(tmp_path, "warmup", warmup_past_total)], None,
                              "the scheduler's warmup_num_steps (5) exceeds its total_num_steps (1)"),
    }


# through DeepSpeed's launcher on 2 ranks, as a user's: a problem of the environment, and one that
# rank 0 alone finds (its monitors), which the other rank must exit on too; the rest of the table
# runs train.py's checks in this process (the same code says the line; no launch to pay for)
LAUNCHED = ("wandb_missing", "tensorboard_path")


def test_each_bad_launch_ends_in_one_line_from_one_rank_before_any_step(tmp_path, train_data, capsys):
    """Each bad launch of the table above ends in one line, status 2, before any step."""
    import torch

    import train as train_module
    cases = launches(tmp_path)

    def args_of(name):
        given = cases[name][0]
        return [*given, *TINY, "--data", train_data, "--output-dir", tmp_path / name,
                *([] if "--max-steps" in given else ["--max-steps", 5])]

    with ThreadPoolExecutor(2) as pool:  # two launches at a time: each stops before the engine
        launched = dict(zip(LAUNCHED, pool.map(lambda name: launch(args_of(name), cases[name][1]), LAUNCHED)))
    for name, proc in launched.items():
        lines = [line for line in proc.stderr.splitlines() if "train.py: error:" in line]
        assert len(lines) == 1 and cases[name][2] in lines[0], (name, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr + proc.stdout and "lost a peer" not in proc.stderr, name
        # both ranks left with the same status: DeepSpeed's launcher reports the first it saw
        assert proc.returncode == 2, (name, proc.returncode)
    for name in cases.keys() - set(LAUNCHED):
        assert cases[name][1] is None, name  # an environment of its own needs a launch
        args = train_module.parse_args([str(a) for a in args_of(name)])
        status, err = refused_in_process(lambda: train_module.check_inputs(args, torch.device("cpu")), capsys)
        lines = [line for line in err.splitlines() if "train.py: error:" in line]
        assert status == 2 and len(lines) == 1 and cases[name][2] in lines[0], (name, err[-3000:])
    # refused after the metric sinks' directories were checked: the check leaves none behind
    late = tmp_path / "refused_late"
    args = train_module.parse_args([str(a) for a in ["--deepspeed_config", CPU_CONFIG, *TINY, "--data",
                                                     tmp_path / "no_data", "--output-dir", late, "--max-steps", 5]])
    status, err = refused_in_process(lambda: train_module.check_inputs(args, torch.device("cpu")), capsys)
    assert status == 2 and "no_data" in err and not late.exists(), err[-2000:]
    for name in cases:
        assert not (tmp_path / name / "metrics.jsonl").exists(), name


@pytest.mark.parametrize("args, phrase", [
    ({"max_steps": -1}, "--max-steps -1: give 0 or more"),
    ({"log_every": 0}, "--log-every 0: give 1 or more"),
    ({"keep_checkpoints": -2}, "--keep-checkpoints -2: give 0 or more"),
    ({"dist_timeout_minutes": 0}, "--dist-timeout-minutes 0: give a number of minutes above 0"),
    ({"time_budget": 0.0}, "--time-budget 0: give a duration above 0"),
])
def test_command_line_numbers_out_of_range_are_refused(args, phrase):
    from train import parse_args
    parsed = parse_args(["--data", "d", "--output-dir", "o"])
    vars(parsed).update(args)
    with pytest.raises(LaunchError, match=phrase.replace("(", r"\(").replace(")", r"\)")):
        check_command_line(parsed)


@pytest.mark.parametrize("command", ["train.py", "bert-finetune", "bert-data-prep shards", "bert-ablate",
                                     "bert-plan estimate"])
def test_each_commands_help_names_its_defaults(command, capsys):
    """--help says what an option is when it is not given; unset options and flags say nothing."""
    import importlib
    module, _, sub = command.partition(" ")
    parse = {"train.py": lambda a: importlib.import_module("train").parse_args(a),
             "bert-finetune": lambda a: importlib.import_module("commodity_bert.finetune.cli").build_parser().parse_args(a),
             "bert-data-prep": lambda a: importlib.import_module("data_prep.cli").build_parser().parse_args(a),
             "bert-ablate": lambda a: importlib.import_module("commodity_bert.ablate.cli").parse_args(a),
             "bert-plan": lambda a: importlib.import_module("commodity_bert.plan.cli").parse_args(a)}[module]
    with pytest.raises(SystemExit) as done:
        parse([*sub.split(), "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert done.value.code == 0
    expected = {"train.py": "--log-every LOG_EVERY (default: 10)", "bert-finetune": "--seeds SEEDS [SEEDS ...] (default: 1 2 3 4 5)",
                "bert-data-prep": "(default: 128)", "bert-ablate": "(default:", "bert-plan": "(default:"}[module]
    assert expected in text
    assert "(default: None)" not in text and "(default: False)" not in text


@pytest.mark.parametrize("change, phrase", [
    (lambda c: c["optimizer"]["params"].update(betas=[0.9, 1.5]), 'optimizer param "betas" = [0.9, 1.5]'),
    (lambda c: c["optimizer"]["params"].update(eps=0),
     'optimizer param "eps" = 0 in the DeepSpeed config: give a number above 0'),
    (lambda c: c["optimizer"]["params"].update(weight_decay=-0.1), 'optimizer param "weight_decay" = -0.1'),
    (lambda c: c["optimizer"]["params"].update(bias_correction="yes"), 'give true or false'),
    (lambda c: c["optimizer"]["params"].update(min_coeff=20.0), '"min_coeff" 20.0 > "max_coeff" 10.0'),
    (lambda c: c.update(gradient_clipping=-1), '"gradient_clipping" = -1'),
    (lambda c: c["scheduler"].update(type="Cosine"), "scheduler type 'Cosine' in the DeepSpeed config is not one"),
    (lambda c: c["scheduler"]["params"].update(warmup_steps=3),
     'scheduler param "warmup_steps" = 3 (WarmupDecayLR) in the DeepSpeed config: WarmupDecayLR takes no such'),
    (lambda c: c["scheduler"]["params"].update(total_num_steps=2.5), "give a whole number of steps, 1 or more"),
    (lambda c: c["scheduler"]["params"].update(warmup_max_lr="1e-3"), 'give a number, 0 or more'),
    (lambda c: c["scheduler"]["params"].update(warmup_type="cosine"), 'give "linear" or "log"'),
    (lambda c: c.update(commodity_bert={"head_warmup": {"steps": 10, "encoder_lr_scale": 2}}),
     '"commodity_bert.head_warmup.encoder_lr_scale" must be in [0, 1), not 2'),
    (lambda c: c.update(commodity_bert={"head_warmup": {"steps": "all"}}),
     '"commodity_bert.head_warmup.steps" must be a whole number of steps >= 0'),
])
def test_every_number_of_the_optimizer_and_scheduler_is_checked(change, phrase):
    config = json.loads(CPU_CONFIG.read_text())
    check_deepspeed_config(config, 2)  # as shipped: passes
    change(config)
    with pytest.raises(LaunchError) as error:
        check_deepspeed_config(config, 2)
    assert phrase in str(error.value) and "\n" not in str(error.value)


def test_an_init_from_directory_is_checked_before_anything_loads(tmp_path):
    """--init-from: a weights directory must be a BERT's and hold its tokenizer; a config without
    weights, another model type and a missing directory each get one line naming the fix."""
    from commodity_bert.train.launch_checks import init_source
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(LaunchError, match="config.json but no weights"):
        init_source(bert)
    (bert / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(LaunchError) as error:
        init_source(bert)
    assert "weights but no tokenizer (vocab.txt or tokenizer.json)" in str(error.value)
    assert f"bert-data-prep shards --vocab {bert}" in str(error.value) and "\n" not in str(error.value)
    (bert / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    assert init_source(bert) == ("weights", bert)
    (bert / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    with pytest.raises(LaunchError, match="a roberta model, not a BERT"):
        init_source(bert)
    with pytest.raises(LaunchError, match="no such directory"):
        init_source(tmp_path / "nowhere")


def test_one_bit_optimizers_keep_their_words_and_gpu_configs_pass_on_a_gpu():
    config = json.loads((REPO / "ds_configs" / "bert_base_phase1_onebit_lamb_fp16.json").read_text())
    config["optimizer"]["params"].update(freeze_step="auto", freeze_max_step=100, comm_backend_name="nccl")
    check_deepspeed_config(config, 8)
    check_against_device(config, on_cuda=True)
    with pytest.raises(LaunchError, match="fp16 needs a GPU"):
        check_against_device(config, on_cuda=False)


def test_a_bf16_config_on_a_gpu_without_bf16_is_refused_naming_the_fp16_config():
    path = REPO / "ds_configs" / "bert_base_phase1_lamb_bf16.json"
    config = json.loads(path.read_text())
    check_against_device(config, on_cuda=True, bf16_native=True, path=path)
    with pytest.raises(LaunchError) as error:
        check_against_device(config, on_cuda=True, bf16_native=False, path=path, device_name="Tesla T4")
    assert str(error.value) == ('"bf16" is enabled, but Tesla T4 has no bf16 arithmetic (compute capability below '
                                f'8.0: V100, T4, RTX 20xx); use {path.with_name("bert_base_phase1_lamb_fp16.json")}, '
                                'fp16 with dynamic loss scaling')
    fp16 = json.loads((REPO / "ds_configs" / "bert_base_phase1_lamb_fp16.json").read_text())
    check_against_device(fp16, on_cuda=True, bf16_native=False)


def test_a_schedule_shorter_than_max_steps_is_a_warning_naming_both():
    config = json.loads(CPU_CONFIG.read_text())  # total_num_steps 300
    assert schedule_end_warning(config, 300) is None
    assert schedule_end_warning(config, 400) == (
        "warning: the scheduler's total_num_steps (300) ends before --max-steps (400): from step 301 the learning "
        "rate stays where the schedule ends")


def test_a_rank_that_stops_on_an_error_mid_run_is_named_by_the_others(tmp_path, train_data):
    """Rank 0's csv_monitor directory replaced by a file once the run logs: rank 0 holds its error
    to the next decision, every rank stops there with status 2, rank 1 names rank 0 and its line,
    and no rank says it lost a peer or prints a traceback."""
    csv_dir = tmp_path / "csv"
    config = config_with(tmp_path, "csv", lambda c: c.update(csv_monitor={"enabled": True, "output_path": str(csv_dir)}))
    run = tmp_path / "run"
    proc = subprocess.Popen(launch_cmd(2, "--deepspeed_config", config, *TINY, "--data", train_data, "--output-dir",
                                       run, "--max-steps", 300, "--log-every", 1),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.1)
    os.rename(csv_dir, tmp_path / "csv_moved")
    csv_dir.write_text("a file now\n")
    out, err = proc.communicate(timeout=240)
    lines = [line for line in err.splitlines() if "train.py: error:" in line]
    assert proc.returncode == 2, (out[-2000:], err[-3000:])
    assert len(lines) == 2, err[-3000:]
    [own] = [line for line in lines if line.startswith("train.py: error: the metrics could not be written: ")]
    # the directory moved away, then a file in its place: a write between the two finds neither
    assert f"'{csv_dir}/" in own and ("Not a directory" in own or "No such file or directory" in own), own
    [named] = [line for line in lines if line.startswith("train.py: error: rank 0 on ")]
    assert "stopped with an error after step" in named
    assert own.split("train.py: error: ", 1)[1] in named  # its line, where rank 1's output is all one has
    assert "Traceback" not in err and "lost a peer" not in err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps and max(steps) < 300 and not (run / "hf_model").exists()  # stopped, nothing exported


def test_any_error_on_rank_0_is_its_own_line_and_the_others_name_it(tmp_path, train_data):
    """A fault no check knows, met by rank 0 mid-run: the process runs out of file descriptors
    (its limit lowered from outside, as a site's ulimit would), and its data loader raises. Rank 0
    says its line (the exception, and the file holding its traceback), and rank 1, whose collective
    then fails, names rank 0 and quotes it, read from the process group's store that rank 0 serves:
    no "lost a peer", no traceback on the terminal, status 1, nothing saved."""
    run = tmp_path / "run"
    proc = subprocess.Popen(launch_cmd(2, "--deepspeed_config", CPU_CONFIG, *TINY, "--data", train_data, "--output-dir",
                                       run, "--max-steps", 300, "--log-every", 1, "--save-every", 100),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.1)
    launcher = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    [rank0] = [pid for pid in launcher if "--local_rank=0" in Path(f"/proc/{pid}/cmdline").read_text()]
    # one descriptor to spare: the metrics file's open and close still fit, a batch's tensors do not
    open_now = len(os.listdir(f"/proc/{rank0}/fd"))
    subprocess.run(["prlimit", f"--pid={rank0}", f"--nofile={open_now + 1}"], check=True)
    out, err = proc.communicate(timeout=240)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 1, (out[-2000:], err[-3000:])
    assert len(lines) == 2, err[-3000:]
    own, named = sorted(lines, key=lambda line: "because" in line)
    assert own.startswith("train.py: error: rank 0 on ") and "RuntimeError: Too many open files" in own, own
    traceback_file = Path(own.split("traceback in ", 1)[1].split(";", 1)[0])
    assert traceback_file.parent == run / "errors" and "Traceback (most recent call last)" in traceback_file.read_text()
    assert named.startswith("train.py: error: rank 1 on ") and "stopped because rank 0 did (its line: " in named
    assert own.removeprefix("train.py: error: ") in named
    assert not (run / "checkpoints").exists() and not (run / "hf_model").exists()


def test_a_shard_that_fails_mid_run_is_held_and_the_last_batch_stands_in():
    """next_batch: the error is kept for the next decision and the rank's step still meets the
    others' collectives with the batch it had; at the first batch there is none, so it is raised."""
    import torch

    from commodity_bert.comm.bytes_counter import BytesCounter
    from commodity_bert.data.loader import DataError
    from commodity_bert.train.bookkeeping import Bookkeeping

    def batches():
        yield {"input_ids": torch.ones(2)}
        raise DataError("shard s.hdf5 differs from its manifest (sha256)")

    book = Bookkeeping(device=torch.device("cpu"), world=2, total_batch=4, max_steps=10, log_every=1, eval_every=0,
                       save_every=0, save_every_minutes=0, time_budget=None, traffic=BytesCounter())
    stream = batches()
    first = book.next_batch(stream)
    assert book.next_batch(stream) is first and book.next_batch(stream) is first
    assert book.error == "shard s.hdf5 differs from its manifest (sha256)"
    with book.holding(OSError, what="the metrics could not be written: "):
        raise OSError("disk full")
    assert book.error == "shard s.hdf5 differs from its manifest (sha256)"  # the first is the one said
    fresh = Bookkeeping(device=torch.device("cpu"), world=2, total_batch=4, max_steps=10, log_every=1, eval_every=0,
                        save_every=0, save_every_minutes=0, time_budget=None, traffic=BytesCounter())
    stream = batches()
    next(stream)
    with pytest.raises(DataError):
        fresh.next_batch(stream)


def test_a_run_a_live_launch_holds_is_refused_and_a_killed_ones_lock_is_not(tmp_path, capsys):
    """A double submit: while one launch holds RUN (here a process holding it as train.py's rank 0
    does), another is refused in one line naming that host and process, before anything in RUN
    is touched; once the holder is SIGKILLed, its lock file left behind, the relaunch takes RUN."""
    import signal
    import socket

    import train as train_module
    run = tmp_path / "run"
    ready_r, ready_w = os.pipe()
    holder = os.fork()
    if holder == 0:
        try:
            from commodity_bert.train import run_lock
            held = run_lock.hold(run)  # noqa: F841 - held while the process lives
            os.write(ready_w, b"x")
            time.sleep(300)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"x"
        status, err = refused_in_process(lambda: train_module.hold_the_run(run), capsys)
        [line] = [line for line in err.splitlines() if "train.py: error:" in line]
        assert status == 2
        assert line.startswith(f"train.py: error: {run} is in use by a live launch: process {holder} on host "
                               f"{socket.gethostname()} (started ")
        assert line.endswith(f"holds {run / '.launch.lock'}; wait for it to end or stop it, or give another "
                             f"--output-dir")
        assert sorted(p.name for p in run.iterdir()) == [".launch.lock"]
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    from conftest import one_rank_group
    with one_rank_group():
        held = train_module.hold_the_run(run)
    assert json.loads((run / ".launch.lock").read_text())["pid"] == os.getpid()
    held.release()
