"""The documentation: a short README that reaches every docs page, an mkdocs nav that lists every page,
relative links that resolve, and no citation of files a user of the repository does not have. The
strict site build (``make docs``, part of ``make test``) checks the links inside docs/ and their
anchors; this file checks README's."""

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _nav_pages() -> list[str]:
    def walk(items):
        for it in items:
            for v in (it.values() if isinstance(it, dict) else [it]):
                if isinstance(v, list):
                    yield from walk(v)
                else:
                    yield v
    return list(walk(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]))


def _pages() -> list[str]:
    return sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))


def _links(text: str) -> list[str]:
    return LINK.findall(FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = re.sub(r"[`*_]", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines (at most 250): move detail into docs/"


def test_every_docs_page_is_in_the_nav():
    nav, pages = set(_nav_pages()), set(_pages())
    assert pages - nav == set(), f"docs pages missing from mkdocs.yml nav: {sorted(pages - nav)}"
    assert nav - pages == set(), f"mkdocs.yml nav names pages that do not exist: {sorted(nav - pages)}"


def test_readme_links_every_docs_page():
    linked = {Path(u.split("#")[0]).as_posix() for u in _links(README.read_text()) if u.startswith("docs/")}
    missing = [p for p in _pages() if f"docs/{p}" not in linked]
    assert not missing, f"README.md does not link these docs pages: {missing}"


def test_readme_relative_links_resolve():
    text = README.read_text()
    bad = []
    for url in _links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", url) or url.startswith("//"):
            continue  # external
        path, _, anchor = url.partition("#")
        target = (REPO / path) if path else README
        if not target.exists():
            bad.append(f"{url}: no such file")
            continue
        if anchor and target.suffix == ".md":
            heads = [_slug(m) for m in re.findall(r"^#+\s+(.*)$", FENCE.sub("", target.read_text()), re.M)]
            if anchor not in heads:
                bad.append(f"{url}: no heading with anchor #{anchor}")
    assert not bad, "README.md links that do not resolve:\n" + "\n".join(bad)


def test_no_page_cites_files_users_do_not_have():
    for p in [README, *DOCS.rglob("*.md")]:
        assert "shared/notes" not in p.read_text(), f"{p.relative_to(REPO)} cites shared/notes (not in the repository)"


def test_readme_suite_example_is_real_code():
    """README's suite example is an excerpt of the suite it names, line for line."""
    text = README.read_text()
    m = re.search(r"From `(suites/[\w/]+\.py)`:\n\n```python\n(.*?)\n```", text, re.S)
    assert m, "README.md has no suite example introduced by 'From `suites/....py`:'"
    src = (REPO / m.group(1)).read_text()
    assert m.group(2) in src, f"README's suite example is not an excerpt of {m.group(1)}"
