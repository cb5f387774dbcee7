"""The DeepSpeed config's monitor blocks receive the project's metrics (commodity_bert/train/metrics.py):
TensorBoard, csv_monitor and wandb (offline: nothing leaves the machine), across a relaunch that
resumes from a checkpoint older than the last logged row."""
import json
import os
import shutil
import struct

import pytest
from conftest import CPU_CONFIG, REPO, config_file, rows, train

STEPS = 10


def wandb_records(path):
    """The records of a .wandb file (LevelDB's log format: 32 KiB blocks of checksummed chunks
    after a 7-byte header), as wandb's protobufs; wandb 0.31 has no Python reader of its own."""
    from wandb.proto import wandb_internal_pb2 as pb
    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    pos, block, chunk = 7, 32768, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        chunk += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(chunk)
            yield record
            chunk = b""
        elif kind == 0 and length == 0:
            break


def wandb_launch(directory):
    """One launch's offline run: its id, config keys, logged steps of train/loss, and final summary."""
    [path] = directory.glob("run-*.wandb")
    found = {"steps": [], "summary": {}, "config": set()}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            found["id"] = record.run.run_id
            found["config"] |= {item.key for item in record.run.config.update}
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            if "train/loss" in items:
                found["steps"].append(items["_step"])
        elif kind == "summary":
            found["summary"].update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                     for item in record.summary.update})
    return found


@pytest.fixture(scope="module")
def monitored(tmp_path_factory, train_data):
    """10 steps on one rank with the three blocks set; then as if the run had died after logging
    step 10 but before saving it: step 6's checkpoint is the last, and the relaunch trains 7-10 again."""
    pytest.importorskip("wandb", reason="wandb is a test dependency (pip install -e .[test])")
    root = tmp_path_factory.mktemp("monitors")
    run = root / "run"
    config = config_file(root, CPU_CONFIG.name, **{
        "tensorboard": {"enabled": True, "output_path": str(run / "tb"), "job_name": "mine"},
        "csv_monitor": {"enabled": True, "output_path": str(run / "csv"), "job_name": "mine"},
        "wandb": {"enabled": True, "project": "commodity-bert-tests", "group": "monitors"}})
    os.environ["WANDB_MODE"] = "offline"
    try:
        args = ["--deepspeed_config", config, "--model", "tiny", "--data", train_data, "--output-dir", run,
                "--max-steps", STEPS, "--log-every", 2, "--save-every", 6, "--eval-every", 1000, "--num-workers", 1]
        first = train(1, *args)
        shutil.rmtree(run / "checkpoints" / "step_00000010")
        (run / "checkpoints" / "latest").write_text("step_00000006")
        second = train(1, *args)
    finally:
        del os.environ["WANDB_MODE"]
    return run, first, second


def test_csv_monitor_holds_each_logged_step_once_across_the_relaunch(monitored):
    run, _, second = monitored
    assert "resuming from" in second.stdout and "at step 6" in second.stdout
    losses = {r["step"]: r["loss"] for r in rows(run)}
    assert list(losses) == [2, 4, 6, 8, 10]
    lines = (run / "csv" / "mine" / "train_loss.csv").read_text().splitlines()
    assert lines[0] == "step,loss"
    csv_rows = [line.split(",") for line in lines[1:]]
    assert [int(s) for s, _ in csv_rows] == [2, 4, 6, 8, 10]             # 8 and 10 cut, then written again
    assert [float(v) for _, v in csv_rows] == pytest.approx(list(losses.values()), rel=1e-6)
    assert (run / "csv" / "mine" / "val_mlm_acc.csv").exists()        # the final evaluation, val/ named apart
    assert (run / "csv" / "mine" / "train_bytes_sent.csv").exists()   # the project's own metrics, not only loss


def test_tensorboard_block_says_where_and_the_history_is_purged_back_to_the_checkpoint(monitored):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run, _, _ = monitored
    assert not (run / "tensorboard").exists()                         # the block's path, not the default
    events = EventAccumulator(str(run / "tb" / "mine"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6, 8, 10]
    assert {"train/mlm_acc", "train/tokens_per_s", "train/comm_rounds", "val/mlm_acc"} <= set(events.Tags()["scalars"])
    assert not list(REPO.glob("DeepSpeedJobName*"))                  # DeepSpeed's engine opened no writer of its own


def test_wandb_is_one_run_across_the_relaunch_with_config_and_summary(monitored):
    run, _, _ = monitored
    launches = sorted((run / "wandb").glob("offline-run-*"))
    assert len(launches) == 2
    first, second = map(wandb_launch, launches)
    assert first["id"] == second["id"] == (run / "wandb_run_id").read_text().strip()
    assert first["steps"] == [2, 4, 6, 8, 10] and second["steps"] == [8, 10]  # synced, the server keeps the first of each step
    assert {"args", "deepspeed_config", "model_config", "world_size"} <= first["config"]
    summary = second["summary"]
    assert summary["stopped_by"] == "max steps" and summary["step"] == STEPS
    assert summary["val_mlm_acc"] == json.loads((run / "summary.json").read_text())["val_mlm_acc"]
