"""bert-data-prep shards on real text: schema, stratification, masking, inputs of every kind."""
import bz2
import gzip
import json
import math

import h5py
import numpy as np
import pytest
from conftest import first_documents, load_manifest, run_cli, shard_checksums, shared_corpus

from commodity_bert.data import shard_format as fmt

SIX_KEYS = set(fmt.NVIDIA_KEYS)


def assert_stratified(data_dir, split="train"):
    """Every shard: ±1 sample in size, each stratum within one sample of the dataset's share."""
    manifest = load_manifest(data_dir)
    summary = manifest["splits"][split]
    counts = np.array(summary["strata_counts"])
    shares = counts / counts.sum()
    num = len(summary["shards"])
    sizes = []
    for path in fmt.shard_paths(data_dir, manifest, split):
        with h5py.File(path, "r") as f:
            lengths = f["lengths"][:]
            assert np.array_equal(f["input_mask"][:].sum(1), lengths)
        strata = np.bincount(fmt.stratum_of(lengths, manifest["seq_len"], manifest["num_strata"]),
                             minlength=manifest["num_strata"])
        sizes.append(len(lengths))
        # each stratum ⌊n_s/K⌋ or ⌈n_s/K⌉ (exact), so within 1 of n_s/K; a shard's size is N/K ± 1,
        # so its size × the share is n_s/K ± share
        assert np.all((strata == counts // num) | (strata == -(-counts // num))), (path, strata, counts)
        assert np.all(np.abs(strata - len(lengths) * shares) <= 1 + shares + 1e-9), (path, strata, shares)
        key = fmt.stratum_of(lengths, manifest["seq_len"], manifest["num_strata"]) * 10_000 + lengths
        assert np.all(np.diff(key) >= 0), "not ordered by stratum, then length"
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == summary["samples"]


def make_dataset(tmp_path, inputs, *extra, name="ds"):
    out = tmp_path / name
    run_cli("shards", "--input", *inputs, "--output", out, "--workers", 2, *extra)
    return out


def verify(out):
    proc = run_cli("inspect", out, "--verify")
    assert "verify: OK" in proc.stdout
    return json.loads(run_cli("inspect", out, "--json").stdout)


@pytest.fixture(scope="module")
def static_nsp(tmp_path_factory, sotu_small):
    return make_dataset(tmp_path_factory.mktemp("static"), [sotu_small], "--num-shards", 6,
                        "--val-fraction", 0.05, "--dupe-factor", 2)


def test_static_nsp_shards_verify_and_have_nvidia_keys(static_nsp):
    report = verify(static_nsp)
    train = report["splits"]["train"]
    assert train["samples"] > 5000 and report["splits"]["validation"]["samples"] > 0
    for path in sorted(static_nsp.glob("shard_*.hdf5")):
        with h5py.File(path, "r") as f:
            assert SIX_KEYS <= set(f.keys())
            assert f["input_ids"].dtype == np.uint16 and f["input_ids"].shape[1] == 128
            assert f["masked_lm_positions"].shape[1] == math.ceil(0.15 * 128)
            labels = f["next_sentence_labels"][:]
            assert 0.3 < labels.mean() < 0.7  # ~half random next (more when a chunk has one sentence)
            seg = f["segment_ids"][:]
            assert seg.max() == 1 and (seg[:, 0] == 0).all()
    assert_stratified(static_nsp)
    assert_stratified(static_nsp, "validation")


def test_masking_statistics_on_real_text(static_nsp):
    train = verify(static_nsp)["splits"]["train"]
    assert abs(train["masked_fraction"] - 0.15) <= 0.01
    assert abs(train["masked_as_mask_token"] - 0.8) <= 0.02
    assert abs(train["masked_kept"] - 0.1) <= 0.02
    assert abs(train["masked_random"] - 0.1) <= 0.02


def test_validation_held_out_by_document(static_nsp, sotu_small):
    """No document feeds both splits: each held-out speech's opening words never occur in training."""
    manifest = load_manifest(static_nsp)
    assert manifest["splits"]["validation"]["documents"] >= 1
    train_docs = manifest["splits"]["train"]["documents"]
    total_docs = len([d for d in sotu_small.read_text().split("\n\n") if d.strip()])
    assert train_docs + manifest["splits"]["validation"]["documents"] == total_docs

    def rows(split):
        out = set()
        for path in fmt.shard_paths(static_nsp, manifest, split):
            arrays = fmt.read_shard(path)
            for ids, length in zip(arrays["input_ids"], arrays["lengths"]):
                out.add(tuple(ids[1:9]))  # first words after [CLS], masked or not
        return out
    # 8-token windows shared by chance between different speeches are rare; a shared
    # document would share almost all of them
    val, train = rows("validation"), rows("train")
    assert len(val & train) / len(val) < 0.05


def test_dynamic_whole_word_packing_on_wikipedia(tmp_path):
    wiki = shared_corpus("enwiki_gensim.txt")
    small = tmp_path / "wiki.txt.gz"
    with gzip.open(small, "wt") as fh:
        fh.write(first_documents(wiki.read_text(), 1_200_000))
    out = make_dataset(tmp_path, [small], "--masking", "dynamic", "--no-nsp", "--seq-len", 256,
                       "--num-shards", 5, "--val-fraction", 0.1)
    report = verify(out)
    with h5py.File(out / "shard_00000.hdf5", "r") as f:
        assert set(f.keys()) == (SIX_KEYS - set(fmt.MASKED_LM_KEYS)) | {"lengths"}
        assert f.attrs["masking"] == "dynamic"
        assert not f["segment_ids"][:].any() and not f["next_sentence_labels"][:].any()
        ids = f["input_ids"][:]
    vocab = (out / "vocab.txt").read_text().split("\n")
    assert vocab.index("[MASK]") not in ids  # unmasked
    # validation is masked once, statically, whatever the training masking
    assert report["splits"]["validation"]["masking"] == "static"
    assert abs(report["splits"]["validation"]["masked_fraction"] - 0.15) <= 0.015
    assert_stratified(out)


def test_whole_word_masking_keeps_words_together(tmp_path, sotu_small):
    out = make_dataset(tmp_path, [sotu_small], "--whole-word", "--dupe-factor", 1, "--num-shards", 2)
    report = verify(out)
    assert abs(report["splits"]["train"]["masked_fraction"] - 0.15) <= 0.01
    vocab = (out / "vocab.txt").read_text().split("\n")
    continuation = np.array([t.startswith("##") for t in vocab])
    arrays = fmt.read_shard(out / "shard_00000.hdf5")
    checked = 0
    specials = {vocab.index(t) for t in ("[CLS]", "[SEP]")}
    for ids, positions, originals in zip(arrays["input_ids"], arrays["masked_lm_positions"],
                                         arrays["masked_lm_ids"]):
        real = positions > 0
        masked = set(positions[real].tolist())
        for pos, orig in zip(positions[real], originals[real]):
            # a '##' piece is masked only with the piece before it (unless truncation cut the
            # word, leaving [CLS]/[SEP] before the piece)
            if continuation[orig] and ids[pos - 1] not in specials:
                assert pos - 1 in masked
                checked += 1
    assert checked > 100


@pytest.mark.parametrize("kind", ["jsonl_bz2", "directory", "hf_dataset", "parquet"])
def test_other_input_kinds(tmp_path, sotu_text, kind):
    docs = [d for d in first_documents(sotu_text, 400_000).split("\n\n") if d.strip()]
    if kind == "jsonl_bz2":
        inputs = [tmp_path / "docs.jsonl.bz2"]
        with bz2.open(inputs[0], "wt") as fh:
            fh.writelines(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))
    elif kind == "directory":
        (tmp_path / "dir" / "sub").mkdir(parents=True)
        (tmp_path / "dir" / "a.txt").write_text("\n\n".join(docs[: len(docs) // 2]))
        with gzip.open(tmp_path / "dir" / "sub" / "b.txt.gz", "wt") as fh:
            fh.write("\n\n".join(docs[len(docs) // 2:]))
        (tmp_path / "dir" / "notes.md").write_text("ignored: not a corpus file")
        inputs = [tmp_path / "dir"]
    else:
        import datasets
        dataset = datasets.Dataset.from_dict({"content": docs})
        if kind == "hf_dataset":
            datasets.DatasetDict({"train": dataset}).save_to_disk(str(tmp_path / "hf"))
            inputs = [tmp_path / "hf"]
        else:
            dataset.to_parquet(str(tmp_path / "docs.parquet"))
            inputs = [tmp_path / "docs.parquet"]
    extra = ["--text-field", "content"] if kind in ("hf_dataset", "parquet") else []
    out = make_dataset(tmp_path, inputs, "--num-shards", 3, "--dupe-factor", 1, "--val-fraction", 0,
                       *extra)
    manifest = load_manifest(out)
    assert manifest["splits"]["train"]["documents"] == len(docs)
    verify(out)
    assert_stratified(out)


def test_same_seed_same_shards_any_worker_count(tmp_path, sotu_small):
    args = ["--num-shards", 3, "--dupe-factor", 1, "--seq-len", 64]
    a = make_dataset(tmp_path, [sotu_small], *args, name="a")
    b = make_dataset(tmp_path, [sotu_small], *args, name="b")
    run_cli("shards", "--input", sotu_small, "--output", tmp_path / "c", "--workers", 1, *args)
    d = make_dataset(tmp_path, [sotu_small], *args, "--seed", 7, name="d")
    assert shard_checksums(a) == shard_checksums(b) == shard_checksums(tmp_path / "c")
    assert shard_checksums(a) != shard_checksums(d)
    manifest = load_manifest(a)
    assert [s["sha256"] for s in manifest["splits"]["train"]["shards"]] == \
        [shard_checksums(a)[f"shard_{i:05d}.hdf5"] for i in range(3)]


def test_rerun_of_finished_dataset_does_nothing(tmp_path, sotu_small):
    out = make_dataset(tmp_path, [sotu_small], "--num-shards", 2, "--dupe-factor", 1)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    proc = run_cli("shards", "--input", sotu_small, "--output", out, "--num-shards", 2, "--dupe-factor", 1)
    assert "nothing to do" in proc.stderr
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("*")}


def test_short_documents_spread_over_all_strata(tmp_path):
    """Movie-review sentences, one document each: many short samples, every stratum filled."""
    tsv = shared_corpus("rotten_tomatoes_sentences.tsv")
    jsonl = tmp_path / "reviews.jsonl"
    with open(jsonl, "w") as fh:
        for line in tsv.read_text(encoding="utf-8", errors="replace").splitlines()[1:]:
            parts = line.split("\t")
            if len(parts) == 3:
                fh.write(json.dumps({"text": parts[2]}) + "\n")
    out = make_dataset(tmp_path, [jsonl], "--no-nsp", "--seq-len", 64, "--num-shards", 7,
                       "--dupe-factor", 1, "--val-fraction", 0.05)
    report = verify(out)
    shares = report["splits"]["train"]["strata_shares"]
    assert min(shares) > 0.02, shares  # a real mix, unlike whole speeches
    assert_stratified(out)
    assert_stratified(out, "validation")


def test_hf_inputs_by_name_stream_the_same_shards_as_the_files(tmp_path, sotu_text, monkeypatch):
    """hf:json, hf:parquet and hf:text (load_dataset's builders, streamed) give the very shards the
    same text gives as a file; in process, offline."""
    import datasets

    from data_prep.cli import main
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    docs = [d for d in first_documents(sotu_text, 300_000).split("\n\n") if d.strip()]
    (tmp_path / "docs.txt").write_text("\n\n".join(docs) + "\n")
    with open(tmp_path / "docs.jsonl", "w") as fh:
        fh.writelines(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs))
    datasets.Dataset.from_dict({"text": docs}).to_parquet(str(tmp_path / "docs.parquet"))
    common = ["--workers", "1", "--num-shards", "2", "--dupe-factor", "1", "--val-fraction", "0.05"]
    made = {}
    for name, inputs in {"file": ["--input", tmp_path / "docs.jsonl"],
                         "json": ["--input", "hf:json", "--hf-data-files", tmp_path / "docs.jsonl"],
                         "parquet": ["--input", "hf:parquet", "--hf-data-files", tmp_path / "*.parquet"],
                         "text": ["--input", "hf:text", "--hf-data-files", tmp_path / "docs.txt"]}.items():
        assert main(["shards", *map(str, inputs), "--output", str(tmp_path / name), *common]) == 0
        made[name] = shard_checksums(tmp_path / name)
    assert len(made["file"]) == 3 and all(m == made["file"] for m in made.values()), made
    manifest = load_manifest(tmp_path / "parquet")
    assert manifest["args"]["inputs"] == ["hf:parquet"]
    assert manifest["sources"] == [{"path": str(tmp_path / "docs.parquet"), "dataset": "hf:parquet",
                                    "bytes": (tmp_path / "docs.parquet").stat().st_size,
                                    "sha256": fmt.sha256_file(tmp_path / "docs.parquet")}]
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["validation"]["documents"] == len(docs)


@pytest.mark.parametrize("args, words", [
    (["--input", "hf:json"], "reads local files: pass them with --hf-data-files"),
    (["--input", "hf:json", "--hf-data-files", "{tmp}/none*.jsonl"], "no such file"),
    (["--input", "{tmp}/a.jsonl", "--hf-data-files", "{tmp}/a.jsonl"], "is for an hf:NAME input"),
    (["--input", "hf:json", "--hf-data-files", "{tmp}/a.jsonl", "--text-field", "body"], "no column 'body'"),
    (["--input", "hf:json", "--hf-data-files", "{tmp}/a.jsonl", "--hf-split", "test"], "Bad split: test"),
    (["--input", "hf:parquet", "--hf-data-files", "{tmp}/a.jsonl"], "load_dataset failed"),
    (["--input", "hf:wikimedia/wikipedia:20231101.en"], "cannot reach the Hugging Face Hub"),
])
def test_bad_hf_inputs_get_one_line(tmp_path, capsys, monkeypatch, args, words):
    import datasets
    import huggingface_hub

    from data_prep.cli import main
    # as on a machine without a network, at once (the libraries read the variable when imported)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "One sentence. And another one."}) + "\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["shards", *args, "--output", str(tmp_path / "out"), "--workers", "1"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("bert-data-prep: error: ") and words in lines[0], lines
    assert not (tmp_path / "out").exists()
