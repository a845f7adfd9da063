"""The probe's reply contract, measured before it is trusted: per KV layout, how many clean replies were
exactly what their prompts must give (``kvchaos.oracles.integrity``), and every one that was not.

Runs the clean control (``suites/test_clean_control.py``: /generate, /v1/completions and
/v1/chat/completions, plain and streamed, the shared-prefix mix, 32 tenants, 64 in flight) with
``KVCHAOS_CLEAN_REQUESTS`` replies on a real prefill/decode cluster of each layout, one pytest session
(one cluster each, in turn), then reads each run's ``clean_control`` verdicts: integrity's judged,
whole and cut-short counts, what it did not judge and why, and its witnesses. A clean mismatch is a
probe or harness bug to find, never a tolerance: the exit code is 1 unless every layout is 100 %.

A production-shaped probe (``like:<name>``) computes every one of its layers on this CPU (3-4 tokens/s
decoding: 2,000 replies through the engine would take hours), so ``--local LAYOUTS`` measures those in
transformers instead (``kvchaos.probe.measure.LocalModel``: the same weights and dtype, greedy, each reply
checked in one forward pass against the recital and continued greedily where it leaves it) over the
clean control's very prompts; the engine's own runs of those layouts (the matrix's clean arms, the
incident replay) are the committed ones in ``reports/layouts/``.

Usage: python bench/integrity_contract.py [--layouts mha-p1-fp32,gqa-p16-bf16,...] [--replies 2000]
                                          [--local like:llama-3.1-8b-p64-bf16,...] [--json OUT.json]
                                          [--reports DIR]
Prints a table (layout, where, replies judged, exact, cut short and exact as far as they went, not
judged, mismatches, wall time) and writes it as JSON with ``--json``.
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
    row = {"layout": layout, "where": "engine", "replies": replies, "wall_s": round(wall, 1),
           "pytest_exit": p.returncode}
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
                "others": {o: x.get("status") for o, x in verdicts.items() if o != "integrity"},
                "shapes": _shapes(Path(str(found[-1]).replace("verdicts.json", "events.jsonl")))})
    return row


def _shapes(events: Path) -> dict:
    """Replies per workload shape (sharing / endpoint / delivery) of the run: what the contract was held to."""
    out: dict = {}
    if events.exists():
        for line in events.read_text().splitlines():
            e = json.loads(line)
            if e.get("ev") == "plan":
                k = f"{e.get('sharing')}/{e.get('endpoint')}/{e.get('kind')}"
                out[k] = out.get(k, 0) + 1
    return dict(sorted(out.items()))


def run_local(layout: str, replies: int) -> dict:
    """The clean control's prompts answered by the layout's probe in transformers, each held to its contract."""
    sys.path.insert(0, str(REPO))
    from kvchaos.cluster.layouts import DTYPES, parse
    from kvchaos.probe import contract, ensure_probe
    from kvchaos.probe.measure import LocalModel
    from kvchaos.workload import Workload

    lay = parse(layout)
    kind = f"like:{lay.like}" if lay.like else lay.attention
    t0 = time.time()
    model = LocalModel(ensure_probe(kind), dtype=DTYPES.get(lay.dtype, "bfloat16"))
    # the clean control's own traffic (suites/test_clean_control.py): its seed, tenants, mix and lengths
    plans = Workload(20261130, n_tenants=32).mix(replies, weights={"plain": 3, "stream": 1}, lengths=(64, 500),
                                                 endpoints=("generate", "generate", "completions", "chat"))
    row = {"layout": layout, "where": "transformers", "replies": len(plans), "judged": 0, "whole_exact": 0,
           "cut_short_exact": 0, "not_judged": {}, "mismatches": 0, "witnesses": []}
    for p in plans:
        c = contract.expected(p.prompt)
        if not c.defined:
            row["not_judged"][c.why] = row["not_judged"].get(c.why, 0) + 1
            continue
        got = model.generate(p.prompt, p.max_new_tokens)["text"]
        row["judged"] += 1
        whole = c.tokens <= p.max_new_tokens
        want = c.text if whole else c.text[:len(got)]
        if got == want:
            row["whole_exact" if whole else "cut_short_exact"] += 1
        else:
            row["mismatches"] += 1
            at = contract.first_difference(want, got)
            if len(row["witnesses"]) < 20:
                row["witnesses"].append({"rid": p.rid, "position": at, "expected": want[:60], "got": got[:60]})
    row["integrity"] = "pass" if not row["mismatches"] and row["judged"] else "fail"
    row["wall_s"] = round(time.time() - t0, 1)
    row["drafted_whole"] = model.drafted
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=LAYOUTS)
    ap.add_argument("--replies", type=int, default=2000)
    ap.add_argument("--local", default="", help="layouts measured in transformers instead (like: probes)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reports", default=None, help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    if args.replies < 1000:
        ap.error(f"--replies {args.replies}: the clean control needs >= 1000")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.reports or tmp)
        todo = ([(x, "engine") for x in args.layouts.split(",") if x]
                + [(x, "local") for x in args.local.split(",") if x])
        for layout, where in todo:
            rows.append(run_layout(layout, args.replies, base / layout.replace(":", "-")) if where == "engine"
                        else run_local(layout, args.replies))
            r = rows[-1]
            print(f"{layout}: {r.get('integrity')} — {r.get('whole_exact')} whole + {r.get('cut_short_exact')} "
                  f"cut short exact of {r.get('judged')} judged, {r.get('mismatches')} mismatches, not judged "
                  f"{r.get('not_judged')}; {r['wall_s']:.0f} s" + (f"; ERROR {r['error']}" if r.get("error") else ""),
                  flush=True)
    print("\n| layout | where | replies | judged | exact (whole) | exact (cut short) | not judged | mismatches "
          "| wall |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        nj = sum((r.get("not_judged") or {}).values())
        print(f"| {r['layout']} | {r.get('where', 'engine')} | {r['replies']} | {r.get('judged')} "
              f"| {r.get('whole_exact')} | {r.get('cut_short_exact')} | {nj} | {r.get('mismatches')} "
              f"| {r['wall_s'] / 60:.1f} min |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, default=str) + "\n")
    ok = all(r.get("integrity") == "pass" and r.get("mismatches") == 0 and r.get("judged") == r["replies"]
             for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
