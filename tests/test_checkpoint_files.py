"""The project's own checkpoint files load without running code from them (weights_only)."""
import os
import random

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
