"""Every relative link in every markdown file of the repository resolves: the file (or folder) it
names is in the repository, and a ``#anchor`` names a heading of that page (GitHub's slugs).

Links inside fenced code blocks and inline code are text, not links, and are not checked; web
links (``http://``, ``https://``, ``mailto:``) are not fetched (no network in CI). Golden outputs
of tests (``*/tests/data/*.md``: a report as a test expects it, with links into a temporary folder)
are test data, not pages (``test_golden_data_is_the_only_exemption`` lists them)."""
from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Folders a checkout may hold that are not the repository's pages (run outputs, corpora, builds).
NOT_PAGES = {".git", "runs", "corpus", "build", "dist", ".venv", "node_modules", ".pytest_cache"}

INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
FENCE = re.compile(r"^\s{0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+\1")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def repo_files() -> set[str]:
    """The repository's files (tracked, and new ones git does not ignore), as posix paths from the root."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        return {line for line in out.splitlines() if (ROOT / line).exists()}
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file outside NOT_PAGES
        return {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
                if p.is_file() and not NOT_PAGES & set(p.relative_to(ROOT).parts)}


FILES = repo_files()
DIRS = {str(PurePosixPath(f).parents[i]) for f in FILES for i in range(len(PurePosixPath(f).parts) - 1)}
GOLDEN = sorted(f for f in FILES if f.endswith(".md") and "/tests/data/" in f"/{f}")
PAGES = sorted(f for f in FILES if f.endswith(".md") and f not in GOLDEN)


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    fenced = None
    for i, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            fenced = None if fenced == m.group(1) else (fenced or m.group(1))
            continue
        if fenced is None:
            yield i, CODE_SPAN.sub(lambda s: " " * len(s.group(0)), line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)  # emphasis underscores, not those inside a word
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def anchors(page: str) -> frozenset[str]:
    """Every anchor a page defines: heading slugs (a repeated one gets -1, -2, ...) and HTML anchors."""
    seen: dict[str, int] = {}
    out = set()
    text = (ROOT / page).read_text(encoding="utf-8")
    for _, line in prose_lines(text):
        out.update(HTML_ANCHOR.findall(line))
    fenced = None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m:
            fenced = None if fenced == m.group(1) else (fenced or m.group(1))
            continue
        h = HEADING.match(line) if fenced is None else None
        if h:
            s = slug(h.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return frozenset(out)


def links(page: str):
    """(line number, target) of every link and reference definition in a page's prose."""
    for i, line in prose_lines((ROOT / page).read_text(encoding="utf-8")):
        for m in INLINE_LINK.finditer(line):
            yield i, m.group(1)
        m = REFERENCE_DEF.match(line)
        if m:
            yield i, m.group(1)


def broken(page: str, target: str) -> str | None:
    """Why a link from ``page`` to ``target`` does not resolve, or None when it does (or is a web link)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
        return None
    path, _, anchor = target.partition("#")
    if path:
        resolved = PurePosixPath(page).parent / path
        parts: list[str] = []
        for part in resolved.parts:  # normalize a/../b without touching the disk
            if part == "..":
                if not parts:
                    return f"{path!r} leaves the repository"
                parts.pop()
            elif part != ".":
                parts.append(part)
        name = "/".join(parts).rstrip("/")
        if name not in FILES and name not in DIRS:
            return f"{path!r} is not a file or folder of the repository (resolved to {name!r})"
    else:
        name = page
    if anchor and name.endswith(".md") and anchor.lower() not in anchors(name):
        return f"#{anchor} is not a heading of {name}"
    return None


def test_pages_found():
    """The checker sees the pages it must check (a broken file listing would pass every link)."""
    for page in ("README.md", "docs/README.md", "docs/results/README.md", "launch/slurm/README.md"):
        assert page in PAGES, page


def test_golden_data_is_the_only_exemption():
    """The markdown files not checked are exactly the tests' golden outputs named here."""
    assert GOLDEN == ["experiments/tests/data/report_expected.md"]


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    bad = [f"{page}:{i}: [{t}] {why}" for i, t in links(page) if (why := broken(page, t))]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_checker_catches_what_it_claims(tmp_path):
    """The checker itself: a missing file, a missing anchor and a path out of the repository are
    reported; a code span, a fenced block, a web link and a good anchor are not."""
    assert broken("README.md", "docs/no_such_page.md")
    assert broken("README.md", "#no-such-heading-anywhere")
    assert broken("README.md", "../../outside.md")
    assert broken("docs/README.md", "../README.md") is None
    assert broken("README.md", "https://example.com/x") is None
    assert slug("Continue a Hugging Face Llama (`convert_hf.py`)") == "continue-a-hugging-face-llama-convert_hfpy"
    assert slug("What is `fp4_block`?") == "what-is-fp4_block"
    text = "see `[x](nope.md)` and\n```\n[y](nope.md)\n```\n[z](README.md)\n"
    assert [line for _, line in prose_lines(text) if "](" in line] == ["[z](README.md)"]
