"""Reports people read: ``build(run_dir)`` writes the run-level ``verdicts.json`` and a self-contained
``report.html`` into a run directory (``reports/<run-id>/``); ``kvchaos report DIR`` calls it.

Every pytest session with kvchaos' plugin writes its run directory (JUnit XML, event logs, the suites'
verdicts, engine logs) and builds the report at the end; ``kvchaos report`` rebuilds it from what is
on disk, e.g. for a committed incident directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from .collect import ReportError, RunModel, collect, run_verdicts, run_verdicts_name  # noqa: F401


def build(run_dir: str | Path) -> dict:
    """Write ``verdicts.json`` (or ``run-verdicts.json`` in a directory that is one scenario) and
    ``report.html``; return {"html": path, "verdicts": path, "overall": ..., "model": RunModel}."""
    from .html import render

    run_dir = Path(run_dir)
    m = collect(run_dir)
    v = run_verdicts(m)
    vpath = run_dir / run_verdicts_name(run_dir)
    vpath.write_text(json.dumps(v, indent=2, default=str))
    page = render(m, v)
    hpath = run_dir / "report.html"
    hpath.write_text(page)
    return {"html": hpath, "verdicts": vpath, "overall": v["overall"], "model": m}
