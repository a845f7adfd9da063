"""Cold time-to-verdict of ``kvchaos repro glm53``: from typing the command to the first leak verdict.

Runs the command as a user would (nothing started beforehand; the venvs exist), then reads what the run
left: ``progress.jsonl`` (when each incident test ended), ``cluster.json`` (the cluster's own start
time), ``incidents/glm53-*/summary.json`` (when, inside each scenario, the first leak was seen). Prints
the time to the first verdict and to the whole reproduction, with the cluster's cold start — the
baseline no harness can beat — as the ratio's denominator.

Usage: python bench/repro_cold.py [--reports DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from kvchaos.workload.events import load_events  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reports", default=None, help="keep the run here (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        reports = Path(args.reports or tmp)
        t0 = time.time()
        p = subprocess.run([sys.executable, "-m", "kvchaos", "repro", "glm53", "--reports", str(reports)],
                           cwd=REPO, capture_output=True, text=True, timeout=1800)
        total = time.time() - t0
        if p.returncode != 0:
            raise SystemExit(f"kvchaos repro glm53 failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        (run,) = [d for d in reports.iterdir() if (d / "progress.jsonl").exists()]
        ends = [e for e in load_events(run / "progress.jsonl") if e.get("ev") == "end"]
        cl = json.loads((run / "cluster.json").read_text())["timings"]
        pre = run / "sglang-0.5.19" / "cluster.json"
        cl_pre = json.loads(pre.read_text())["timings"] if pre.exists() else {}
        rows = []
        for e in ends:
            rows.append((e["wall_end"] - t0, e["nodeid"].split("::")[-1], e["outcome"], e["duration"]))
        sums = {s.parent.name: json.loads(s.read_text()) for s in run.glob("incidents/*/summary.json")}
    leak_tests = sorted(r for r in rows if "leaks" in r[1] and r[2] == "passed")
    if not leak_tests:
        raise SystemExit(f"no leak verdict in the run: {rows}")
    print("kvchaos repro glm53, cold (exit 0):")
    for at, name, outcome, dur in sorted(rows):
        print(f"  {at:7.1f} s  {outcome:8s} {name} ({dur:.1f} s)")
    for mode, s in sorted(sums.items()):
        ttd = s.get("time_to_first_detection_s")
        print(f"  {mode}: verdicts {s['verdicts']}, first leak {ttd if ttd is None else round(ttd, 1)} s into the "
              f"scenario, scenario {s['wall_s']} s")
    first = leak_tests[0]
    # each leak test starts its own cluster cold: the pre-fix release's, or the session's (0.5.23)
    own = cl_pre.get("router_ready_s") if "prefix" in first[1] else cl.get("router_ready_s")
    print(f"cold time-to-verdict: first leak verdict {first[0]:.1f} s after the command ({first[1]}); its cluster's "
          f"cold start {own:.1f} s; ratio first-verdict/cluster-start = {first[0] / own:.2f}")
    print(f"whole reproduction {total:.1f} s (3 verdicts, 2 clusters: 0.5.19 start "
          f"{cl_pre.get('router_ready_s', float('nan')):.1f} s, 0.5.23 start {cl.get('router_ready_s'):.1f} s)")


if __name__ == "__main__":
    main()
