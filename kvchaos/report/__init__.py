"""Reports people read: ``build(run_dir)`` writes the run-level ``verdicts.json`` and a self-contained
``report.html`` into a run directory (``reports/<run-id>/``); ``kvchaos report DIR`` calls it.

Every pytest session with kvchaos' plugin writes its run directory (JUnit XML, progress, event logs,
``experiments.jsonl`` with the policy's status per experiment, ``findings.json``, engine logs) and
builds the report at the end; ``kvchaos report`` rebuilds it from what is on disk, e.g. for a
committed incident directory. Both lead with the run's status (FAIL / UNKNOWN / KNOWN-only / PASS /
no chaos verdict) and the findings: every leak, every known finding, what did not reproduce.
"""

from __future__ import annotations

import json
from pathlib import Path

from .collect import collect
from .model import ReportError, RunModel, run_verdicts_name  # noqa: F401 - part of this package's API
from .verdicts import run_status, run_verdicts  # noqa: F401 - part of this package's API

LABEL = {"fail": "FAIL", "unknown": "UNKNOWN", "known": "KNOWN-only", "pass": "PASS", "none": "NO CHAOS VERDICT"}


def build(run_dir: str | Path) -> dict:
    """Write ``verdicts.json`` (or ``run-verdicts.json`` in a directory that is one scenario) and
    ``report.html``; return {"html": path, "verdicts": path, "overall": ..., "chaos": ..., "label": ...,
    "reason": ..., "lines": terminal summary lines, "model": RunModel}."""
    # here, not at the top: readers of summary_lines and ReportError (kvchaos.cli, kvchaos.plugin) need
    # none of the rendering
    from .html import render

    run_dir = Path(run_dir)
    m = collect(run_dir)
    v = run_verdicts(m)
    vpath = run_dir / run_verdicts_name(run_dir)
    vpath.write_text(json.dumps(v, indent=2, default=str))
    page = render(m, v)
    hpath = run_dir / "report.html"
    hpath.write_text(page)
    return {"html": hpath, "verdicts": vpath, "overall": v["overall"], "chaos": v["chaos"],
            "label": LABEL.get(v["overall"], v["overall"].upper()), "reason": v["reason"],
            "lines": summary_lines(v), "model": m}


def summary_lines(v: dict, max_items: int = 10) -> list[str]:
    """What a terminal shows of a run-level ``verdicts.json``, in the report's order: the status and
    why, every leak (victim ← owner), every known finding, what did not reproduce, then test counts
    (chaos tests, harness tests)."""
    out = [f"kvchaos: {LABEL.get(v['overall'], v['overall'].upper())} — {v.get('reason', '')}"]
    leaks = v.get("leaks") or []
    for x in leaks[:max_items]:
        w = x["witness"]
        if x["oracle"] == "isolation":
            owner = (f"{w.get('owner_rid')} ({w.get('owner_tenant')})" if w.get("owner_rid") else "unknown origin")
            what = (f"{w.get('victim_rid')} ({w.get('victim_tenant')}) got {w.get('matched')!r} of {owner}, "
                    f"HTTP {w.get('status')}, {w.get('outcome')}"
                    + ("" if w.get("complete", True) else ", cut"))
        else:
            what = ", ".join(f"{k}={w[k]}" for k in ("rid", "victim_rid", "room", "problem") if w.get(k) is not None)
        tag = f"KNOWN {x['known']}" + ("" if x.get("accepted") else " (not accepted)") if x.get("known") else "LEAK"
        out.append(f"  {tag} [{x['oracle']}] {x['experiment']}: {what}  ({x.get('test')})")
    if len(leaks) > max_items:
        out.append(f"  … {len(leaks) - max_items} more leak witnesses in verdicts.json")
    for k in v.get("known") or []:
        out.append(f"  KNOWN {k['id']} on {k.get('engine')} {k.get('version')}: {k.get('title')} — {k.get('test')} "
                   f"[{k.get('oracle')} {str(k.get('status')).upper()}{'' if k.get('accepted') else ', NOT accepted'}]")
    for n in v.get("not_reproduced") or []:
        out.append(f"  {n.get('message')}" + (" (--kvchaos-strict: run fails)" if v.get("strict") else ""))
    t = v.get("tests") or {}
    if t.get("chaos"):
        out.append("  chaos tests: " + ", ".join(f"{n} {k}" for k, n in sorted(t["chaos"].items())))
    if t.get("harness"):
        out.append("  harness tests: " + ", ".join(f"{n} {k}" for k, n in sorted(t["harness"].items())))
    return out
