"""The project's pages: a README a newcomer reads in five minutes, links that resolve, and
results rather than a work diary in README.md, docs/ and bench/."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_README_LINES = 200
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
DIARY = re.compile(r"\b(sessions?|yesterday|today)\b", re.I)


def pages() -> list[Path]:
    """The project's own pages (not those of what bench/peers installs under bench/.peers)."""
    bench = [p for p in (ROOT / "bench").rglob("*.md") if ".peers" not in p.parts]
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(bench)]


def test_the_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: move detail into docs/"


def test_every_relative_link_resolves():
    broken = []
    for page in pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor of the page itself
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in readme]
    assert not unlinked, unlinked


def test_pages_hold_results_not_a_diary():
    found = [
        f"{page.relative_to(ROOT)}:{n}: {line.strip()}"
        for page in pages()
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if DIARY.search(line)
    ]
    assert not found, "\n".join(found)
