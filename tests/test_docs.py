"""The README and docs/ are run, not only read: every ```python block of a page runs (the page's blocks
in order, in one fresh interpreter, offline), and every relative link points at a file that exists
(and, with an anchor, at a heading of that file)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "CHANGELOG.md"]
# Pages whose links are checked too (no code to run: the benchmarks' own tests run them).
LINKED = [*PAGES, ROOT / "bench" / "README.md", ROOT / "bench" / "NOTES.md", ROOT / "bench" / "results" / "README.md"]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def python_blocks(text: str) -> str:
    return "\n".join(_BLOCK.findall(text))


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: the rendered text (links by their text), lower case, punctuation
    but '-' and '_' dropped, spaces to '-', repeats suffixed -1, -2, ..."""
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S), re.M):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        anchor = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target}: no heading with that anchor")
    return broken


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p.read_text())], ids=lambda p: p.name)
def test_a_pages_python_runs(page):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", python_blocks(page.read_text())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{page.relative_to(ROOT)}:\n{done.stderr[-4000:]}"


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_pages_links_resolve(page):
    assert not broken_links(page), broken_links(page)


def test_a_broken_link_and_a_missing_anchor_are_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# A title\n\n## `code` in a heading, twice\n\n## `code` in a heading, twice\n")
    page.write_text(
        "[ok](other.md#a-title) [ok](other.md#code-in-a-heading-twice-1) [gone](missing.md) "
        "[bad](other.md#no-such) [self](#nothing) [web](https://example.org)\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#no-such: no heading with that anchor",
        "#nothing: no heading with that anchor",
    ]


def test_the_readme_stays_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; depth goes to docs/"
