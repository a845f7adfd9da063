"""README figures and examples come from committed artifacts: what scripts/readme_figures.py renders
from them is what README.md says."""

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "readme_figures.py"


def _mod():
    spec = importlib.util.spec_from_file_location("readme_figures", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_readme_says_what_the_artifacts_say():
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, f"README.md figures differ from the committed artifacts:\n{r.stdout[-3000:]}{r.stderr}"


def test_a_figure_edited_by_hand_is_caught():
    m = _mod()
    text = (REPO / "README.md").read_text()
    for name in m.FIGURES:
        start = text.index(f"<!-- figure:{name} -->")
        end = text.index(f"<!-- /figure:{name} -->")
        assert end - start > 40, f"figure {name} is empty"
    witness = m.glm53_witness()
    edited = text.replace(witness, witness.replace('"status": 200', '"status": 201'))
    assert edited != text and m.render(edited) == text
