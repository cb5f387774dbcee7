"""Vocabulary training, NVIDIA interoperability of the shard format, instance and masking rules."""
import os
import random
from collections import Counter

import h5py
import numpy as np
import pytest
from conftest import REPO, SHARED_CORPORA, run_cli

from commodity_bert.data import shard_format as fmt
from commodity_bert.data.vocab import Vocab
from data_prep.instances import InstanceSpec, TokenPool, nsp_instances, packed_instances, token_rows
from data_prep.sentences import document_sentences


def test_vocab_trained_on_real_text_tokenizes_it(tmp_path, sotu_small):
    out = tmp_path / "vocab.txt"
    proc = run_cli("vocab", "--input", sotu_small, "--vocab-size", 3000, "--output", out)
    vocab = Vocab.load(out)
    assert 2500 <= len(vocab) <= 3000 and vocab.sha256 in proc.stdout
    assert vocab.tokens[:5] == ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
    assert "government" in vocab.tokens and "Government" not in vocab.tokens  # lower-cased
    encoded = vocab.tokenizer(lowercase=True).encode("The Congress shall assemble at least once.")
    assert vocab.id("[UNK]") not in encoded.ids
    cased = tmp_path / "cased.txt"
    run_cli("vocab", "--input", sotu_small, "--vocab-size", 3000, "--no-lowercase", "--output", cased)
    assert "Government" in Vocab.load(cased).tokens


def test_the_same_text_gives_the_same_vocabulary_with_any_thread_count(tmp_path, sotu_small):
    """Hugging Face's WordPiece trainer breaks ties by hash-map order: 5 of 8,192 tokens and their
    order differed between runs of the same command, with one Rayon thread too."""
    written = []
    for n, threads in enumerate((1, 1, 2, 2)):
        out = tmp_path / f"vocab{n}.txt"
        run_cli("vocab", "--input", sotu_small, "--vocab-size", 3000, "--output", out,
                env={**os.environ, "RAYON_NUM_THREADS": str(threads), "RAYON_RS_NUM_CPUS": str(threads)})
        written.append(out.read_bytes())
    assert len(set(written)) == 1 and len(written[0].splitlines()) == 3000
    assert (out.stat().st_mode & 0o777) == 0o666 & ~_umask()  # readable as any file the user writes


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_wordpiece_merges_the_most_frequent_pair_and_breaks_ties_by_id():
    from data_prep.wordpiece_trainer import train_wordpiece
    specials = ("[PAD]", "[UNK]")
    counts = Counter({"abc": 3, "ab": 2, "ac": 2, "xq": 1})
    vocab = train_wordpiece(counts, 100, specials, min_frequency=2)
    # the alphabet in code-point order, then the continuing pieces, then the merges by count:
    # a+##b (5), then ab+##c (3), then a+##c (2); x+##q occurs once, below min_frequency
    assert vocab == ["[PAD]", "[UNK]", "a", "b", "c", "q", "x", "##b", "##c", "##q", "ab", "abc", "ac"]
    # equal counts: the pair of older tokens first, as Hugging Face's trainer orders them when
    # its ids happen to be these
    tied = train_wordpiece(Counter({"ab": 2, "ba": 2}), 100, specials, min_frequency=2)
    assert tied[-2:] == ["ab", "ba"]
    # the vocabulary's size is a ceiling
    assert len(train_wordpiece(counts, 11, specials)) == 11


def test_the_vocabulary_is_the_one_hugging_face_trains(sotu_small):
    """Same algorithm, order fixed: the tokens are Hugging Face's (which itself varies by a few)."""
    from tokenizers import BertWordPieceTokenizer

    from commodity_bert.data.vocab import SPECIAL_TOKENS
    from data_prep.wordpiece_trainer import count_words, train_wordpiece
    lines = [line for line in sotu_small.read_text(encoding="utf-8").splitlines() if line.strip()]
    ours = train_wordpiece(count_words(lines, lowercase=True), 4000, SPECIAL_TOKENS)
    reference = BertWordPieceTokenizer(lowercase=True, strip_accents=True)
    reference.train_from_iterator(lines, vocab_size=4000, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  show_progress=False)
    theirs = set(reference.get_vocab())
    assert len(ours) == len(theirs) == 4000
    assert len(theirs - set(ours)) <= 10, sorted(theirs - set(ours))


def test_shards_use_a_trained_vocab(tmp_path, sotu_small):
    vocab = tmp_path / "vocab.txt"
    run_cli("vocab", "--input", sotu_small, "--vocab-size", 2000, "--output", vocab)
    out = tmp_path / "ds"
    run_cli("shards", "--input", sotu_small, "--vocab", vocab, "--output", out, "--num-shards", 2,
            "--dupe-factor", 1, "--workers", 1)
    assert (out / "vocab.txt").read_bytes() == vocab.read_bytes()
    arrays = fmt.read_shard(out / "shard_00000.hdf5")
    assert arrays["input_ids"].max() < 2000


