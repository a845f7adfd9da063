"""Lint the GitHub Actions workflows (``make lint-workflows``; a step of ``make test``).

    python scripts/lint_workflows.py                 # every file of .github/workflows/
    python scripts/lint_workflows.py FILE_OR_DIR...  # these

Per file, offline (no download at run time):
  1. YAML: it parses, with no key given twice in one mapping (ruamel.yaml, as check-jsonschema reads it);
  2. schema: check-jsonschema against its vendored GitHub workflow schema (``--builtin-schema
     vendor.github-workflows``): unknown keys (``step:``), a missing ``runs-on``, an unknown ``on:`` event,
     values of the wrong type;
  3. expressions: every ``${{`` is closed by ``}}``;
  4. shell: each ``run:`` script whose shell is bash (the default on Linux runners) passes ``bash -n``,
     with each ``${{ ... }}`` replaced by a word.
Prints one line per problem, ``FILE: WHERE: PROBLEM``. Exit 0 clean, 1 a problem, 2 no workflow file or
check-jsonschema not installed (env/requirements-harness.txt; ``make setup``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKFLOWS = REPO / ".github" / "workflows"
SCHEMA = "vendor.github-workflows"
EXPR = re.compile(r"\$\{\{.*?\}\}", re.S)
GENERIC = re.compile(r"is not of type|is not valid under any|is not one of")
MAX = 300  # characters of one schema message (some quote the whole job)


def _files(args: list[str]) -> list[Path]:
    out: list[Path] = []
    for a in args or [str(WORKFLOWS)]:
        p = Path(a)
        if p.is_dir():
            out += sorted(q for q in p.iterdir() if q.suffix in (".yml", ".yaml") and q.is_file())
        else:
            out.append(p)
    return out


def _short(s: str) -> str:
    s = " ".join(s.split())
    return s if len(s) <= MAX else s[: MAX - 3] + "..."


def _parse(path: Path):
    """(document, problems): ruamel's safe loader refuses duplicate keys, as check-jsonschema's does."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError

    try:
        return YAML(typ="safe", pure=True).load(path.read_text()), []
    except (YAMLError, ValueError) as e:
        return None, [f"YAML: {_short(str(e).split('To suppress this check')[0])}"]
    except OSError as e:
        return None, [f"cannot read: {e.strerror}"]


def _schema(paths: list[Path]) -> dict[str, list[str]]:
    """check-jsonschema on the files that parsed, one run: {filename: problems}."""
    r = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", SCHEMA, "--color", "never",
                        "-o", "json", "--verbose", *map(str, paths)], capture_output=True, text=True)
    try:
        res = json.loads(r.stdout)
    except json.JSONDecodeError:
        if r.returncode == 0:
            return {}
        return {str(p): [f"check-jsonschema exited {r.returncode}: {_short(r.stderr or r.stdout)}"] for p in paths}
    out: dict[str, list[str]] = {}
    for e in res.get("errors", []):
        # the best deep match; where that is only a type mismatch at the error's own place (an "anyOf",
        # e.g. `on:` as a string, a list or a map of events), the alternatives' errors that name a key
        best = e.get("best_deep_match") or e
        msgs = [f"{best['path']}: {_short(best['message'])}"]
        if best["path"] == e["path"] and GENERIC.search(best["message"]):
            named = [f"{s['path']}: {_short(s['message'])}" for s in e.get("sub_errors", [])
                     if "Additional properties" in s["message"] or "is a required property" in s["message"]]
            msgs = named or msgs
        out.setdefault(e["filename"], []).extend(dict.fromkeys(msgs))
    for e in res.get("parse_errors", []):
        out.setdefault(e["filename"], []).append(_short(e["message"]))
    if r.returncode and not out:
        out = {str(p): [f"check-jsonschema exited {r.returncode}: {_short(r.stderr)}"] for p in paths}
    return out


def _strings(node, where: str):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _strings(v, f"{where}[{i}]")
    elif isinstance(node, str):
        yield where, node


def _expressions(doc) -> list[str]:
    bad = []
    for where, s in _strings(doc, ""):
        rest = EXPR.sub("", s)
        if "${{" in rest:
            bad.append(f"{where}: an expression '${{{{' is not closed by '}}}}'")
    return bad


def _shell(doc) -> list[str]:
    """bash -n on every run: script whose shell is bash."""
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), dict):
        return []

    def shell_of(d) -> str | None:
        run = (d.get("defaults") or {}).get("run") if isinstance(d, dict) else None
        return run.get("shell") if isinstance(run, dict) else None

    bad = []
    for name, job in doc["jobs"].items():
        if not isinstance(job, dict) or not isinstance(job.get("steps"), list):
            continue
        for i, step in enumerate(job["steps"]):
            if not isinstance(step, dict) or not isinstance(step.get("run"), str):
                continue
            shell = step.get("shell") or shell_of(job) or shell_of(doc) or "bash"
            if not (shell == "bash" or str(shell).startswith("bash ")):
                continue
            script = EXPR.sub("EXPR", step["run"])
            r = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
            if r.returncode:
                label = f" ({step['name']})" if step.get("name") else ""
                err = _short(r.stderr.replace("bash: ", "", 1))
                bad.append(f"jobs.{name}.steps[{i}]{label}: run: bash -n: {err}")
    return bad


def main(argv: list[str]) -> int:
    files = _files(argv)
    if not files:
        print(f"lint-workflows: no workflow files (*.yml, *.yaml) in {' '.join(argv) or WORKFLOWS}", file=sys.stderr)
        return 2
    try:
        import check_jsonschema  # noqa: F401
    except ImportError:
        print(f"lint-workflows: check-jsonschema is not installed in {sys.executable} "
              "(env/requirements-harness.txt; make setup)", file=sys.stderr)
        return 2
    problems: dict[Path, list[str]] = {}
    docs = {}
    for f in files:
        doc, bad = _parse(f)
        if bad:
            problems[f] = bad
        else:
            docs[f] = doc
    if docs:
        by_name = _schema(list(docs))
        for f, doc in docs.items():
            bad = by_name.pop(str(f), []) + _expressions(doc) + _shell(doc)
            if bad:
                problems[f] = bad
        for name, bad in by_name.items():  # a file check-jsonschema named otherwise: still a problem
            problems[Path(name)] = bad
    for f, bad in problems.items():
        for b in bad:
            print(f"{f}: {b}")
    if problems:
        n = sum(map(len, problems.values()))
        print(f"lint-workflows: {n} problem(s) in {len(problems)} of {len(files)} file(s)", file=sys.stderr)
        return 1
    print(f"lint-workflows: ok ({', '.join(f.name for f in files)}: YAML, schema {SCHEMA}, expressions, bash -n)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
