"""Lower layers never import higher ones; no module imports itself back; imports sit at the top.

The layers of both packages (bottom up; a layer may import only the layers it lists, and itself):

    base      kvchaos.canary, .model, .cpucompat, ._boot, .machine_lock   (engine-side support too)
    probe     kvchaos.probe (the probe model), kvchaos.history (the one event-log history)
    cluster   kvchaos.cluster: launch, attach, supervise; takes its proxy and agent from above
    workload  kvchaos.workload: tenants, canaries, the driver, the event log
    checkers  kvchaos.oracles: one module per checker
    nemesis   faults: in-engine agent, network proxy, process faults (never the checkers)
    policy    kvchaos.policy + findings: what verdicts mean
    runner    kvchaos.experiment, .selftest, .shrink, .releases, .suite, .audit, .provoke: arm faults, drive, judge
    report    kvchaos.report, .replay, .soak: render the policy's judgement
    face      kvchaos.plugin, .commands, .cli, .__main__

``python tests/test_layering.py`` prints the table with what each layer really imports.

A lower layer that needs something from a higher one gets it injected (the network fault proxy is
handed to :class:`kvchaos.cluster.Cluster` as ``proxy_factory``, the in-engine agent as
``agent_module``), never by importing it — in any form: ``import x``, ``from x import y``, a
relative import climbing out of the package, ``importlib.import_module("x...")`` / ``__import__``,
or a ``"x.mod:attr"`` string resolved later. Imports under ``if TYPE_CHECKING:`` are annotations,
not edges.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kvchaos", "faults")

# layer -> the module prefixes it holds (the longest prefix decides)
LAYERS = {
    "base": ["kvchaos.canary", "kvchaos.model", "kvchaos.cpucompat", "kvchaos._boot", "kvchaos.machine_lock",
             "kvchaos"],
    "probe": ["kvchaos.probe", "kvchaos.history"],
    "cluster": ["kvchaos.cluster"],
    "workload": ["kvchaos.workload"],
    "checkers": ["kvchaos.oracles"],
    "nemesis": ["faults"],
    "policy": ["kvchaos.policy"],
    "runner": ["kvchaos.experiment", "kvchaos.schedule", "kvchaos.fuzz", "kvchaos.selftest", "kvchaos.shrink", "kvchaos.releases", "kvchaos.suite",
               "kvchaos.audit", "kvchaos.provoke"],
    "report": ["kvchaos.report", "kvchaos.replay", "kvchaos.soak"],
    "face": ["kvchaos.plugin", "kvchaos.commands", "kvchaos.cli", "kvchaos.__main__"],
}
# layer -> the layers it may import besides itself. faults may import the lower layers of kvchaos
# (cluster, workload, canary, probe and the base), never the checkers or the policy; the lower layers,
# the checkers and the policy never import faults; only the runner and the face do.
_BELOW_FAULTS = ["base", "probe", "cluster", "workload"]
ALLOWED = {
    "base": [],
    "probe": ["base"],
    "cluster": ["base", "probe"],
    "workload": ["base", "probe", "cluster"],
    "checkers": ["base", "probe", "cluster", "workload"],
    "nemesis": _BELOW_FAULTS,
    "policy": [*_BELOW_FAULTS, "checkers"],
    "runner": [*_BELOW_FAULTS, "checkers", "nemesis", "policy"],
    "report": [*_BELOW_FAULTS, "checkers", "policy"],
    "face": [*_BELOW_FAULTS, "checkers", "nemesis", "policy", "runner", "report"],
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


def _typing_only(tree) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (annotations, never imported at run time)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (getattr(node.test, "id", None) == "TYPE_CHECKING"
                                         or getattr(node.test, "attr", None) == "TYPE_CHECKING"):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def imported_names(path: Path, source: str | None = None) -> list[tuple[int, str, str]]:
    """(line, absolute module name, how) for every import in ``path``, static or dynamic."""
    tree = ast.parse(source if source is not None else path.read_text(), str(path))
    me = module_name(path)
    pkg = me if _is_package(path) else me.rpartition(".")[0]
    skip = _typing_only(tree)
    out: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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
            out += [(node.lineno, f"{mod}.{a.name}" if mod else a.name, "from-import") for a in node.names]
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


def sources() -> dict[Path, None]:
    return {p: None for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def layer_of(module: str) -> str | None:
    best = None
    for layer, prefixes in LAYERS.items():
        for pre in prefixes:
            if (module == pre or module.startswith(pre + ".")) and (best is None or len(pre) > len(best[1])):
                best = (layer, pre)
    return best[0] if best else None


def _targets(path: Path, src: str | None, modules: set[str]) -> list[tuple[int, str, str]]:
    """(line, module, how) of every internal module ``path`` imports: ``from pkg import sub`` is an
    import of ``pkg.sub`` alone when ``sub`` is a module (the package's ``__init__`` runs either way,
    as it does for every submodule import)."""
    out = []
    for line, name, how in imported_names(path, src):
        if name.split(".")[0] not in PACKAGES:
            continue
        if how == "from" and any(m.startswith(name + ".") for m in modules):
            continue  # 'from pkg import a, b': the statement's own entry; each name is listed after it
        while name not in modules and "." in name:
            name = name.rpartition(".")[0]
        out.append((line, name, how))
    return out


def violations(files: dict[Path, str | None] | None = None) -> list[str]:
    """Every import from one layer into a layer it may not import."""
    files = sources() if files is None else files
    modules = {module_name(p) for p in sources()} | {module_name(p) for p in files}
    bad = []
    for path, src in files.items():
        mine = layer_of(module_name(path))
        for line, name, how in _targets(path, src, modules):
            theirs = layer_of(name)
            if theirs != mine and theirs not in ALLOWED[mine]:
                bad.append(f"{path.relative_to(REPO)}:{line}: {how} {name} (the {mine} layer must not import the "
                           f"{theirs} layer: it may import {ALLOWED[mine] or 'nothing else'})")
    return bad


def graph(files: dict[Path, str | None] | None = None) -> dict[str, set[str]]:
    files = sources() if files is None else files
    modules = {module_name(p) for p in files}
    return {module_name(p): {n for _l, n, _h in _targets(p, src, modules) if n != module_name(p)}
            for p, src in files.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], 0
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g.get(root, ()))))]
        index[root] = low[root] = n
        n += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = n
                    n += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def late_imports(files: dict[Path, str | None] | None = None) -> list[str]:
    """Imports of kvchaos or faults inside a function with no comment saying why (on the import's
    lines or the line above)."""
    files = sources() if files is None else files
    bad = []
    for path, src in files.items():
        text = src if src is not None else path.read_text()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
                internal = node.level if isinstance(node, ast.ImportFrom) else 0
                if not internal and not any(m.split(".")[0] in PACKAGES for m in names):
                    continue
                first = node.lineno - 1  # the comment may head a group of imports
                while first > 0 and lines[first - 1].strip().startswith(("import ", "from ")):
                    first -= 1
                around = lines[max(0, first - 1):node.end_lineno]
                if not any("#" in ln for ln in around):
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {lines[node.lineno - 1].strip()} "
                               "(inside a function without a comment saying why it is not at the top)")
    return bad


def test_no_layer_imports_a_layer_it_may_not():
    assert violations() == []


def test_every_module_has_a_layer():
    assert [module_name(p) for p in sources() if layer_of(module_name(p)) is None] == []
    assert set(ALLOWED) == set(LAYERS) and all(set(v) <= set(LAYERS) for v in ALLOWED.values())


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_imports_sit_at_the_top_unless_a_comment_says_why():
    assert late_imports() == []


def test_lower_layers_never_import_faults():
    lower = ["base", "probe", "cluster", "workload", "checkers", "policy", "report"]
    assert all("nemesis" not in ALLOWED[layer] for layer in lower)
    assert [x for x in violations() if "faults" in x] == []


FAKE = REPO / "kvchaos" / "cluster" / "_layering_probe.py"  # never written: the source is passed in


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
    "from kvchaos.experiment import Experiment",
    "from kvchaos import policy",
])
def test_the_scan_sees_every_form_of_import(src):
    assert violations({FAKE: src}), src


@pytest.mark.parametrize("src", [
    "from .reaper import proc_table",
    "import httpx",
    "MSG = 'pass proxy_factory=faults.netfault.NetworkFaults.open to Cluster(...)'",  # prose, not a reference
    "x = 'faultsy.mod:attr'",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvchaos.workload import EventLog\n",
    "from kvchaos.probe import ensure_probe",
])
def test_the_scan_allows_what_is_not_an_upward_import(src):
    assert violations({FAKE: src}) == [], src


def test_the_cycle_scan_finds_a_cycle_and_only_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    a, b = REPO / "kvchaos" / "experiment.py", REPO / "kvchaos" / "shrink" / "search.py"
    assert cycles(graph({a: "from kvchaos.shrink.search import Shrinker", b: "from kvchaos.experiment import X"}))


@pytest.mark.parametrize("src,flagged", [
    ("def f():\n    from kvchaos import canary\n", True),
    ("def f():\n    from . import reaper\n", True),
    ("def f():\n    # numpy-heavy: only a build pays for it\n    from kvchaos.probe import build\n", False),
    ("def f():\n    from kvchaos import canary  # cycle: canary imports this module\n", False),
    ("def f():\n    import torch\n", False),  # third-party: the engine's, loaded on use
])
def test_the_late_import_scan(src, flagged):
    assert bool(late_imports({FAKE: src})) == flagged


def table() -> str:
    """The layer table: each layer, what it holds, what it may import and what it does import."""
    g = graph()
    used: dict[str, set[str]] = {layer: set() for layer in LAYERS}
    count: dict[str, int] = {layer: 0 for layer in LAYERS}
    for m, targets in g.items():
        count[layer_of(m)] += 1
        used[layer_of(m)] |= {layer_of(t) for t in targets} - {layer_of(m)}
    rows = ["| layer | modules | may import | imports |", "|---|---|---|---|"]
    for layer in LAYERS:
        rows.append(f"| {layer} | {count[layer]} | {', '.join(ALLOWED[layer]) or '-'} | "
                    f"{', '.join(x for x in LAYERS if x in used[layer]) or '-'} |")
    return "\n".join(rows)


def test_the_architecture_page_shows_the_layer_table():
    page = (REPO / "docs" / "architecture" / "layers.md").read_text()
    shown = page.split("<!-- layer-table -->\n", 1)[1].split("\n<!-- /layer-table -->", 1)[0]
    assert shown == table(), "docs/architecture/layers.md: paste `python tests/test_layering.py`'s table"


if __name__ == "__main__":
    print(table())
    print(f"\nupward imports: {len(violations())}; cycles: {len(cycles(graph()))}; "
          f"late imports without a reason: {len(late_imports())}")
