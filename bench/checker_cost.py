"""What judging costs beside what it judges: per experiment log, the seconds each checker takes over the
whole log (median of ``--repeat`` runs, the history indexed once, as the runner does) and that as a share
of the experiment's own wall time (its header to its last record: the method, the rollback, the steady
state after, the judging).

The runner judges a log twice over: once whole after the method, and once reply by reply while the
method runs (the live watch: isolation and integrity, each reply judged once as it ends — together about
one more whole pass, on the other core while the engines work). So a checker with a live judge costs
about twice its whole-log time; the table's ``added`` column is that: 2 x the time for a checker that
judges live, 1 x for one that does not.

Usage: python bench/checker_cost.py RUN_DIR_OR_LOG [...] [--checkers integrity,page_ownership,isolation]
                                    [--repeat 5] [--min-requests 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from kvchaos import oracles  # noqa: E402
from kvchaos.history import History, read_records  # noqa: E402

BUILT = {"integrity": oracles.Integrity, "page_ownership": oracles.PageOwnership, "isolation": oracles.Isolation,
         "kv_lifecycle": oracles.KVLifecycle, "sensitivity": oracles.Sensitivity}


def logs(paths) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += sorted(p.rglob("*.events.jsonl")) if p.is_dir() else [p]
    return out


def wall_of(records) -> float | None:
    walls = [e["wall"] for e in records if isinstance(e.get("wall"), (int, float))]
    head = next((e for e in records if e.get("ev") == "experiment"), None)
    if not walls or head is None or not isinstance(head.get("wall"), (int, float)):
        return None
    return max(walls) - head["wall"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--checkers", default="integrity,page_ownership,isolation")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--min-requests", type=int, default=50)
    args = ap.parse_args()
    names = args.checkers.split(",")
    bad = [n for n in names if n not in BUILT]
    if bad:
        ap.error(f"--checkers: unknown {bad}; one of {sorted(BUILT)}")
    rows = []
    for path in logs(args.paths):
        records = read_records(path)
        h = History(records, source=str(path))
        wall = wall_of(records)
        if wall is None or len(h.plans) < args.min_requests:
            continue
        row = {"log": path.name, "requests": len(h.plans), "wall_s": wall}
        for n in names:
            c = BUILT[n]()
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                c.check(h)
                times.append(time.perf_counter() - t0)
            s = statistics.median(times)
            live = c.live({}, None) is not None
            row[n] = (s, (2 if live else 1) * s / wall)
        rows.append(row)
    if not rows:
        print("no experiment log with a header and enough requests", file=sys.stderr)
        return 2
    head = " | ".join(f"{n} s | {n} added" for n in names)
    print(f"| log | requests | wall s | {head} |")
    print("|---|---|---|" + "---|---|" * len(names))
    for r in rows:
        cells = " | ".join(f"{r[n][0]:.3f} | {100 * r[n][1]:.2f} %" for n in names)
        print(f"| {r['log']} | {r['requests']} | {r['wall_s']:.1f} | {cells} |")
    for n in names:
        worst = max(rows, key=lambda r: r[n][1])
        print(f"{n}: at most {100 * worst[n][1]:.2f} % added ({worst['log']}); "
              f"median {100 * statistics.median(r[n][1] for r in rows):.2f} % over {len(rows)} logs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
