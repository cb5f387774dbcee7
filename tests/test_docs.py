"""The front door's links lead somewhere: every relative link in README.md, docs/, each folder's
README and benchmarks/*.md names a file that exists and, where it names an anchor, a heading (or
an explicit id) of that file."""
import re
from pathlib import Path

from conftest import REPO

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCED = re.compile(r"```.*?```", re.S)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors: each heading lower-cased, punctuation dropped, spaces as hyphens
    (repeats numbered), and explicit <a id> / <a name> targets."""
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCED.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    found.update(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", markdown))
    return found


def test_every_link_and_anchor_in_the_readme_and_docs_resolves():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("*/README.md")),
             *sorted((REPO / "benchmarks").glob("*.md"))]
    broken = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for target in LINK.findall(CODE.sub("", text)):
            if re.match(r"[a-z]+:", target):  # http(s):, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
