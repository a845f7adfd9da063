"""README and docs figures come from committed artifacts: each figure, between its markers

    <!-- figure:NAME -->
    ...
    <!-- /figure:NAME -->

says exactly what scripts/readme_figures.py renders for NAME from the files it names. A figure lives
in README.md or on one docs page (HOMES); the renderers are the script's ``FIGURES``."""

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "readme_figures.py"

def _mod():
    spec = importlib.util.spec_from_file_location("readme_figures", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_every_figure_has_one_home():
    m = _mod()
    assert set(m.HOMES) == set(m.FIGURES), "a figure the script renders has no home here, or the reverse"
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for name, home in m.HOMES.items():
        found = [p.relative_to(REPO).as_posix() for p in pages if f"<!-- figure:{name} -->" in p.read_text()]
        assert found == [home], f"figure {name}: expected in {home} only, found in {found}"


@pytest.mark.parametrize("home", ["README.md", "docs/tutorial/read-a-report.md", "docs/engine/releases.md",
                                  "docs/engine/detection-matrix.md"])
def test_figures_say_what_the_artifacts_say(home):
    m = _mod()
    text = (REPO / home).read_text()
    assert home in m.HOMES.values()
    names = [n for n, h in m.HOMES.items() if h == home]
    assert m.render(text, names, home) == text, f"{home}: figures differ from the committed artifacts (render them again)"


def test_a_figure_edited_by_hand_is_caught():
    m = _mod()
    text = (REPO / "README.md").read_text()
    for name, home in m.HOMES.items():
        page = (REPO / home).read_text()
        start = page.index(f"<!-- figure:{name} -->")
        end = page.index(f"<!-- /figure:{name} -->")
        assert end - start > 40, f"figure {name} is empty"
    names = [n for n, h in m.HOMES.items() if h == "README.md"]
    witness = m.glm53_witness()
    edited = text.replace(witness, witness.replace('"status": 200', '"status": 201'))
    assert edited != text and m.render(edited, names) == text
