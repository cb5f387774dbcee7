"""The project's own checkpoint files load without running code from them (weights_only); their
digests name what is wrong with a file, and ranks on nodes without a shared directory step back
to the same intact checkpoint, or all refuse where a node lacks the newest."""
import json
import os
import random
import shutil

import numpy as np
import pytest
import torch

from commodity_bert.train import checkpoint


class RunsAShellCommand:
    def __reduce__(self):
        return (os.system, ("touch /tmp/commodity_bert_pwned",))


def test_a_rank_file_that_would_run_code_is_refused(tmp_path):
    path = tmp_path / "rng_rank0.pt"
    torch.save({"python": random.getstate(), "rank_state": {"x": RunsAShellCommand()}}, path)
    with pytest.raises(Exception, match="Unsupported global|weights_only"):
        checkpoint.load_rank_file(path)
    assert not os.path.exists("/tmp/commodity_bert_pwned")


@pytest.mark.parametrize("numpy_as", ["tensor", "array (before 2026-11-25)"])
def test_rng_states_come_back_from_both_file_formats(tmp_path, numpy_as):
    np.random.seed(3), random.seed(4), torch.manual_seed(5)
    state = checkpoint._rng_state()
    if numpy_as != "tensor":
        state["numpy"] = np.random.get_state()
    torch.save({**state, "rank_state": {"optimizer": {"step": 3, "buffer": torch.ones(2)}}}, tmp_path / "rng.pt")
    expected = (np.random.rand(), random.random(), torch.rand(1))
    loaded = checkpoint.load_rank_file(tmp_path / "rng.pt")
    checkpoint._set_rng_state(loaded)
    assert (np.random.rand(), random.random(), torch.rand(1)) == expected
    assert loaded["rank_state"]["optimizer"]["step"] == 3


# ---- digests, and the step back to the newest intact checkpoint


def fake_checkpoint(directory, step: int, ranks, digest: bool = True):
    """A checkpoint directory as save() leaves it, with small torch files."""
    tag = checkpoint.tag_for(step)
    (directory / tag).mkdir(parents=True)
    torch.save({"module": torch.ones(1000) * step}, directory / tag / checkpoint.MODEL_FILE)
    for rank in ranks:
        torch.save({"rank": rank}, directory / tag / checkpoint.rng_file(rank))
    if digest:
        checkpoint.write_digest(directory / tag)
    (directory / "latest").write_text(tag)
    return directory / tag


def test_the_digest_names_what_is_wrong_with_a_file(tmp_path):
    step_dir = fake_checkpoint(tmp_path, 4, [0, 1])
    recorded = json.loads((step_dir / "digest.json").read_text())["files"]
    assert sorted(recorded) == ["mp_rank_00_model_states.pt", "rng_rank0.pt", "rng_rank1.pt"]
    assert checkpoint.damage(tmp_path, "step_00000004", 1) is None
    (step_dir / "rng_rank1.pt").unlink()
    assert checkpoint.damage(tmp_path, "step_00000004", 1) == "rng_rank1.pt is missing"
    assert checkpoint.damage(tmp_path, "step_00000004", 0) is None  # rank 0 reads no rng_rank1.pt
    model = step_dir / checkpoint.MODEL_FILE
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped: the same size
    model.write_bytes(bytes(data))
    assert checkpoint.damage(tmp_path, "step_00000004", 0) == \
        "mp_rank_00_model_states.pt is not the file written (its SHA-256 differs)"
    # a torch file whose bytes are not those torch wrote is refused when the digest is taken
    with pytest.raises(OSError, match="mp_rank_00_model_states.pt does not read back as written|not a whole torch"):
        checkpoint.write_digest(step_dir)
    unfinished = fake_checkpoint(tmp_path, 6, [0], digest=False)
    (tmp_path / "latest").write_text("step_00000004")
    assert checkpoint.damage(tmp_path, unfinished.name, 0) == "its save did not finish (no digest.json)"


def _resume_on_two_nodes(rank, world, port, results, root):
    """Two ranks, each on its own 'node' with a directory of its own (node-local checkpoints)."""
    import torch.distributed as dist
    os.environ["LOCAL_RANK"] = "0"  # each is its node's first rank: its directory's writer
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    directory = root / f"node{rank}"
    try:
        results[rank] = checkpoint.agree_on_resume(directory, explicit=False, node_local=True)
    except checkpoint.CheckpointError as exc:
        results[rank] = str(exc)
    dist.barrier()
    dist.destroy_process_group()


def test_a_node_without_the_newest_checkpoint_stops_every_rank_naming_it(tmp_path):
    """Node 1 lost step 4 (its disk was replaced, a copy failed): no rank may go on, from step 4 or
    from a step of its own; both say so in the same line. (The launches around it, on nodes that
    share no run directory: test_checkpoints_on_a_cluster.py.)"""
    from conftest import spawn_ranks
    for rank in (0, 1):
        for step in (2, 4):
            fake_checkpoint(tmp_path / f"node{rank}", step, [rank])
    shutil.rmtree(tmp_path / "node1" / "step_00000004")
    results = spawn_ranks(_resume_on_two_nodes, 2, tmp_path)
    for rank in (0, 1):  # each names its own directory
        assert results[rank].startswith(f"ranks disagree on the checkpoint to resume in {tmp_path / f'node{rank}'}: "
                                        "step_00000004 is the newest, but rank 1 on "), results[rank]
        assert "has no checkpoint" in results[rank] or "has step_00000002" in results[rank]
        assert "rank 0" not in results[rank] and "--resume none" in results[rank]
    assert (tmp_path / "node0" / "step_00000004").is_dir()  # nothing renamed aside


def test_nodes_without_a_shared_directory_step_back_to_the_same_intact_checkpoint(tmp_path):
    """Step 4 cut short on node 1 only: both ranks resume step 2, both nodes keep step 4 aside
    and name step 2 in `latest`; with step 2 damaged too, both refuse in the same line."""
    from conftest import spawn_ranks
    for rank in (0, 1):
        for step in (2, 4):
            fake_checkpoint(tmp_path / f"node{rank}", step, [rank])
    model = tmp_path / "node1" / "step_00000004" / checkpoint.MODEL_FILE
    model.write_bytes(model.read_bytes()[:100])
    results = spawn_ranks(_resume_on_two_nodes, 2, tmp_path)
    assert results[0][0] == results[1][0] == "step_00000002"
    note = results[0][1]  # rank 0 says it
    assert note.startswith(f"checkpoint {tmp_path / 'node0' / 'step_00000004'} is damaged (rank 1 on ")
    assert "mp_rank_00_model_states.pt has 100 bytes" in note and "resuming from step_00000002" in note
    for rank in (0, 1):
        node = tmp_path / f"node{rank}"
        assert (node / "latest").read_text() == "step_00000002"
        assert (node / "step_00000004.skipped").is_dir() and not (node / "step_00000004").exists()
    (tmp_path / "node0" / "step_00000002" / "rng_rank0.pt").write_bytes(b"")
    for rank in (0, 1):
        (tmp_path / f"node{rank}" / "step_00000004.skipped").rename(tmp_path / f"node{rank}" / "step_00000004")
        (tmp_path / f"node{rank}" / "latest").write_text("step_00000004")
    results = spawn_ranks(_resume_on_two_nodes, 2, tmp_path)
    assert all("no older checkpoint is intact on every rank" in results[rank] for rank in (0, 1))
