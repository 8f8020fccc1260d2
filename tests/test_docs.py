"""The README and docs/ hold together: every relative link leads to a file (and to a heading of
it when it names an anchor), the README stays short, and every docs page is reachable from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_LINES = 320

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def prose(text: str) -> str:
    """``text`` without fenced code blocks (a ``# comment`` there is no heading, ``[x](y)`` no link)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation and backticks dropped, each space a '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(prose(path.read_text())):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> list[tuple[str, str]]:
    """(text, target) of every relative markdown link of ``path``, outside code blocks and inline
    code (each code span is blanked out to its length first, so a link's own `code` text stays)."""
    text = INLINE_CODE.sub(lambda c: "x" * len(c.group()), prose(path.read_text()))
    return [(" ".join(m.group(1).split()), m.group(2)) for m in LINK.finditer(text)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", m.group(2))]      # not https:, mailto:, ...


def test_slug_is_githubs():
    assert slug("`installer apply`: the walkthrough") == "installer-apply-the-walkthrough"
    assert slug("The CoreDNS / systemd-resolved loop") == "the-coredns--systemd-resolved-loop"
    assert slug("The pod network (`cni: routes`)") == "the-pod-network-cni-routes"
    assert slug("Upgrade: `installer upgrade`") == "upgrade-installer-upgrade"
    assert slug("Nodes: add, drain, remove, revoke, list") == "nodes-add-drain-remove-revoke-list"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    problems = []
    for text, target in links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            problems.append(f"[{text}]({target}): no file {dest}")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"[{text}]({target}): {dest.relative_to(ROOT)} has no heading with anchor #{anchor}")
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in links(README) if t.partition("#")[0]}
    missing = [str(p.relative_to(ROOT)) for p in DOCS if p.resolve() not in linked]
    assert DOCS and not missing, f"docs pages the README does not link: {missing}"
