"""train.py through DeepSpeed's launcher: real gloo ranks on this machine."""
import json
import shutil

import pytest
from conftest import (
    COMMON,
    CPU_CONFIG,
    ONEBIT,
    REPO,
    crashed_after,
    free_port,
    launched,
    load_manifest,
    onebit_unequal,
    one_rank_group,
    refused_in_process,
    relaunched,
    rows,
    run_cli,
    train,
    window_loss,
)

from commodity_bert.data.dataset import ShardSet
from commodity_bert.data.loader import DataError, TrainingBatches
from commodity_bert.model.bert import ModelConfigError, build_config
from commodity_bert.train.launch_checks import LaunchError, check_data_against_model, check_deepspeed_config


@pytest.fixture(scope="module")
def data(train_data):
    return train_data


def test_loss_falls_and_validation_accuracy_rises(run30):
    history = rows(run30)
    assert [r["step"] for r in history] == [5, 10, 15, 20, 25, 30]
    assert history[-1]["loss"] < history[0]["loss"] - 0.1
    evals = [r for r in history if "val_mlm_acc" in r]
    assert [r["step"] for r in evals] == [15, 30]
    assert evals[1]["val_mlm_acc"] > evals[0]["val_mlm_acc"]


def test_parameters_identical_on_all_ranks(run30):
    summary = json.loads((run30 / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["step"] == 30
    assert summary["params_identical_across_ranks"] is True


def test_metrics_tensorboard_and_checkpoints(run30):
    row = rows(run30)[-1]
    for key in ("step", "samples", "loss", "mlm_acc", "nsp_acc", "lr", "loss_scale", "grad_norm", "seq_per_s",
                "tokens_per_s", "tflops", "data_wait_s", "bytes_sent", "bytes_received", "node_bytes_sent",
                "node_bytes_received", "comm_rounds", "val_mlm_acc", "val_loss"):
        assert isinstance(row[key], (int, float)), key
    assert row["samples"] == 30 * 64 and row["grad_norm"] > 0 and row["tokens_per_s"] > row["seq_per_s"]
    # DeepSpeed's gradient allreduce, in buckets; the loop's own collectives are left out
    assert row["comm_rounds"] >= 1 and row["comm_rounds"] == int(row["comm_rounds"])
    # both ranks on one node: nothing crosses between nodes
    assert row["node_bytes_sent"] == row["node_bytes_received"] == 0 < row["bytes_sent"]
    assert list((run30 / "tensorboard").glob("events.out.tfevents.*"))
    checkpoints = run30 / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == ["step_00000020", "step_00000030"]
    assert (checkpoints / "latest").read_text() == "step_00000030"


def test_exported_model_answers_fill_mask(run30):
    from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline
    model = AutoModelForMaskedLM.from_pretrained(run30 / "hf_model")
    tokenizer = AutoTokenizer.from_pretrained(run30 / "hf_model")
    assert len(tokenizer) == model.config.vocab_size == 8192  # the session's vocabulary (conftest.sotu_vocab)
    fill = pipeline("fill-mask", model=model, tokenizer=tokenizer)
    answers = fill("the congress of the united [MASK] .")
    assert len(answers) == 5 and all(a["token_str"] for a in answers)


def test_model_card_says_how_the_model_was_made(run30, data):
    """RUN/hf_model/README.md from the run's records: Hugging Face's metadata, the data's sources
    and shards by sha256, what trained it and how long, and the command that trains it again."""
    import re

    from huggingface_hub import ModelCard
    card = ModelCard.load(run30 / "hf_model" / "README.md")
    summary = json.loads((run30 / "summary.json").read_text())
    assert (card.data.pipeline_tag, card.data.library_name) == ("fill-mask", "transformers")
    [result] = card.data.eval_results
    assert result.metric_name == "masked-LM accuracy" and result.metric_value == round(summary["val_mlm_acc"], 4)
    manifest = load_manifest(data)
    for split in ("train", "validation"):
        for shard in manifest["splits"][split]["shards"]:
            assert shard["sha256"] in card.text
    [source] = manifest["sources"]                                     # the corpus file, hashed by data prep
    assert source["sha256"] in card.text and f"{source['bytes']:,}" in card.text
    assert "| steps | 30 (max steps) |" in card.text and f"| samples | {30 * 64:,} |" in card.text
    assert "| ranks | 2 on 1 host(s)" in card.text and "| hardware | CPU: " in card.text
    assert "| optimizer | Lamb " in card.text and "| precision | fp32 |" in card.text
    assert f"{100 * summary['val_mlm_acc']:.2f}%" in card.text
    command = re.search(r"```bash\n(.*)\n```", card.text).group(1)
    assert command.startswith(f"deepspeed --num_gpus 2 train.py --deepspeed_config {CPU_CONFIG} --data {data} ")
    assert "--max-steps 30" in command and "--model tiny" in command
    recorded = json.loads(re.search(r"```json\n(.*?)\n```", card.text, re.S).group(1))
    assert recorded == json.loads((run30 / "run_config.json").read_text())


def test_resume_equals_uninterrupted_and_a_fresh_start_sets_the_history_aside(tmp_path, data, run30):
    """fp32 LAMB as shipped (the bf16 path of every mode: test_comm_modes.py): run30 as if killed
    after its step-20 checkpoint with its history up to step 25 and a torn line; the relaunch
    continues as run30 went on."""
    run = crashed_after(run30, 20, tmp_path / "run")
    proc = train(2, *COMMON, "--data", data, "--output-dir", run, "--eval-every", 15, "--save-every", 10,
                 "--max-steps", 30)
    relaunched(proc, run30, run, 20)
    # a fresh start in the same directory keeps the earlier history aside, not mixed in; started
    # from run30's weights (phase 2 from phase 1), its first steps are past run30's first
    train(1, *COMMON, "--data", data, "--output-dir", run, "--max-steps", 5, "--resume", "none", "--init-from", run30)
    assert [r["step"] for r in rows(run)] == [5]
    [aside] = run.glob("metrics.jsonl.*")
    assert [json.loads(line)["step"] for line in aside.read_text().splitlines()] == [5, 10, 15, 20, 25, 30]
    fresh = rows(run30)[0]["loss"]  # first 5 steps from random weights
    assert rows(run)[0]["loss"] < fresh - 0.1


def test_a_relaunch_on_fewer_ranks_keeps_the_global_batch_and_the_data_order(tmp_path, data, run30, capsys):
    """run30 (2 ranks × 32) relaunched from its step-20 checkpoint on 1 rank: it says what changed,
    trains 64 sequences a step (accumulation 2) on the samples of the epoch that step 20 left
    untrained; on 3 ranks, which cannot make 64 with a micro-batch of at most 32, it is refused in
    one line naming --allow-batch-change, and with that flag it goes on at the config's 96."""
    import train as train_module
    run = crashed_after(run30, 20, tmp_path / "run")
    progress = json.loads((run / "checkpoints" / "step_00000020" / "progress.json").read_text())
    assert progress == {"step": 20, "samples": 20 * 64, "batch": {"global_batch": 64, "micro_batch": 32,
                                                                "accumulation": 1, "world_size": 2}}
    proc = train(1, *COMMON, "--data", data, "--output-dir", run, "--max-steps", 22, "--log-every", 1)
    assert "relaunch against step_00000020: ranks 2 → 1, accumulation 1 → 2 (global batch 64 kept)" in proc.stdout
    assert "samples of epoch 0 trained on 2 rank(s) × micro-batch 32; the rest of the epoch is dealt to 1 rank(s)" \
        in proc.stdout
    assert [(r["step"], r["samples"]) for r in rows(run) if r["step"] > 20] == [(21, 21 * 64), (22, 22 * 64)]
    assert json.loads((run / "summary.json").read_text())["world_size"] == 1
    # 3 ranks: decided before an engine exists, checked here in process
    args = train_module.parse_args([*map(str, COMMON), "--data", str(data), "--output-dir", str(run)])
    with one_rank_group():
        inputs = train_module.check_inputs(args, torch_cpu())
    from commodity_bert.train.launch_checks import batch_for_resume
    with pytest.raises(LaunchError) as error:
        batch_for_resume(inputs.config, 3, progress["batch"], "step_00000020", allow_change=False)
    assert str(error.value) == (
        "step_00000020 trained at global batch 64 (2 ranks × micro-batch 32 × accumulation 1); 3 ranks with a "
        "micro-batch of at most 32 cannot make it (the nearest is 63); relaunch on a world size that divides 64, "
        "or give --allow-batch-change to go on at 96 a step (3 × 32 × 1)")
    batch, line = batch_for_resume(inputs.config, 3, progress["batch"], "step_00000020", allow_change=True)
    assert tuple(batch) == (96, 32, 1)
    assert line == "relaunch against step_00000020: ranks 2 → 3, global batch 64 → 96 (--allow-batch-change)"
    # a doubled micro-batch on the same 2 ranks: 64 kept with the checkpoint's micro-batch
    batch, line = batch_for_resume({**inputs.config.given, "train_micro_batch_size_per_gpu": 64}, 2,
                                   progress["batch"], "step_00000020", allow_change=False)
    assert tuple(batch) == (64, 32, 1)
    assert line == ("relaunch against step_00000020: micro-batch 32 kept (global batch 64 kept; the config asks "
                    "micro-batch 64)")


def torch_cpu():
    import torch
    return torch.device("cpu")


def test_resume_of_a_damaged_checkpoint_is_refused_in_one_line(tmp_path, data, run30, capsys):
    """run30's newest checkpoint (step 30) truncated, as a killed copy or a failing disk leaves it:
    --resume of it is refused in one line that names the file and its sizes (--resume auto's
    fallback to the newest intact one is the chaos run's, below), where train.py decides what to
    resume, in this process (the launch's one-line exit: test_launch_errors.py)."""
    import train as train_module
    import shutil
    checkpoints = run30 / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == ["step_00000020", "step_00000030"]
    recorded = json.loads((checkpoints / "step_00000030" / "digest.json").read_text())["files"]
    assert {"mp_rank_00_model_states.pt", "rng_rank0.pt", "rng_rank1.pt"} <= set(recorded)
    run = tmp_path / "run"
    shutil.copytree(checkpoints, run / "checkpoints")  # copies, not links: a file of it is cut short
    model = run / "checkpoints" / "step_00000030" / "mp_rank_00_model_states.pt"
    size = model.stat().st_size
    with open(model, "r+b") as fh:
        fh.truncate(size // 2)
    args = train_module.parse_args([*map(str, COMMON), "--data", str(data), "--max-steps", "30",
                                    "--output-dir", str(tmp_path / "other"), "--resume", str(run / "checkpoints")])
    status, err = refused_in_process(lambda: train_module.checkpoint_place(args, tmp_path / "other"), capsys)
    [line] = [line for line in err.splitlines() if "train.py: error:" in line]
    assert status == 2
    assert line.startswith(f"train.py: error: --resume {run / 'checkpoints'}: checkpoint "
                           f"{run / 'checkpoints' / 'step_00000030'} is damaged (")
    assert f"mp_rank_00_model_states.pt has {size // 2:,} bytes, {size:,} when written" in line
    assert model.stat().st_size == size // 2  # nothing of the user's touched


def test_init_from_a_checkpoint_directory_passes_over_a_damaged_newest_and_changes_nothing(tmp_path, run30, capsys):
    """Where train.py picks --init-from's checkpoint, in this process (a run started from one:
    test_training_paths.py)."""
    import train as train_module
    source = tmp_path / "source"
    shutil.copytree(run30 / "checkpoints", source)
    model = source / "step_00000030" / "mp_rank_00_model_states.pt"
    raw = bytearray(model.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    model.write_bytes(bytes(raw))
    with one_rank_group():
        assert train_module.intact_weights_to_start_from(source) == "step_00000020"
    out = capsys.readouterr().out
    assert (f"--init-from: checkpoint {source / 'step_00000030'} is damaged (mp_rank_00_model_states.pt is not the "
            f"file written (its SHA-256 differs)): using step_00000020, the newest intact one") in out
    assert (source / "latest").read_text() == "step_00000030" and not list(source.glob("*.skipped"))


def test_init_from_a_run_of_another_size_is_refused_and_without_model_its_shape_is_said(tmp_path, data, run30,
                                                                                         capsys):
    """`--model mini --init-from` a `tiny` run (its export, and its checkpoints) is refused in one
    line naming both shapes, before anything loads; without --model the run's shape is trained,
    and a line says so. In this process, on a group of one rank."""
    import torch

    import train as train_module

    def args(*given):
        return train_module.parse_args([str(a) for a in ("--deepspeed_config", CPU_CONFIG, "--data", data,
                                                         "--output-dir", tmp_path / "run", *given)])

    def model_of(parsed):
        inputs = train_module.check_inputs(parsed, torch.device("cpu"))
        return train_module.pretraining_model(parsed, inputs, resuming=False)
    for source in (run30, run30 / "checkpoints"):
        status, err = refused_in_process(lambda: model_of(args("--model", "mini", "--init-from", source)), capsys)
        lines = [line for line in err.splitlines() if "train.py: error:" in line]
        assert status == 2 and len(lines) == 1, err[-2000:]
        assert (f"--model mini is hidden 256, 4 layers, 4 heads, feed-forward 1024 but --init-from {source} is "
                f"hidden 128, 2 layers, 2 heads, feed-forward 512") in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    with one_rank_group():
        _, config, init_checkpoint = model_of(args("--init-from", run30 / "checkpoints"))
    assert (config.hidden_size, config.num_hidden_layers) == (128, 2) and init_checkpoint is not None
    assert (f"--init-from {run30 / 'checkpoints'}: training its shape (hidden 128, 2 layers, 2 heads, feed-forward "
            f"512), as no --model was given") in capsys.readouterr().out


def test_a_bin_only_bertmodel_without_its_head_is_continued_on_shards_of_its_own_vocabulary_and_casing(
        tmp_path, data, sotu_small, run30):
    """Domain adaptation from a Hugging Face BERT directory as sentence-transformers saves one: a
    `BertModel` (no masked-LM head), weights as pytorch_model.bin only, its tokenizer files and
    1_Pooling/. It loads with one line saying the head starts fresh; under a head warm-up covering
    the run the encoder does not move; the export loads with from_pretrained and in bert-finetune.
    `bert-data-prep shards --vocab DIR` tokenizes with DIR's vocabulary and casing; shards of
    another vocabulary (same size) or casing are refused in one line."""
    import torch
    from safetensors.torch import load_file
    from transformers import BertForMaskedLM, BertModel

    from commodity_bert.data.vocab import model_vocabulary
    from commodity_bert.finetune.models import load as load_for_finetuning
    from commodity_bert.train.launch_checks import check_vocabulary_against_source
    source = tmp_path / "sentence_bert"
    encoder = BertModel.from_pretrained(run30 / "hf_model")
    encoder.save_pretrained(source)
    for weights in list(source.glob("*.safetensors")):  # transformers 5 saves safetensors only
        torch.save(load_file(weights), source / "pytorch_model.bin")
        weights.unlink()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (source / name).write_bytes((run30 / "hf_model" / name).read_bytes())
    (source / "1_Pooling").mkdir()
    (source / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert json.loads((source / "config.json").read_text())["architectures"] == ["BertModel"]
    assert not list(source.glob("*.safetensors"))
    config = json.loads(CPU_CONFIG.read_text())
    config["commodity_bert"] = {"head_warmup": {"steps": 5, "head_lr_scale": 10.0}}
    (tmp_path / "head_warmup.json").write_text(json.dumps(config))
    run = tmp_path / "continued"
    output = train(1, "--deepspeed_config", tmp_path / "head_warmup.json", "--log-every", 1, "--num-workers", 1,
                   "--data", data, "--output-dir", run, "--max-steps", 5, "--init-from", source).stdout
    said = [line for line in output.splitlines() if "masked-LM head" in line]
    assert len(said) == 1 and said[0].startswith(f"--init-from {source}: no weights for the masked-LM head")
    assert "LOAD REPORT" not in output and "MISSING" not in output
    adapted, info = BertForMaskedLM.from_pretrained(run / "hf_model", output_loading_info=True)
    assert not info["missing_keys"]
    before = encoder.state_dict()
    assert all(torch.equal(before[name], tensor) for name, tensor in adapted.bert.state_dict().items()
               if name in before)  # the encoder stood still while the head learned
    assert rows(run)[-1]["loss"] < rows(run)[0]["loss"]
    assert load_for_finetuning(run).encoder_state  # what bert-finetune starts from
    # the same command with more steps resumes: the source's architecture, not --model's (base)
    output = train(1, "--deepspeed_config", tmp_path / "head_warmup.json", "--log-every", 1, "--num-workers", 1,
                   "--data", data, "--output-dir", run, "--max-steps", 7, "--init-from", source).stdout
    assert "resuming from" in output and rows(run)[-1]["step"] == 7
    resumed = BertForMaskedLM.from_pretrained(run / "hf_model").bert.state_dict()
    assert not torch.equal(resumed["encoder.layer.0.attention.self.query.weight"],
                           before["encoder.layer.0.attention.self.query.weight"])  # past the warm-up it moves
    source_vocab = model_vocabulary(source)
    assert source_vocab and source_vocab[0] == (data / "vocab.txt").read_text().splitlines()

    # shards made with the directory as --vocab: its tokens, and its casing when none is given
    config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**config, "do_lower_case": False}))
    cased = tmp_path / "cased_shards"
    run_cli("shards", "--input", sotu_small, "--vocab", source, "--seq-len", 64, "--dupe-factor", 1, "--num-shards", 1,
            "--workers", 1, "--output", cased)
    manifest = load_manifest(cased)
    tokens, lowercase = model_vocabulary(source)  # the export holds tokenizer.json, not vocab.txt
    assert (cased / "vocab.txt").read_text().splitlines() == tokens and lowercase is False
    assert manifest["vocab"]["lowercase"] is False
    check_vocabulary_against_source(ShardSet.open(cased), source)  # they match: no error

    manifest = load_manifest(data)  # lower-cased shards against the cased model
    with pytest.raises(LaunchError) as error:
        check_vocabulary_against_source(ShardSet.open(data), source)
    assert "the model is cased but" in str(error.value) and f"--vocab {source}" in str(error.value)
    tokens[200], tokens[201] = tokens[201], tokens[200]  # the same size, other ids (vocab.txt goes first)
    (source / "vocab.txt").write_text("\n".join(tokens) + "\n")
    with pytest.raises(LaunchError) as error:
        check_vocabulary_against_source(ShardSet.open(data), source)
    assert "they differ from id 200" in str(error.value) and "\n" not in str(error.value)


# ---- 1-bit LAMB (freeze_step 10 in the CPU config)



def test_onebit_lamb_on_three_ranks_stays_identical_and_sends_16x_less(tmp_path, data):
    run = tmp_path / "run"
    train(3, *ONEBIT, "--data", data, "--output-dir", run, "--max-steps", 20)
    assert json.loads((run / "summary.json").read_text())["params_identical_across_ranks"] is True
    sent = {r["step"]: r["bytes_sent"] for r in rows(run)}
    assert sent[5] == sent[10] > 0                 # warmup: DeepSpeed's fp32 gradient allreduce
    assert sent[15] == sent[20] <= sent[10] / 16   # compression: 1-bit momenta


def test_compiled_model_trains_like_eager(tmp_path, data, onebit20):
    """--compile through both 1-bit LAMB stages, and every rank exits: compiled runs kept rank 1's
    loader alive until interpreter exit, where its worker (deaf to SIGTERM) was joined for ever
    (launched, not forked: a forked rank ends in os._exit, without the interpreter's exit)."""
    run = tmp_path / "run"
    launched(2, *onebit_unequal(tmp_path), "--data", data, "--output-dir", run, "--max-steps", 15, "--compile",
             timeout=600)
    compiled, eager = rows(run), {r["step"]: r for r in rows(onebit20)}  # onebit20 logs every step
    assert [r["step"] for r in compiled] == [5, 10, 15]
    # batch widths and token counts vary from step to step; no step after the first recompiles
    assert len({r["compiled_graphs"] for r in compiled}) == 1 and compiled[0]["compiled_graphs"] > 0
    assert json.loads((run / "summary.json").read_text())["params_identical_across_ranks"] is True
    # the same samples and weights; only dropout's random stream differs under inductor
    for c in compiled:
        # 5-step means: eager falls 0.24 from step 5 to 15 (9.71 to 9.47 with the session's 8,192-token
        # vocabulary); the two dropout streams put them 0.007 and 0.03 apart at step 15 in two runs
        assert c["loss"] == pytest.approx(window_loss(eager, c["step"]), abs=0.06), c


# ---- validation before launch: one clear line, before any step


def bad_case(tmp_path, case):
    """(config, ranks, model, the phrase of its refusal) for one bad launch."""
    ranks, model, phrase = 1, "tiny", None
    config = json.loads(CPU_CONFIG.read_text())
    if case == "unknown_optimizer":
        config["optimizer"]["type"] = "Adagrad"
        phrase = "'Adagrad' is not supported"
    elif case == "misspelt_project_key":  # was ignored: the run trained without bucket-wise clipping
        config["commodity_bert"] = {"bucketwise_cliping": {"enabled": True}}
        phrase = 'unknown key "commodity_bert.bucketwise_cliping"'
    elif case == "onebit_zero1":
        config["optimizer"]["type"] = "OneBitLamb"
        config["zero_optimization"] = {"stage": 1}
        phrase = "OneBitLamb cannot run under ZeRO stage 1"
    elif case == "bucketwise_zero1":
        config["optimizer"]["type"] = "AdamW"
        config["zero_optimization"] = {"stage": 1}
        config["commodity_bert"] = {"bucketwise_clipping": {"enabled": True}}
        phrase = "bucket-wise clipping cannot run under ZeRO stage 1"
    elif case == "bucketwise_onebit":
        config["optimizer"]["type"] = "OneBitLamb"
        config["commodity_bert"] = {"bucketwise_clipping": {"enabled": True}}
        phrase = "bucket-wise clipping and OneBitLamb both replace the gradient allreduce"
    elif case == "lamb_zero1":
        config["zero_optimization"] = {"stage": 1}
        phrase = "Lamb cannot run under ZeRO stage 1"
    elif case == "batch_sizes":
        ranks, config["train_batch_size"] = 2, 48
        phrase = "train_batch_size 48 ≠ train_micro_batch_size_per_gpu 32 × gradient_accumulation_steps 1 × 2 ranks"
    else:
        bert = {"vocab_size": 8192, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                "intermediate_size": 128, "max_position_embeddings": 512}
        if case == "positions":
            bert["max_position_embeddings"], phrase = 32, "sequences of 64 tokens but the model has 32 positions"
        else:
            bert["vocab_size"], phrase = 8000, "vocab_size 8000 but the data's vocabulary has 8192 tokens"
        model = tmp_path / "bert.json"
        model.write_text(json.dumps(bert))
    return config, ranks, model, phrase


BAD_CASES = ["unknown_optimizer", "misspelt_project_key", "onebit_zero1", "bucketwise_zero1", "bucketwise_onebit",
             "lamb_zero1", "batch_sizes", "positions", "vocab"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_configs_are_refused_in_one_line(tmp_path, data, case):
    """The checks train.py runs before its first step (train.py, "checks, data and model"), each
    case in this process; two cases through the launcher below show the line and the exit."""
    config, ranks, model, phrase = bad_case(tmp_path, case)
    manifest = load_manifest(data)
    with pytest.raises((LaunchError, ModelConfigError)) as error:
        check_deepspeed_config(config, ranks)
        check_data_against_model(ShardSet.open(data), build_config(str(model), manifest["vocab"]["size"]))
    assert phrase in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_missing_or_corrupt_shard_is_refused_before_training(tmp_path, data, damage):
    import shutil
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    shard = copy / "shard_00001.hdf5"
    if damage == "missing":
        shard.unlink()
        phrase = "shard_00001.hdf5 is missing"
    else:
        shard.write_bytes(b"\x00" * 1000)
        phrase = "shard_00001.hdf5: cannot be read as HDF5"
    # checked when a rank's loader is made, before any step (train.py's check_inputs); that every
    # rank then stops in one line is held, through the launcher, by test_checkpoints_on_a_cluster.py's
    # test_a_shard_that_differs_from_its_manifest_stops_every_rank
    TrainingBatches(ShardSet.open(copy), 0, 2, 32, 42, 0)  # rank 0 reads shards 0 and 2
    with pytest.raises(DataError) as error:
        TrainingBatches(ShardSet.open(copy), 1, 2, 32, 42, 0)
    assert phrase in str(error.value) and "\n" not in str(error.value)


def test_a_run_killed_at_random_with_a_damaged_checkpoint_ends_as_the_uninterrupted_one(tmp_path, data, run30):
    """The chaos run's short form (benchmarks/chaos.py has the long one, with kills at random
    steps too): run30's command through bert-launch with --resume auto, a rank SIGKILLed while the
    last checkpoint is written, then the newest whole checkpoint damaged; relaunched, it logs
    run30's metrics and exports run30's weights, bit for bit (fp32). The relaunch says in one line
    that it goes back to the newest intact checkpoint, and keeps the damaged one aside."""
    import sys
    sys.path.insert(0, str(REPO / "benchmarks"))
    from chaos import chaos
    args = [*COMMON, "--data", data, "--max-steps", 30, "--eval-every", 15, "--save-every", 10, "--keep-checkpoints", 2]
    # seed 6: the kill lands in the save of step 30; then step 20, the newest of the two whole
    # checkpoints, is damaged and the relaunch goes back to step 10 (two launches in all)
    result = chaos(tmp_path, args, 30, kills=1, save_kills=1, damages=1, seed=6, reference=run30, port=free_port())
    assert result["kills"] == 1 and result["kills_during_a_save"] == 1 and result["damaged_checkpoints"] == 1, result
    assert [launch["resumed_from"] for launch in result["launch_log"]] == [0, 10], result["launch_log"]
    assert result["identical_metrics"] and result["identical_weights"], result
    assert not result["steps_skipped"] and result["every_step_once_in_the_end"], result
    [damaged] = [f["checkpoint"] for f in result["faults"] if f["kind"] == "damage"]
    notes = [line for launch in result["launch_log"] for line in launch["notes"] if "is damaged" in line]
    assert len(notes) == 1 and f"{damaged} is damaged (" in notes[0], result["launch_log"]
    assert notes[0].endswith(", the newest intact one; the skipped checkpoints are kept as NAME.skipped"), notes
    assert (tmp_path / "chaos" / "checkpoints" / f"{damaged}.skipped").is_dir()
