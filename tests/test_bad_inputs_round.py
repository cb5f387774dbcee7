"""A round of bad inputs on the surfaces added since the last one, as users produce them: each
ends in one line naming the problem and the fix, a non-zero exit, nothing of theirs destroyed.
In process: the commands' own main() or the function their main calls."""
import gzip
import json

import pytest
from conftest import REPO


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast
    out = tmp_path_factory.mktemp("tiny_bert")
    tokenizer = BertTokenizerFast(vocab=str(REPO / "data_prep" / "resources" / "bert_base_uncased_vocab.txt"),
                                  do_lower_case=True)
    BertForMaskedLM(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def one_error_line(capsys, prefix: str) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), lines
    return lines[0]


# ---- bert-finetune's numbers and files

@pytest.mark.parametrize("flags, words", [
    (["--epochs", "nan"], "--epochs nan: give a positive number"),
    (["--epochs", "inf"], "--epochs inf: give a positive number"),
    (["--lr", "nan"], "--lr and --lr-grid must be positive numbers"),
    (["--head-lr", "inf"], "--head-lr must be positive"),
    (["--json", "{tmp}"], "give a file's path in an existing directory"),
    (["--json", "{tmp}/no/such/dir/result.json"], "give a file's path in an existing directory"),
])
def test_finetune_refuses_numbers_and_paths_it_cannot_use(tmp_path, capsys, flags, words):
    from commodity_bert.finetune.cli import main
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    with pytest.raises(SystemExit) as done:
        main(["--model", str(tmp_path), "--task", "embedded:polarity", "--check-only", *flags])
    assert done.value.code == 2
    assert words in one_error_line(capsys, "bert-finetune: error: ")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_finetune_passes_its_stride_on_to_the_windows():
    from commodity_bert.finetune.cli import build_parser, hyperparameters
    args = build_parser().parse_args(["--task", "embedded:squad", "--stride", "12", "--precision", "fp32"])
    assert hyperparameters(args, "cpu", "qa").stride == 12


@pytest.mark.parametrize("damage, words", [
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                           "model_type": "gpt2"})), "a gpt2 model, not a BERT"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100]),
     "not a loadable BERT model"),
])
def test_a_model_directory_that_is_not_a_whole_bert_is_refused(tmp_path, tiny_bert, damage, words):
    """bert-finetune --model and train.py --init-from alike."""
    import shutil

    from commodity_bert.finetune.models import ModelError, load
    from commodity_bert.model.bert import ModelConfigError, load_pretrained
    from commodity_bert.train.launch_checks import LaunchError, init_source
    model = tmp_path / "model"
    shutil.copytree(tiny_bert, model)
    damage(model)
    with pytest.raises(ModelError, match=words):
        load(model)
    with pytest.raises((LaunchError, ModelConfigError), match=words):
        init_source(model)
        load_pretrained(model, nsp=False)


# ---- bert-data-prep

@pytest.mark.parametrize("argv, words", [
    (["shards", "--input", "x.txt", "--output", "o", "--seq-len", "0"], "argument --seq-len: must be at least 1, got 0"),
    (["shards", "--input", "x.txt", "--output", "o", "--num-shards", "0"], "argument --num-shards: must be at least 1"),
    (["shards", "--output", "o"], "the following arguments are required: --input"),
    ([], "the following arguments are required: command"),
])
def test_data_prep_usage_errors_are_one_line(capsys, argv, words):
    from data_prep.cli import main
    assert main(argv) == 2
    line = one_error_line(capsys, "bert-data-prep: error: ")
    assert words in line and line.endswith("--help)")


def test_data_prep_reads_a_compressed_file_by_its_last_suffix(tmp_path, sotu_text):
    """corpus.gz (no .txt in its name) is decompressed, not read as bytes (which stopped at a NUL
    byte with a wrong diagnosis, or went on to tokenize the compressed bytes)."""
    from data_prep.inputs import SkipCounter, iter_documents, resolve_inputs
    text = "\n\n".join(sotu_text.split("\n\n")[:3])
    with gzip.open(tmp_path / "corpus.gz", "wt") as fh:
        fh.write(text)
    documents = list(iter_documents(resolve_inputs([str(tmp_path / "corpus.gz")]), SkipCounter()))
    assert documents == [[line.strip() for line in d.splitlines() if line.strip()] for d in text.split("\n\n")]


# ---- the DeepSpeed config's project block and batch sizes

@pytest.mark.parametrize("change, words", [
    ({"commodity_bert": {"bucketwise_clipping": {"enabled": "yes"}}}, "enabled\" must be true or false"),
    ({"commodity_bert": {"bucketwise_clipping": {"enabled": True, "bucket_mb": "25"}}}, "bucket_mb\" '25': give a number above 0"),
    ({"commodity_bert": {"bucketwise_clipping": {"enabled": True, "bucket_mb": 0}}}, "bucket_mb\" 0: give a number above 0"),
    ({"commodity_bert": {"bucketwise_clipping": {"enabled": True, "max_norm": -1}}}, "max_norm\" -1: give a number above 0"),
    ({"train_micro_batch_size_per_gpu": True}, "train_micro_batch_size_per_gpu = True"),
])
def test_project_block_and_batch_values_of_the_wrong_kind_are_refused(change, words):
    from commodity_bert.train.launch_checks import LaunchError, check_deepspeed_config, check_project_block
    config = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 32, "optimizer": {"type": "Lamb", "params": {"lr": 1e-2}},
              **change}
    with pytest.raises(LaunchError, match=words.replace("(", r"\(")):
        check_project_block(config)
        check_deepspeed_config(config, 2)


# ---- hostfiles

@pytest.mark.parametrize("text, node_rank, words", [
    ("node1\n", 0, "line 1 ('node1'): give HOST slots=N"),
    ("node1 slots=abc\n", 0, "give HOST slots=N"),
    ("node1 slots=0\n", 0, "slots must be 1 or more"),
    ("node1 slots=1\nnode1 slots=2\n", 0, "node1 is listed twice"),
    ("# only a comment\n\n", 0, "names no host"),
    ("node1 slots=2\n", 5, "--node_rank 5: give 0 to 0"),
])
def test_a_hostfile_bert_launch_cannot_use_is_one_line_before_anything_starts(tmp_path, capsys, text, node_rank, words):
    from commodity_bert.launch.launcher import main
    (tmp_path / "hostfile").write_text(text)
    assert main(["--hostfile", str(tmp_path / "hostfile"), "--no_ssh", "--node_rank", str(node_rank),
                 "train.py"]) == 2
    assert words in one_error_line(capsys, "bert-launch: error: ")

