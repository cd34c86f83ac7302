"""The README and docs/ as a reader meets them: a short README with the three commands, links that resolve, and
no reference to a document the reader does not have."""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").rglob("*.md"))
README_MAX_LINES = 160
# The README's commands: CI runs the test command (.ci/run), users copy the other two.
README_COMMANDS = ("bash scripts/setup.sh", "python src/train.py experiment=scienceworld",
                   'python -m pytest -m "not slow"')

# [text](target) and ![alt](target); a target has no spaces (an optional "title" after it is dropped)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (a link inside code is not a link)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, ``_``, ``-`` and spaces
    kept), spaces → ``-``; inline code and link markup count by their text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (repeated headings get ``-1``, ``-2``, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def broken_links(path: Path) -> list[str]:
    """The relative links of ``path`` whose file (or ``#anchor`` in it) does not exist."""
    bad = []
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...: not checked here
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target} (no {_shown(dest)})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {_shown(dest)})")
    return bad


def test_slug_follows_github():
    assert slug("Reproducing the paper") == "reproducing-the-paper"
    assert slug("GRPO vs EMPO²: `compare_runs.py`, the figures") == "grpo-vs-empo²-compare_runspy-the-figures"
    assert slug("Exact resume (2 + 2 = 4)") == "exact-resume-2--2--4"


def test_broken_links_are_found(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#a-heading) [gone](missing.md) [no anchor](there.md#nope)\n"
                    "`[in code](missing2.md)` [web](https://example.org/x) [self](#local)\n## Local\n")
    assert [b.split(" ")[0] for b in broken_links(page)] == ["missing.md", "there.md#nope"]


def test_readme_is_short_and_keeps_its_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md: {len(text.splitlines())} lines"
    for command in README_COMMANDS:
        assert command in text, f"README.md lost the command {command!r}"
    assert "pytest -m slow" in text + (ROOT / "docs" / "testing.md").read_text(), "how to run the slow tests"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []


# a page of docs/ named in code, a config or a test: docs/method.md, docs/method.md#memory, docs/results/README.md
DOC_REF = re.compile(r"\bdocs/[\w./-]*\.md(?:#[\w\-²]+)?")


def broken_doc_references() -> list[str]:
    """``file:line: reference`` for every ``docs/<page>.md[#anchor]`` in src/, studies/, scripts/, configs/ and
    tests/ whose page or heading does not exist."""
    bad = []
    for folder in ("src", "studies", "scripts", "configs", "tests"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".yaml", ".sh"):
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                for ref in DOC_REF.findall(line):
                    page, _, anchor = ref.partition("#")
                    if not (ROOT / page).is_file() or (anchor and anchor not in anchors(ROOT / page)):
                        bad.append(f"{path.relative_to(ROOT)}:{i}: {ref}")
    return bad


def test_docs_named_in_code_exist():
    assert broken_doc_references() == []


def test_no_reference_to_documents_readers_do_not_have():
    spec = "SPEC" + " §"  # spelled apart so this file does not match itself
    hits = []
    for folder in ("src", "studies", "scripts", "configs", "tests", "docs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".yaml", ".md", ".sh") and path != Path(__file__).resolve():
                text = path.read_text()
                hits += [f"{path.relative_to(ROOT)}:{i}" for i, line in enumerate(text.splitlines(), 1)
                         if spec in line or "../shared" in line]
    hits += [f"README.md:{i}" for i, line in enumerate(README.read_text().splitlines(), 1) if spec in line]
    assert hits == [], "references to a document readers do not have: " + ", ".join(hits)
