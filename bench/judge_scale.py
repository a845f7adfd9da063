"""What judging a long log costs: ``kvchaos judge`` of generated 200,000-line logs, wall time and peak
memory of the judging process, and each log's time as a ratio to the clean log's.

    python bench/judge_scale.py [--lines 200000] [--repo DIR] [--json F]

Logs (schema 3, closed as the runner closes them; the probe's recitals, so isolation has its power):
* ``clean`` — requests and their replies only;
* ``fault-every-request`` — an agent fault acting on every request (its class's exposure spans all);
* ``victims`` — the same, and 3,000 replies holding another request's canary (3,000 witnesses).
Targets (issue "A judge no rewriting of the log can fool"): each <= 20 s and <= 500 MB on the project's
2-core machine, and each <= 2x the clean log's time."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvchaos import canary  # noqa: E402
from kvchaos.history import CLOSE, digest  # noqa: E402
from kvchaos.probe.contract import recital  # noqa: E402


def write(path: Path, lines: int, fault: bool, victims: int) -> int:
    rng = random.Random(11)
    per = 6 + int(fault)
    n = max(1, (lines - 2) // per)
    recs = [{"t": 0.0, "wall": 1000.0, "ev": "experiment", "schema": 3, "id": "scale", "name": "scale", "n": n,
             "engine": {"name": "sglang", "version": "0.5.23", "roles": {}}}]
    prev = None
    victim_every = max(1, n // victims) if victims else 0
    for i in range(n):
        rid = f"s{i:06d}"
        cs = canary.mint(rng, 2)
        text = recital(cs)
        if victim_every and i % victim_every == 1 and prev and i // victim_every < victims:
            text = text[:-1] + prev + "["
        t = 1.0 + i * 0.01
        recs += [{"t": t, "wall": 1000 + t, "ev": "plan", "rid": rid, "tenant": f"t{i % 64}", "canaries": cs,
                  "expect_echo": True, "kind": "plain", "endpoint": "generate"},
                 {"t": t, "wall": 1000 + t, "ev": "send", "rid": rid},
                 {"t": t + 0.2, "wall": 1000.2 + t, "ev": "first_byte", "rid": rid},
                 {"t": t + 0.2, "wall": 1000.2 + t, "ev": "status", "rid": rid, "status": 200},
                 {"t": t + 0.3, "wall": 1000.3 + t, "ev": "body", "rid": rid, "text": text, "complete": True,
                  "raw": json.dumps({"text": text, "meta_info": {"id": rid}})}]
        if fault:
            recs.append({"t": t + 0.1, "wall": 1000.1 + t, "ev": "agent", "agent_ev": "fault_fired", "source": "agent",
                         "role": "prefill", "fault": "delay-1", "kind": "delay", "rid": rid})
        recs.append({"t": t + 0.3, "wall": 1000.3 + t, "ev": "end", "rid": rid, "outcome": "ok", "latency_s": 0.3})
        prev = cs[0]
    recs.append({"t": 1e6, "wall": 1e6, "ev": CLOSE, "id": "scale", "records": len(recs), "digest": digest(recs),
                 "counts": {}})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return len(recs)


def judge(repo: Path, path: Path) -> tuple[int, float, float]:
    """(exit, wall s, peak RSS MB) of ``kvchaos judge`` in a child of its own (``/usr/bin/time``'s %M)."""
    t0 = time.monotonic()
    r = subprocess.run(["/usr/bin/time", "-f", "MAXRSS_KB %M", sys.executable, "-m", "kvchaos", "judge", str(path)],
                       cwd=str(repo), capture_output=True, text=True, timeout=1800,
                       env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    wall = time.monotonic() - t0
    kb = next((int(x.split()[1]) for x in r.stderr.splitlines() if x.startswith("MAXRSS_KB ")), 0)
    return r.returncode, wall, kb / 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--victims", type=int, default=3000)
    ap.add_argument("--repo", type=Path, default=REPO)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvchaos-scale-") as tmp:
        for name, fault, victims in (("clean", False, 0), ("fault-every-request", True, 0),
                                     ("victims", True, a.victims)):
            p = Path(tmp) / f"{name}.jsonl"
            n = write(p, a.lines, fault, victims)
            rc, wall, mb = judge(a.repo, p)
            rows.append({"log": name, "lines": n, "exit": rc, "wall_s": round(wall, 1), "peak_mb": round(mb)})
    base = rows[0]["wall_s"] or 1e-9
    print("| log | lines | exit | wall s | peak MB | x clean |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        r["ratio"] = round(r["wall_s"] / base, 2)
        print(f"| {r['log']} | {r['lines']} | {r['exit']} | {r['wall_s']} | {r['peak_mb']} | {r['ratio']} |")
    if a.json:
        a.json.write_text(json.dumps({"repo": str(a.repo), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
