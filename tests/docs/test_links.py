"""Every relative link of README.md, SECURITY.md and docs/*.md leads to a file that exists, and every
`#anchor` in one to a heading of that file (anchors as GitHub makes them from the heading's text)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT, doc_files, fenced_blocks

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_EXTERNAL = ("http://", "https://", "mailto:")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced blocks."""
    inside: set[int] = set()
    for line, _, body in fenced_blocks(path):
        inside.update(range(line, line + body.count("\n") + 2))
    return [(number, text) for number, text in enumerate(path.read_text().splitlines(), start=1)
            if number not in inside]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for _, text in prose_lines(path):
        match = _HEADING.match(text)
        if match:
            anchor = github_anchor(match.group(1))
            found.add(anchor if anchor not in counts else f"{anchor}-{counts[anchor]}")
            counts[anchor] = counts.get(anchor, 0) + 1
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for number, text in prose_lines(path):
        for target in _LINK.findall(text):
            if target.startswith(_EXTERNAL):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}:{number}: {target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{path.relative_to(ROOT)}:{number}: {target}: no heading with that anchor")
    return broken


@pytest.mark.parametrize("path", doc_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path):
    assert broken_links(path) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.docs.test_links.ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Other\n\n## Serving on several ranks (TP, `DP`)\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#serving-on-several-ranks-tp-dp) [gone](missing.md) [bad](other.md#nope)\n"
                    "```bash\n[not a link](missing.md)\n```\n")
    assert broken_links(page) == ["page.md:1: missing.md: no such file",
                                  "page.md:1: other.md#nope: no heading with that anchor"]