def _nvidia_style_shard(path, arrays):
    """A shard written the way NVIDIA's create_pretraining_data.py writes one: int32/int8,
    gzip, six keys, no lengths, no attributes."""
    with h5py.File(path, "w") as f:
        for key, dtype in [("input_ids", "i4"), ("input_mask", "i1"), ("segment_ids", "i1"),
                           ("masked_lm_positions", "i4"), ("masked_lm_ids", "i4"),
                           ("next_sentence_labels", "i1")]:
            f.create_dataset(key, data=arrays[key], dtype=dtype, compression="gzip")


def test_nvidia_shards_read_here_and_ours_read_as_nvidia_does(tmp_path, sotu_small):
    out = tmp_path / "ds"
    run_cli("shards", "--input", sotu_small, "--output", out, "--num-shards", 2, "--dupe-factor", 1,
            "--workers", 1)
    ours = fmt.read_shard(out / "shard_00000.hdf5")
    # NVIDIA's pretraining_dataset: np.asarray(f[key][:]) for the six keys, then int64 tensors
    with h5py.File(out / "shard_00000.hdf5", "r") as f:
        theirs_view = [np.asarray(f[k][:]).astype(np.int64) for k in fmt.NVIDIA_KEYS]
    index = 7
    ids, mask, _segments, pos, mlm_ids, _nsp = (a[index] for a in theirs_view)
    assert mask.sum() == ours["lengths"][index] and ids[0] == 101  # [CLS] in the BERT-base vocab
    # NVIDIA rebuilds labels as: labels[pos[:k]] = mlm_ids[:k], k = first zero position
    k = (pos != 0).sum()
    assert k > 0 and (pos[k:] == 0).all() and (mlm_ids[:k] > 0).all()
    _nvidia_style_shard(tmp_path / "nvidia.hdf5", {k: ours[k] for k in fmt.NVIDIA_KEYS})
    back = fmt.read_shard(tmp_path / "nvidia.hdf5")
    assert np.array_equal(back["lengths"], ours["lengths"])
    assert fmt.check_shard_arrays(back, where="nvidia", seq_len=128, static_masking=True,
                                  vocab_size=30522) == []


def test_sentence_splitter_splits_a_whole_speech(sotu_small):
    speech = sotu_small.read_text().split("\n\n")[0]
    sentences = document_sentences([speech])
    assert len(sentences) > 30 and max(map(len, sentences)) < len(speech) / 5
    assert all(s.rstrip()[-1] in ".?!:;\"')" for s in sentences)


def test_sentence_splitting_with_a_reused_buffer_is_bling_fires(sotu_small):
    """data_prep.sentences calls Bling Fire's C function into one buffer it reuses and grows;
    the result must be blingfire.text_to_sentences' for every line."""
    import blingfire

    from data_prep.sentences import _text_to_sentences

    lines = [line for line in sotu_small.read_text()[:300_000].splitlines() if line.strip()]
    wiki = SHARED_CORPORA / "enwiki_gensim.txt"
    if wiki.is_file():
        lines += wiki.read_text()[:300_000].splitlines()
    lines += ["", " ", "One. Two!", "naïve Café — “quoted”. Ελληνικά. 中文。", "x" * 200_000 + ". Then one more."]
    lines += sorted(lines, key=len)[:50]  # short ones after the buffer grew: no stale bytes
    assert [_text_to_sentences(line) for line in lines] == [blingfire.text_to_sentences(line) for line in lines]


def _tokenized_speech(sotu_small, n):
    vocab = Vocab.load("data_prep/resources/bert_base_uncased_vocab.txt")
    tok = vocab.tokenizer(lowercase=True)
    speeches = [d for d in sotu_small.read_text().split("\n\n") if d.strip()][:n]
    return vocab, [[np.array(e.ids) for e in tok.encode_batch(document_sentences([s]),
                                                               add_special_tokens=False)]
                   for s in speeches]


