"""The CI workflow files (.github/workflows/): they lint clean with the linter ``make test`` runs
(scripts/lint_workflows.py: YAML, check-jsonschema's vendored GitHub workflow schema, expressions,
``bash -n``), a broken copy fails that lint naming the file, the CPU CI runs what .ci/run runs and
nothing that contradicts it, and the nightly GPU job audits before the suites, with real kvchaos
commands and flags, and uploads its reports whatever failed."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
WF = REPO / ".github" / "workflows"
CI = WF / "ci.yml"
NIGHTLY = WF / "nightly-gpu.yml"
LINT = REPO / "scripts" / "lint_workflows.py"


def _lint(*paths) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LINT), *map(str, paths)], capture_output=True, text=True,
                          cwd=REPO, timeout=60)


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _on(wf: dict) -> dict:
    """The triggers as a map (PyYAML reads the key `on` as True; a string or a list is normalized)."""
    on = wf["on"] if "on" in wf else wf[True]
    if isinstance(on, str):
        return {on: None}
    if isinstance(on, list):
        return dict.fromkeys(on)
    return on


def _steps(wf: dict) -> list[dict]:
    return [s for job in wf["jobs"].values() for s in job.get("steps", [])]


def _upload_steps(wf: dict) -> list[dict]:
    return [s for s in _steps(wf) if str(s.get("uses", "")).startswith("actions/upload-artifact@")]


def _paths(step: dict) -> list[str]:
    return [p.strip() for p in str(step.get("with", {}).get("path", "")).splitlines() if p.strip()]


# --- (a) the real workflows lint clean ---------------------------------------------------------------

def test_both_workflows_exist_and_lint_clean():
    assert CI.is_file() and NIGHTLY.is_file()
    r = _lint()
    assert r.returncode == 0, f"lint of .github/workflows/ failed:\n{r.stdout}{r.stderr}"
    assert "ci.yml" in r.stdout and "nightly-gpu.yml" in r.stdout


def test_make_test_runs_the_lint_as_its_own_step():
    """The `test` target runs the lint under the `|| rc=1` pattern of its other steps (it always runs and
    a broken workflow fails the target), and `make lint-workflows` runs it alone."""
    mk = (REPO / "Makefile").read_text()
    recipe = re.search(r"^test: setup\n((?:\t.*\n)+)", mk, re.M)
    assert recipe, "Makefile has no 'test: setup' target"
    assert "$(PY) scripts/lint_workflows.py || rc=1; \\" in recipe.group(1)
    assert "exit $$rc" in recipe.group(1)
    alone = re.search(r"^lint-workflows: setup\n((?:\t.*\n)+)", mk, re.M)
    assert alone and "$(PY) scripts/lint_workflows.py" in alone.group(1)


# --- (b) a broken copy fails, naming the file --------------------------------------------------------

def _drop_runs_on(t: str) -> str:
    return re.sub(r"^    runs-on: .*\n", "", t, count=1, flags=re.M)


BROKEN = {
    # kind: (how the copy of ci.yml is broken, what the lint must say about it)
    "runs-on-missing": (_drop_runs_on, "'runs-on' is a required property"),
    "step-not-steps": (lambda t: t.replace("\n    steps:\n", "\n    step:\n", 1), "'step' was unexpected"),
    "unknown-event": (lambda t: t.replace("\n  pull_request:\n", "\n  pull_requests:\n", 1),
                      "'pull_requests' was unexpected"),
    "timeout-not-a-number": (lambda t: re.sub(r"timeout-minutes: \d+", "timeout-minutes: ninety", t, count=1),
                             "'ninety' is not of type 'number'"),
    "duplicate-key": (lambda t: re.sub(r"^(    timeout-minutes: .*\n)", r"\1\1", t, count=1, flags=re.M),
                      "duplicate key"),
    "not-yaml": (lambda t: t.replace("\non:\n", "\non: [push\n", 1), "YAML:"),
    "unclosed-expression": (lambda t: t.replace("${{ github.ref }}", "${{ github.ref }", 1), "is not closed"),
    "shell-syntax": (lambda t: t.replace("run: bash .ci/run", "run: |\n          if bash .ci/run; then\n"
                                         "            echo ok\n", 1), "bash -n"),
}


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """One lint run over a broken copy of ci.yml per kind, beside an intact copy (one run: ~1 s each)."""
    d = tmp_path_factory.mktemp("workflows")
    good = CI.read_text()
    for kind, (breaks, _) in BROKEN.items():
        text = breaks(good)
        assert text != good, f"{kind}: the breakage did not apply to ci.yml (update this test)"
        (d / f"{kind}.yml").write_text(text)
    (d / "fine.yml").write_text(good)
    return d, _lint(d)


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_broken_workflow_fails_the_lint_naming_the_file(broken, kind):
    d, r = broken
    said = BROKEN[kind][1]
    assert r.returncode == 1, f"lint exited {r.returncode}:\n{r.stdout}{r.stderr}"
    bad = d / f"{kind}.yml"
    mine = [ln for ln in r.stdout.splitlines() if ln.startswith(f"{bad}: ")]
    assert any(said in ln for ln in mine), f"{kind}: no line '{bad}: ...{said}...' in:\n{r.stdout}"


def test_the_intact_copy_is_not_blamed(broken):
    d, r = broken
    assert f"{len(BROKEN)} of {len(BROKEN) + 1} file(s)" in r.stderr, r.stderr
    assert "fine.yml" not in r.stdout, r.stdout


def test_one_broken_file_alone_fails_the_lint(tmp_path):
    bad = tmp_path / "ci.yml"
    bad.write_text(_drop_runs_on(CI.read_text()))
    r = _lint(bad)
    assert r.returncode == 1 and r.stdout.startswith(f"{bad}: "), r.stdout + r.stderr


def test_no_workflow_file_is_an_error(tmp_path):
    r = _lint(tmp_path)
    assert r.returncode == 2 and "no workflow files" in r.stderr


# --- (c) the CPU CI runs what .ci/run runs -----------------------------------------------------------

# variables the Makefile reads from the environment (`?=`): set in the workflow, they would change what
# `make test` runs
MAKE_VARS = set(re.findall(r"^(\w+) \?=", (REPO / "Makefile").read_text(), re.M)) | {"KVCHAOS_VENV"}


def test_ci_runs_exactly_what_ci_run_runs():
    assert "\nmake test\n" in (REPO / ".ci" / "run").read_text(), ".ci/run no longer runs make test"
    wf = _load(CI)
    on = _on(wf)
    assert "push" in on and "pull_request" in on
    assert len(wf["jobs"]) == 1, "the CPU CI is one job: bash .ci/run"
    job = next(iter(wf["jobs"].values()))
    assert job["timeout-minutes"] <= 90
    runner = job["runs-on"]
    image = (job.get("container") or {}).get("image", "") if isinstance(job.get("container"), dict) \
        else job.get("container") or ""
    assert str(runner).startswith("ubuntu-") or image.startswith("debian:"), runner
    # Python 3.11: Debian 12's python3, or setup-python 3.11
    py = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/setup-python@")]
    assert image == "debian:12" or (py and str(py[0]["with"]["python-version"]) == "3.11")

    runs = [s for s in job["steps"] if "run" in s]
    command = re.compile(r"\.ci/run|pytest|mkdocs|lint_workflows|(?:^|[;&|(])\s*(?:\w+=\S*\s+)*make\b", re.M)
    tests = [s for s in runs if command.search(s["run"])]
    assert [s["run"].strip() for s in tests] == ["bash .ci/run"], \
        f"the CI runs the tests only through 'bash .ci/run': {[s['run'] for s in tests]}"
    main = tests[0]
    assert "if" not in main and "shell" not in main and "working-directory" not in main
    assert "continue-on-error" not in CI.read_text(), "a red make test must make the CI red"
    for where, env in [("workflow", wf.get("env")), ("job", job.get("env")), ("step", main.get("env"))]:
        clash = MAKE_VARS & set(env or {})
        assert not clash, f"ci.yml's {where} env sets {sorted(clash)}: make test would run something else"


def test_ci_uploads_reports_always():
    ups = _upload_steps(_load(CI))
    assert ups and all("always()" in str(s.get("if", "")) for s in ups)
    assert any(p.rstrip("/") == "reports" for s in ups for p in _paths(s))


# --- (d) the nightly GPU job ---------------------------------------------------------------------------

def _arrays(script: str) -> dict[str, str]:
    """Bash array assignments `name=(...)` of a script, their words with $VARS made placeholders."""
    return {m.group(1): re.sub(r'"\$\w+"', "X", m.group(2)) for m in re.finditer(r"(\w+)=\(([^)]*)\)", script)}


def _kvchaos_calls(script: str) -> list[list[str]]:
    """The argument lists of `... -m kvchaos CMD ...` in a shell script, up to the first redirection,
    pipe or list operator; command substitutions become a placeholder, `"${arr[@]}"` its assignment."""
    script = script.replace("\\\n", " ")
    arrays = _arrays(script)
    calls = []
    for m in re.finditer(r"-m kvchaos\b([^\n]*)", script):
        rest = re.sub(r'"\$\([^)]*\)"', "X", m.group(1))
        rest = re.sub(r'"\$\{(\w+)\[@\]\}"', lambda a: arrays.get(a.group(1), ""), rest)
        rest = re.split(r"\s(?:\d?>|\|\||\||&&|&|;)", rest)[0]
        calls.append(shlex.split(rest))
    return calls


def test_nightly_is_scheduled_on_a_self_hosted_gpu_runner():
    wf = _load(NIGHTLY)
    on = _on(wf)
    assert "schedule" in on and on["schedule"][0]["cron"].split()[2:] == ["*", "*", "*"], "not nightly"
    assert "workflow_dispatch" in on
    for job in wf["jobs"].values():
        labels = job["runs-on"] if isinstance(job["runs-on"], list) else [job["runs-on"]]
        assert "self-hosted" in labels and "gpu" in labels


def test_nightly_audits_first_then_runs_the_suites_on_the_gpu_profile():
    steps = [s for s in _steps(_load(NIGHTLY)) if "run" in s]
    calls = [(i, c) for i, s in enumerate(steps) for c in _kvchaos_calls(s["run"])]
    first = {}
    for i, c in calls:
        first.setdefault(c[0], i)
    assert {"up", "audit", "run"} <= set(first), f"kvchaos commands in nightly-gpu.yml: {sorted(first)}"
    assert first["up"] <= first["audit"] < first["run"], "the audit runs before the suites"
    for i, c in calls:
        if c[0] in ("up", "run"):
            assert c[c.index("--profile") + 1] == "gpu", f"not the GPU profile: kvchaos {' '.join(c)}"
    audit = next(c for _, c in calls if c[0] == "audit")
    assert "--prefill" in audit and "--decode" in audit


def test_nightly_uses_only_real_kvchaos_commands_and_flags():
    from kvchaos.cli import build_parser

    parser = build_parser({})
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    calls = [c for s in _steps(_load(NIGHTLY)) if "run" in s for c in _kvchaos_calls(s["run"])]
    assert calls
    for c in calls:
        assert c[0] in sub, f"nightly-gpu.yml runs 'kvchaos {c[0]}': no such command"
        # spelled out: argparse would also take an abbreviation (--prefil for --prefill)
        flags = [t.split("=", 1)[0] for t in c[1:] if t.startswith("-")]
        unknown = [f for f in flags if f not in sub[c[0]]._option_string_actions]
        assert not unknown, f"nightly-gpu.yml: 'kvchaos {' '.join(c)}': kvchaos {c[0]} has no {unknown}"
        try:
            parser.parse_args(c)
        except SystemExit as e:
            pytest.fail(f"nightly-gpu.yml runs 'kvchaos {' '.join(c)}', which kvchaos refuses (exit {e.code})")


def test_nightly_uploads_reports_and_the_audit_always():
    ups = _upload_steps(_load(NIGHTLY))
    assert ups and all("always()" in str(s.get("if", "")) for s in ups)
    paths = {p.rstrip("/") for s in ups for p in _paths(s)}
    assert {"reports", "audit.json"} <= paths, paths


def test_docs_point_at_the_workflow_files_instead_of_a_snippet():
    readme = (REPO / "README.md").read_text()
    gpu = (REPO / "docs" / "operations" / "gpu.md").read_text()
    for name in ("ci.yml", "nightly-gpu.yml"):
        assert f".github/workflows/{name}" in readme, f"README.md does not point at .github/workflows/{name}"
    assert ".github/workflows/nightly-gpu.yml" in gpu
    for doc, text in [("README.md", readme), ("docs/operations/gpu.md", gpu)]:
        assert not re.search(r"^```ya?ml\n(?:(?!```).)*runs-on:", text, re.M | re.S), \
            f"{doc} still carries a workflow snippet: link .github/workflows/ instead"
