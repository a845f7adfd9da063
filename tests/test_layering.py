"""Lower layers never import higher ones.

Bottom up: ``kvchaos.cluster`` (launch, own processes and ports) < ``kvchaos.workload`` /
``kvchaos.oracles`` (requests and verdicts over a cluster) < ``faults`` (injectors acting on a
cluster) < the glue that wires them together (``kvchaos.selftest``, ``kvchaos.suite``,
``kvchaos.pytest_plugin``, ``kvchaos.cli``, ``kvchaos.report``, ``suites``).

A lower layer that needs something from a higher one gets it injected (the network fault proxy is
handed to :class:`kvchaos.cluster.Cluster` as ``proxy_factory``), never by importing it — in any
form: ``import x``, ``from x import y``, a relative import climbing out of the package,
``importlib.import_module("x...")`` / ``__import__``, or a ``"x.mod:attr"`` string resolved later.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

GLUE = ["kvchaos.selftest", "kvchaos.suite", "kvchaos.pytest_plugin", "kvchaos.cli", "kvchaos.report", "suites"]
# package directory -> top-level names (packages or modules) it must never import
FORBIDDEN = {
    "kvchaos/cluster": ["faults", "kvchaos.workload", "kvchaos.oracles", *GLUE],
    "kvchaos/workload": ["faults", *GLUE],
    "kvchaos/oracles": ["faults", *GLUE],
    "faults": GLUE,
}

_IMPORT_FUNCS = {"import_module", "__import__", "find_spec", "import_string", "resolve_name", "load_module"}
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_][\w.]*)?$")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imported_names(path: Path, source: str | None = None) -> list[tuple[int, str, str]]:
    """(line, absolute module name, how) for every import in ``path``, static or dynamic."""
    tree = ast.parse(source if source is not None else path.read_text(), str(path))
    me = module_name(path)
    pkg = me if _is_package(path) else me.rpartition(".")[0]
    out: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, "import") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod, "from"))
            out += [(node.lineno, f"{mod}.{a.name}" if mod else a.name, "from") for a in node.names]
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.JoinedStr) and arg.values:  # f"faults.{name}": its literal head
                arg = arg.values[0]
            if fname in _IMPORT_FUNCS and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.append((node.lineno, arg.value.split(":")[0].rstrip("."), f"{fname}()"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value \
                and _DOTTED.match(node.value):
            # "pkg.mod:attr" — an entry-point-style reference resolved with importlib later
            out.append((node.lineno, node.value.split(":")[0], "string"))
    return out


def violations(pkg_dir: str, forbidden: list[str], files: dict[Path, str] | None = None) -> list[str]:
    bad = []
    paths = files if files is not None else {p: None for p in sorted((REPO / pkg_dir).rglob("*.py"))}
    for path, src in paths.items():
        for line, name, how in imported_names(path, src):
            for f in forbidden:
                if name == f or name.startswith(f + "."):
                    bad.append(f"{path.relative_to(REPO)}:{line}: {how} {name} (a {pkg_dir} module must not "
                               f"import {f}: lower layers never import higher ones)")
    return bad


@pytest.mark.parametrize("pkg_dir", sorted(FORBIDDEN))
def test_lower_layers_never_import_higher_ones(pkg_dir):
    assert (REPO / pkg_dir).is_dir()
    assert violations(pkg_dir, FORBIDDEN[pkg_dir]) == []


@pytest.mark.parametrize("src", [
    "import faults",
    "import faults.netfault as nf",
    "from faults.netfault import NetworkFaults",
    "from faults import FaultKit",
    "def f():\n    from faults.netfault import NetworkFaults\n",
    "import importlib\nimportlib.import_module('faults.netfault')",
    "from importlib import import_module\nimport_module('faults')",
    "__import__('faults.proxy')",
    "import importlib\nname = 'netfault'\nimportlib.import_module(f'faults.{name}')",
    "FACTORY = 'faults.netfault:NetworkFaults.open'",
    "from ... import faults",  # kvchaos/cluster/x.py: '...' is the repository root
    "from .. import workload",
])
def test_the_scan_sees_every_form_of_import(src):
    fake = REPO / "kvchaos" / "cluster" / "_layering_probe.py"  # never written: the source is passed in
    assert violations("kvchaos/cluster", FORBIDDEN["kvchaos/cluster"], {fake: src}), src


@pytest.mark.parametrize("src", [
    "from .reaper import proc_table",
    "import httpx",
    "MSG = 'pass proxy_factory=faults.netfault.NetworkFaults.open to Cluster(...)'",  # prose, not a reference
    "x = 'faultsy.mod:attr'",
])
def test_the_scan_allows_what_is_not_an_upward_import(src):
    fake = REPO / "kvchaos" / "cluster" / "_layering_probe.py"
    assert violations("kvchaos/cluster", FORBIDDEN["kvchaos/cluster"], {fake: src}) == [], src
