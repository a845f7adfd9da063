"""The probe's reply contract, measured before it is trusted: per KV layout, how many clean replies were
exactly what their prompts must give (``kvchaos.oracles.integrity``), and every one that was not.

Runs the clean control (``suites/test_clean_control.py``: /generate, /v1/completions and
/v1/chat/completions, plain and streamed, the shared-prefix mix, 32 tenants, 64 in flight) with
``KVCHAOS_CLEAN_REQUESTS`` replies on a real prefill/decode cluster of each layout, one pytest session
(one cluster each, in turn), then reads each run's ``clean_control`` verdicts: integrity's judged,
whole and cut-short counts, what it did not judge and why, and its witnesses. A clean mismatch is a
probe or harness bug to find, never a tolerance: the exit code is 1 unless every layout is 100 %.

Usage: python bench/integrity_contract.py [--layouts mha-p1-fp32,gqa-p16-bf16,...] [--replies 2000]
                                          [--json OUT.json] [--reports DIR]
Prints a table (layout, replies judged, exact, cut short and exact as far as they went, not judged,
mismatches, wall time) and writes it as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = "mha-p1-fp32,gqa-p16-bf16,gqa-p64-bf16,mla-p64-bf16"


def run_layout(layout: str, replies: int, reports: Path) -> dict:
    env = {**os.environ, "KVCHAOS_CLEAN_REQUESTS": str(replies)}
    env = {k: v for k, v in env.items() if not k.startswith("PYTEST_")}
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "pytest", "suites/test_clean_control.py", "-p", "no:cacheprovider", "-q",
                        "--kvchaos-layouts", layout, "--kvchaos-reports", str(reports)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=6 * 3600)
    wall = time.time() - t0
    found = sorted(reports.rglob("clean_control*.verdicts.json"), key=lambda f: f.stat().st_mtime)
    row = {"layout": layout, "replies": replies, "wall_s": round(wall, 1), "pytest_exit": p.returncode}
    if not found:
        row["error"] = f"no clean_control verdicts (pytest exit {p.returncode}): {(p.stdout + p.stderr)[-1500:]}"
        return row
    verdicts = {v["oracle"]: v for v in json.loads(found[-1].read_text())}
    v = verdicts.get("integrity") or {}
    st = v.get("stats") or {}
    row.update({"verdicts_file": str(found[-1]), "integrity": v.get("status"), "judged": st.get("judged"),
                "whole_exact": st.get("whole"), "cut_short_exact": st.get("beginning"),
                "not_judged": st.get("not_judged"), "mismatches": len(v.get("witnesses") or []),
                "witnesses": (v.get("witnesses") or [])[:20],
                "others": {o: x.get("status") for o, x in verdicts.items() if o != "integrity"}})
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=LAYOUTS)
    ap.add_argument("--replies", type=int, default=2000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--reports", default=None, help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    if args.replies < 1000:
        ap.error(f"--replies {args.replies}: the clean control needs >= 1000")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.reports or tmp)
        for layout in args.layouts.split(","):
            rows.append(run_layout(layout, args.replies, base / layout.replace(":", "-")))
            r = rows[-1]
            print(f"{layout}: {r.get('integrity')} — {r.get('whole_exact')} whole + {r.get('cut_short_exact')} cut short "
                  f"exact of {r.get('judged')} judged, {r.get('mismatches')} mismatches, not judged {r.get('not_judged')}; "
                  f"{r['wall_s']:.0f} s" + (f"; ERROR {r['error']}" if r.get("error") else ""), flush=True)
    print("\n| layout | replies | judged | exact (whole) | exact (cut short) | not judged | mismatches | wall |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        nj = sum((r.get("not_judged") or {}).values())
        print(f"| {r['layout']} | {r['replies']} | {r.get('judged')} | {r.get('whole_exact')} | {r.get('cut_short_exact')} "
              f"| {nj} | {r.get('mismatches')} | {r['wall_s'] / 60:.1f} min |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, default=str) + "\n")
    ok = all(r.get("integrity") == "pass" and r.get("mismatches") == 0 and r.get("judged") == r["replies"]
             for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
