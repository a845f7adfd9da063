"""Time to build one run directory's report, and how much of it the plots take — with this tree's
plots and, given ``--against REV``, with ``kvchaos/report/plots.py`` as it was at git revision REV
(e.g. the matplotlib version, 6c862db; that needs matplotlib installed: ``pip install matplotlib``).
Both builds run in this process on a copy of the run directory, one after the other; the ratio is
from this one run.

Usage: python bench/report_build.py RUN_DIR [--against REV]
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _timed_build(run_dir: Path, plots_module) -> tuple[float, float, int]:
    """(whole build s, plots s, scenarios) with ``plots_module`` drawing."""
    from kvchaos.report import build, html

    spent = {"s": 0.0, "n": 0}

    def timed(fn, count=False):
        def inner(scn):
            t = time.perf_counter()
            try:
                return fn(scn)
            finally:
                spent["s"] += time.perf_counter() - t
                spent["n"] += count
        return inner

    saved = html.plots
    html.plots = type("P", (), {"timeline": staticmethod(timed(plots_module.timeline, True)),
                                "latency": staticmethod(timed(plots_module.latency))})
    try:
        t = time.perf_counter()
        build(run_dir)
        return time.perf_counter() - t, spent["s"], spent["n"]
    finally:
        html.plots = saved


def _plots_at(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:kvchaos/report/plots.py"], cwd=REPO, capture_output=True,
                         text=True)
    if src.returncode != 0:
        raise SystemExit(f"git show {rev}:kvchaos/report/plots.py failed: {src.stderr.strip()}")
    path = Path(tempfile.mkdtemp()) / f"plots_{rev}.py"
    path.write_text(src.stdout)
    spec = importlib.util.spec_from_file_location(f"plots_{rev}", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except ModuleNotFoundError as e:
        raise SystemExit(f"plots.py at {rev} needs {e.name}: pip install {e.name}") from None
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--against", help="a git revision whose kvchaos/report/plots.py to time beside this tree's")
    args = ap.parse_args()
    if not args.run_dir.is_dir():
        raise SystemExit(f"{args.run_dir}: not a directory (a reports/<run-id>/)")
    from kvchaos.report import plots

    rows = [("this tree", plots)] + ([(args.against, _plots_at(args.against))] if args.against else [])
    got = {}
    for name, mod in rows:
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / args.run_dir.name
            shutil.copytree(args.run_dir, copy)
            got[name] = _timed_build(copy, mod)
    for name, (whole, drawn, n) in got.items():
        print(f"report of {args.run_dir.name}, plots of {name}: build {whole:.2f} s, of which plots {drawn:.2f} s "
              f"({n} scenarios, {1000 * drawn / max(n, 1):.1f} ms each)")
    if args.against:
        (w0, p0, _), (w1, p1, _) = got["this tree"], got[args.against]
        print(f"ratio this tree / {args.against}: build {w0 / w1:.3f}, plots {p0 / max(p1, 1e-9):.4f}")


if __name__ == "__main__":
    main()