def test_instances_fit_and_keep_the_text(sotu_small):
    vocab, docs = _tokenized_speech(sotu_small, 3)
    spec = InstanceSpec(128, 0.1, vocab.id("[CLS]"), vocab.id("[SEP]"))
    rng = random.Random(0)
    pool, rows = TokenPool.of(docs), []
    nsp_instances(pool, 0, spec, rng, rows)
    tokens, lengths, segment_a, random_next = token_rows(pool, rows, spec, nsp=True)
    assert np.all(lengths <= 128) and np.all(tokens[:, 0] == spec.cls_id)
    assert np.all(tokens[np.arange(len(rows)), lengths - 1] == spec.sep_id)
    assert np.all(tokens[np.arange(len(rows)), segment_a - 1] == spec.sep_id)
    assert np.all(tokens[np.arange(128)[None, :] >= lengths[:, None]] == 0)  # padding
    assert 0.3 < 1 - random_next.mean() < 0.7  # continuations
    # a continuation's A and B are runs of document 0's text, B after A
    text = pool.tokens[pool.bounds[0][0]:pool.bounds[0][-1]].tolist()

    def found(run, after=0):
        return next(k for k in range(after, len(text) - len(run) + 1) if text[k:k + len(run)] == run)
    for row in np.flatnonzero(random_next == 0)[:20]:
        a = tokens[row, 1:segment_a[row] - 1].tolist()
        found(tokens[row, segment_a[row]:lengths[row] - 1].tolist(), after=found(a) + len(a))
    spec_packed = InstanceSpec(128, 0.0, spec.cls_id, spec.sep_id)
    rows = []
    packed_instances(pool, 0, spec_packed, rng, rows)
    tokens, lengths, segment_a, random_next = token_rows(pool, rows, spec_packed, nsp=False)
    # packing without NSP keeps every token of the document, in order
    body = np.concatenate([tokens[r, 1:lengths[r] - 1] for r in range(len(rows))])
    assert np.array_equal(body, np.concatenate(docs[0]))
    assert np.array_equal(segment_a, lengths) and not random_next.any()
    assert lengths.mean() > 100


def test_truncate_pair_trims_the_longer_segment_first():
    from data_prep.instances import _truncate_pair
    rng = random.Random(0)
    a_start, a_len, b_start, b_len = _truncate_pair(0, 10, 100, 300, 125, rng)
    assert a_len == 10 and b_len == 115 and 100 <= b_start <= 100 + 300 - 115  # a contiguous run of b
    assert _truncate_pair(0, 90, 100, 91, 125, rng)[1::2] == (63, 62)  # b loses 1 to equal a, then b, a, ...
    assert _truncate_pair(0, 5, 100, 6, 125, rng) == (0, 5, 100, 6)
    # the tokens cut from the front are Binomial(cut, 1/2), as BERT's coin per token
    fronts = [_truncate_pair(0, 10, 1000, 215, 125, rng)[2] - 1000 for _ in range(4000)]
    assert abs(np.mean(fronts) - 50) < 0.5 and abs(np.var(fronts) - 25) < 3


@pytest.mark.parametrize("lowercase", [True, False])
def test_the_cached_tokenizer_gives_hf_tokenizers_ids(sotu_small, lowercase, monkeypatch):
    """Its own ASCII word split and its cache against `tokenizers`' BertWordPieceTokenizer, on
    real text (State of the Union; Wikipedia where the shared corpora are present, with its
    accents and Unicode punctuation) and on the edge cases of BERT's basic tokenizer."""
    from data_prep import fast_tokenizer
    from data_prep.fast_tokenizer import CachedWordPiece

    texts = [sotu_small.read_text()[:400_000]]
    wiki = SHARED_CORPORA / "enwiki_gensim.txt"
    if wiki.is_file():
        texts.append(wiki.read_text()[:400_000])
    sentences = [s for text in texts for s in document_sentences([l for l in text.splitlines() if l.strip()])]
    sentences += ["a\x0bb c\x7fd", "naïve Café", "snake_case ~x^y `q` {r}|s\\t", "x" * 150, "Ünïcode — “q”",
                  "", "   ", "tab\there\r\nnew", "a©b", "中文 text", "ﬁne ligature", "1,000.50$",
                  "Zürich’s résumé", "¿Qué?", "naïve—“quoted”…", "Ångström 10⁻³ µm", "Ελληνικά and 한국어"]
    vocab = Vocab.load(REPO / "data_prep" / "resources" / "bert_base_uncased_vocab.txt")
    hf = vocab.tokenizer(lowercase)
    expected = [e.ids for e in hf.encode_batch(sentences, add_special_tokens=False)]
    fast = CachedWordPiece(hf._tokenizer, lowercase)
    for cache_words in (1 << 20, 1 << 20, 1000):  # from the cache the second time; cleared the third
        monkeypatch.setattr(fast_tokenizer, "CACHE_WORDS", cache_words)
        got = fast.encode(sentences)
        mismatches = [(s, e, g.tolist()) for s, e, g in zip(sentences, expected, got) if list(g) != e]
        assert not mismatches, mismatches[:3]
        if cache_words > 1000:
            assert len(fast.words) > 1000
    assert sum(not s.isascii() for s in sentences) >= 10
