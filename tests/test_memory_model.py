"""bert-plan fit's memory model (plan/memory.py). Its activation term against the bytes autograd
saves for backward (plan/memory_trace.py), on shapes and sizes none of its coefficients were read
from: real CPU tensors for tiny and mini (padded batches, the CPU's kernels), meta tensors for base
and large (the CUDA kernels' own ops). Its state term is checked against every rank's tensors in
test_comm_modes.py; here the fit's answers, by hand."""
import json

import pytest

from commodity_bert.plan import memory_trace
from commodity_bert.plan.memory import GPUS, Setup, gpu_named, state_bytes


@pytest.mark.parametrize("case", [
    ("tiny", 3, 48, 0.1, "cpu", "cpu", "bf16", [48, 30, 9], True),
    ("mini", 4, 64, 0.1, "cpu", "cpu", "fp32", [64, 50, 33, 20], False),
    ("mini", 3, 128, 0.0, "cpu", "cpu", "bf16", [128, 100, 7], False),
    ("base", 16, 128, 0.1, "meta", "cuda", "bf16", None, True),
    ("base", 4, 512, 0.0, "meta", "cuda", "bf16", None, False),
    ("large", 2, 512, 0.1, "meta", "cuda", "fp32", None, False),
    ("large", 8, 128, 0.1, "meta", "cuda", "bf16", None, True),
], ids=lambda c: f"{c[0]}-b{c[1]}-w{c[2]}-{c[5]}-{c[6]}-dropout{c[3]}")
def test_activations_as_autograd_saves_them(case):
    check = memory_trace.traced_and_modelled(*case)
    assert check["modelled_bytes"] == pytest.approx(check["traced_bytes"], rel=1e-3), check


def test_state_by_hand():
    """1-bit LAMB in bf16 on 8 ranks in two levels of 4-rank slices between 2 nodes: 2 + 4 + 12 bytes
    a parameter, and error feedback of a quarter of them, 4 + 4/2 bytes each; LAMB under ZeRO 1 on
    4 ranks: the master and moments split 4 ways."""
    onebit = Setup("bf16", 0, "onebitlamb")
    assert state_bytes(1000, onebit, world=8, slices=4, among=2) == {
        "weights": 2000, "master": 4000, "optimizer": 12000, "exchange": 1000 / 4 * (4 + 4 / 2)}
    assert state_bytes(1000, onebit, world=8)["exchange"] == 1000 * (4 + 4 / 8)  # flat among 8
    zero1 = Setup("bf16", 1, "lamb")
    assert state_bytes(1000, zero1, world=4) == {"weights": 2000, "master": 1000, "optimizer": 2000, "exchange": 0}
    diloco = Setup("fp32", 0, "lamb", {"outer_state_device": "cpu", "compression": "int4", "error_feedback": True})
    assert state_bytes(1000, diloco, world=2)["exchange"] == 1000 * (4 + 2)  # outer state off the GPU


def test_the_cards_by_their_usual_names():
    assert gpu_named("RTX 3090") is GPUS["3090"] and gpu_named("A100-80GB") is GPUS["a100-80"]
    assert gpu_named("v100_32") is GPUS["v100-32"] and gpu_named("2080 Ti") is GPUS["2080ti"]
    assert not GPUS["t4"].bf16 and GPUS["4090"].bf16 and gpu_named("K80") is None


def fit(capsys, *argv):
    from commodity_bert.plan.cli import main
    code = main(["fit", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_fit_on_the_recipes_cluster_of_3090s(tmp_path, capsys):
    """BERT-base phase 1 on 4 + 4 + 2 RTX 3090s: bf16, the config's micro-batch of 64, the global
    batch the 10 ranks make (65,280 of 65,536), no checkpointing; its peak well inside 24 GB."""
    out_json = tmp_path / "fit.json"
    code, out, _ = fit(capsys, "--gpu", "3090", "--model", "base", "--seq-len", "128", "--gpus-per-node", "4,4,2",
                       "--json", str(out_json))
    assert code == 0, out
    assert "precision: bf16" in out and "bert_base_phase1_lamb_bf16.json" in out
    assert "micro-batch: 64 (the config's), accumulation 102: a global batch of 65,280" in out
    assert "activation checkpointing: not needed" in out
    answer = json.loads(out_json.read_text())
    assert answer["world"] == 10 and 4 < answer["peak_gib"] < 12 and answer["checkpointing"] == "no"


def test_fit_on_cards_without_bf16_and_small_ones(capsys):
    code, out, _ = fit(capsys, "--gpu", "T4", "--model", "large", "--seq-len", "512",
                       "--config", "ds_configs/bert_large_phase2_lamb_bf16.json")
    assert code == 0 and "precision: fp16 with dynamic loss scaling (from 2^16" in out
    assert "use ds_configs/bert_large_phase2_lamb_fp16.json" in out
    # BERT-large at 512 in fp32 (5 GiB of state and gradients): on 7.5 GB only with checkpointing;
    # on 9.5 GB 2 sequences fit without it, 20 or more with it; on 6 GB nothing
    quickstart = ("--model", "large", "--seq-len", "512", "--config", "ds_configs/cpu_quickstart_lamb_fp32.json")
    code, out, _ = fit(capsys, "--gpu-mem", "7.5", *quickstart)
    assert code == 0 and "activation checkpointing: needed" in out and "micro-batch: " in out, out
    code, out, _ = fit(capsys, "--gpu-mem", "9.5", *quickstart)
    assert "activation checkpointing: recommended: without it the micro-batch is 2; with it 2" in out, out
    code, out, _ = fit(capsys, "--gpu-mem", "6", *quickstart)
    assert code == 0 and "does not fit" in out, out
    for argv, words in ((["--gpu", "K80"], "--gpu K80: not a card bert-plan knows"),
                        (["--gpu", "3090", "--gpu-mem", "24"], "give --gpu NAME"),
                        (["--gpu", "3090", "--seq-len", "256"], "no shipped config for --model base at --seq-len 256"),
                        (["--gpu", "3090", "--model", "nowhere.json", "--config",
                          "ds_configs/bert_base_phase1_lamb_bf16.json"], "--model nowhere.json: not a preset")):
        code, _, err = fit(capsys, *argv)
        assert code == 2 and err.startswith(f"bert-plan: error: {words}") and err.count("\n") == 1, err
