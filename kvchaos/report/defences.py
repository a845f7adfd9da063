"""The defence arm's table: fault class x (kvchaos oracle, checksum, kv-canary) -> caught / not caught /
unknown, from a run's experiments (issue 30).

Each experiment is a record as ``experiments.jsonl`` holds it (``name``, ``planted``, ``verdicts``:
oracle -> status; a list of serialized verdicts works too). Its fault class is the detection matrix's
class it planted (``planted: "detection matrix: <class> armed"``, or its name ``matrix_<class>_mut_<n>``);
a matrix clean arm is ``<class> (clean)``; any other experiment is its name without a trailing trial
number. Per experiment and column:

* **kvchaos oracle**: caught when any of kvchaos' own checkers FAILed; else unknown when any said
  UNKNOWN; else not caught;
* **checksum** (``kv_checksum``), **kv-canary** (``kv_canary``): caught on FAIL, not caught on PASS
  (the defence was on and stayed silent), unknown on UNKNOWN or when it did not judge the experiment.

A class's cell counts its experiments: ``caught`` (every one), ``caught k/n``, ``not caught``,
``unknown``, or both of the latter with their counts. On a clean row, caught is a false alarm.

    python -m kvchaos.report.defences reports/<run-id> [--json]
"""

from __future__ import annotations

import argparse
import html
import json
import re
import sys
from pathlib import Path

from kvchaos.oracles.base import FAIL, PASS, UNKNOWN
from kvchaos.oracles.defences import DEFENCES

DEFENCE_ORACLES = tuple(c.name for c in DEFENCES)  # kv_checksum, kv_canary
COLUMNS = (("kvchaos", "kvchaos oracle"), ("kv_checksum", "checksum"), ("kv_canary", "kv-canary"))
CAUGHT, NOT_CAUGHT, UNKNOWN_CELL = "caught", "not caught", "unknown"
_PLANTED = re.compile(r"^detection matrix: (?P<cls>\S+) armed")
_MATRIX = re.compile(r"^matrix_(?P<cls>.+?)_(?P<arm>mut|clean)_\d+$")


def fault_class(rec: dict) -> str:
    """The fault class an experiment record stands for (module doc)."""
    name = str(rec.get("name") or "?")
    planted = rec.get("planted")
    if planted:
        m = _PLANTED.match(str(planted))
        return m["cls"] if m else str(planted)
    m = _MATRIX.match(name)
    if m:
        return m["cls"] if m["arm"] == "mut" else f"{m['cls']} (clean)"
    return re.sub(r"_\d+$", "", name)


def statuses(rec: dict) -> dict[str, str]:
    """oracle -> status of one experiment record (``verdicts`` as a mapping or a list of verdicts)."""
    v = rec.get("verdicts")
    if isinstance(v, dict):
        return {str(k): s for k, s in v.items() if isinstance(s, str)}
    if isinstance(v, list):
        return {d["oracle"]: d.get("status") for d in v if isinstance(d, dict) and isinstance(d.get("oracle"), str)}
    return {}


def outcome(st: dict[str, str], column: str) -> str:
    """caught / not caught / unknown of one experiment in one column."""
    if column == "kvchaos":
        own = [s for o, s in st.items() if o not in DEFENCE_ORACLES]
        if FAIL in own:
            return CAUGHT
        if UNKNOWN in own or not own:
            return UNKNOWN_CELL
        return NOT_CAUGHT
    s = st.get(column)
    return CAUGHT if s == FAIL else NOT_CAUGHT if s == PASS else UNKNOWN_CELL


def cell(outcomes: list[str]) -> str:
    """One class's cell from its experiments' outcomes in a column."""
    n = len(outcomes)
    k, nc, u = (outcomes.count(x) for x in (CAUGHT, NOT_CAUGHT, UNKNOWN_CELL))
    if not n:
        return UNKNOWN_CELL
    if k == n:
        return CAUGHT + (f" ({n}/{n})" if n > 1 else "")
    if k:
        return f"{CAUGHT} {k}/{n}"
    if not u:
        return NOT_CAUGHT + (f" (0/{n})" if n > 1 else "")
    if not nc:
        return UNKNOWN_CELL + (f" ({u}/{n})" if n > 1 else "")
    return f"{NOT_CAUGHT} {nc}/{n}, {UNKNOWN_CELL} {u}/{n}"


def table(records) -> list[dict]:
    """One row per fault class (planted classes first, in the order first seen): its experiments, the
    KV layouts they ran on, a cell per column and the counts behind each cell."""
    groups: dict[str, list[dict]] = {}
    layouts: dict[str, set] = {}
    for rec in records:
        if isinstance(rec, dict):
            groups.setdefault(fault_class(rec), []).append(statuses(rec))
            if rec.get("kv_layout"):
                layouts.setdefault(fault_class(rec), set()).add(str(rec["kv_layout"]))
    planted = {fault_class(r) for r in records if isinstance(r, dict) and (r.get("planted") or
                                                                          _MATRIX.match(str(r.get("name") or "")))}
    order = sorted(groups, key=lambda c: (c not in planted, c.endswith("(clean)"), list(groups).index(c)))
    rows = []
    for cls in order:
        sts = groups[cls]
        row = {"class": cls, "experiments": len(sts), "layouts": sorted(layouts.get(cls, ())), "counts": {}}
        for col, _title in COLUMNS:
            outs = [outcome(st, col) for st in sts]
            row[col] = cell(outs)
            row["counts"][col] = {x: outs.count(x) for x in (CAUGHT, NOT_CAUGHT, UNKNOWN_CELL)}
        rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    """The table as Markdown text."""
    head = ["fault class", "experiments"] + [t for _c, t in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([r["class"], str(r["experiments"])] + [r[c] for c, _t in COLUMNS]) + " |")
    return "\n".join(lines)


def render_html(rows: list[dict]) -> str:
    head = "".join(f"<th>{html.escape(t)}</th>" for t in ["fault class", "experiments"] + [t for _c, t in COLUMNS])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in
                                    [r["class"], r["experiments"]] + [r[c] for c, _t in COLUMNS]) + "</tr>"
                   for r in rows)
    return (f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
            "<p class=muted>caught: the checker FAILed (kvchaos oracle: any of kvchaos' own); not caught: it "
            "PASSed (a defence: on on both roles, silent); unknown: it could not say (a defence off, unread logs, "
            "a CPU device). On a clean row, caught is a false alarm.</p>")


def read_experiments(run_dir) -> list[dict]:
    """The records of ``<run_dir>/experiments.jsonl`` (lines that are not JSON objects are skipped)."""
    path = Path(run_dir) / "experiments.jsonl"
    out = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def section(run_dir) -> dict | None:
    """``report.html``'s section for the defence arm (``pytest_kvchaos_report_sections``), or None when
    no experiment of the run was judged by a defence."""
    recs = [r for r in read_experiments(run_dir) if set(statuses(r)) & set(DEFENCE_ORACLES)]
    if not recs:
        return None
    return {"title": "SGLang's own defences vs kvchaos' oracles", "html": render_html(table(recs))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvchaos.report.defences", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--json", action="store_true", help="the rows as JSON instead of a Markdown table")
    args = ap.parse_args(argv)
    recs = [r for r in read_experiments(args.run_dir) if set(statuses(r)) & set(DEFENCE_ORACLES)]
    if not recs:
        print(f"{args.run_dir}: no experiment judged by {' or '.join(DEFENCE_ORACLES)} (was the defence arm on?)",
              file=sys.stderr)
        return 3
    rows = table(recs)
    print(json.dumps(rows, indent=2) if args.json else render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
