"""Every relative link in README.md and docs/*.md points at a file of this repository, and a link to
a section of a markdown page at one of its headings, so moving text between pages cannot leave a
reader at a dead link. The README sends no reader outside the repository."""
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+).*?\1")
HEADING = re.compile(r"(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def outside_fences(path: Path):
    """(line number, line) of the lines outside fenced code blocks."""
    fence = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        marker = re.match(r"\s*(```|~~~)", line)
        if marker:
            fence = None if fence == marker.group(1) else fence or marker.group(1)
            continue
        if fence is None:
            yield number, line


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercased, all but letters, digits, spaces, hyphens and
    underscores dropped, spaces made hyphens."""
    kept = "".join(c for c in heading.strip().lower() if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    names = set()
    for _, line in outside_fences(path):
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            names.add(f"{base}-{count}" if count else base)
    return names


def links(path: Path):
    """(line number, target) of every markdown link and image outside code."""
    for number, line in outside_fences(path):
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            yield number, match.group(1)


def test_the_pages_are_found():
    names = {page.name for page in PAGES}
    assert {"README.md", "architecture.md", "benchmarks.md", "benchmarks-log.md"} <= names


def test_the_checker_reads_links_and_anchors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page — `kvcache bench node`\n\n## Once\n\n## Once\n\n"
                    "[a](other.md#x) ![b](img/c.png) `[not](a-link.md)`\n"
                    "```\n[nor](this.md)\n```\n", encoding="utf-8")
    assert [target for _, target in links(page)] == ["other.md#x", "img/c.png"]
    assert anchors(page) == {"a-page--kvcache-bench-node", "once", "once-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for number, target in links(page):
        if SCHEME.match(target) or target.startswith("//"):
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not destination.is_relative_to(ROOT):
            broken.append(f"{where} (outside the repository)")
        elif not destination.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_links_only_into_the_repository():
    outside = [f"README.md:{number}: {target}" for number, target in links(ROOT / "README.md")
               if SCHEME.match(target) or target.startswith("//")]
    assert not outside, "\n".join(outside)
