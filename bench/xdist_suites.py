"""The default suites on pytest-xdist workers: one cluster per worker, the memory each worker needs,
and nothing left behind — after a normal end, or after a SIGKILL of pytest mid-run.

Runs ``pytest suites -n N`` with ``make test``'s cluster markers and seed, and every 2 s sums the
proportional set size (PSS, so pages a forked engine shares are not counted twice) of each worker's
process tree: the worker, its SGLang engines, routers, reference servers and reaper. Every process
seen in a tree is remembered (pid and start time) and checked for survivors when pytest has ended.

Prints, from this one run: the outcome line, the wall time, each worker's peak PSS and the machine's
lowest MemAvailable, how many such workers this machine's memory holds (MemTotal / the largest
worker peak), and the processes left alive (0 is the only pass). ``--sigkill-after S`` kills the
controlling pytest with SIGKILL S seconds after it started (pick S past the clusters' start: the
suites are running) and waits up to 90 s for every remembered process to go. ``--serial`` also runs
the same suites without xdist first and prints the wall-time ratio.

Usage: python bench/xdist_suites.py [-n 2] [--sigkill-after S] [--serial] [-- extra pytest args]
Exit status: 0 when pytest passed (or was killed on purpose) and nothing was left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from kvchaos.cluster.reaper import _still_same, proc_table, related  # noqa: E402 - the reaper's own process table

MARKERS = "cluster and not slow and not gpu"  # make test's cluster session


def pss_kib(pid: int) -> int:
    try:
        m = re.search(r"^Pss:\s+(\d+) kB", Path(f"/proc/{pid}/smaps_rollup").read_text(), re.M)
        return int(m.group(1)) if m else 0
    except OSError:
        return 0


def mem_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M).group(1))


def run(n: int, extra: list[str], run_id: str, sigkill_after: float | None, out: Path) -> dict:
    env = {**os.environ, "KVCHAOS_RUN_ID": run_id, "KVCHAOS_MATRIX_TRIALS": "1", "KVCHAOS_MATRIX_CLEAN_TRIALS": "1"}
    argv = [sys.executable, "-m", "pytest", "suites", "-m", MARKERS, "-p", "no:cacheprovider", "--kvchaos-seed", "0",
            *(["-n", str(n)] if n > 1 else []), *extra]
    log = out / f"{run_id}.pytest.log"
    t0 = time.monotonic()
    p = subprocess.Popen(argv, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                         start_new_session=True)
    seen: dict[int, str] = {}  # pid -> start time, every process of a worker's tree
    peak: dict[int, int] = {}  # worker pid -> peak PSS (KiB)
    peak_total, min_avail, killed, done_at_kill = 0, mem_kib("MemAvailable"), False, None
    try:
        while p.poll() is None:
            table = proc_table()
            workers = [pid for pid, (pp, *_r) in table.items() if pp == p.pid] if n > 1 else [p.pid]
            total = 0
            for w in workers:
                tree = related({w}, (), table)  # the worker and everything it started: pid -> start time
                for q, st in tree.items():
                    seen.setdefault(q, st)
                kib = sum(pss_kib(q) for q in tree)
                peak[w] = max(peak.get(w, 0), kib)
                total += kib
            peak_total = max(peak_total, total)
            min_avail = min(min_avail, mem_kib("MemAvailable"))
            if sigkill_after is not None and time.monotonic() - t0 >= sigkill_after:
                done_at_kill = _tests_ended(run_id)
                os.kill(p.pid, signal.SIGKILL)  # the controller only: its workers must not outlive it
                killed = True
                p.wait(timeout=60)
                break
            time.sleep(2)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    wall = time.monotonic() - t0
    deadline = time.monotonic() + 90
    while True:
        alive = sorted(_still_same(seen, proc_table()) - {p.pid})
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(1)
    text = log.read_text(errors="replace")
    summary = next((ln.strip("= ") for ln in reversed(text.splitlines()) if re.search(r"\d+ (passed|failed)", ln)), "")
    return {"n": n, "rc": p.returncode, "killed": killed, "tests_ended_at_kill": done_at_kill, "wall_s": round(wall, 1),
            "summary": summary,
            "peak_gib": {f"worker{i}": round(v / 2**20, 2) for i, v in enumerate(peak.values())},
            "peak_total_gib": round(peak_total / 2**20, 2), "min_available_gib": round(min_avail / 2**20, 2),
            "processes_seen": len(seen), "left_alive": [_cmd(q) for q in alive], "log": str(log)}


def _tests_ended(run_id: str) -> int:
    """Tests the workers had finished (their progress logs under reports/<run id>-gwN/)."""
    n = 0
    for f in (REPO / "reports").glob(f"{run_id}*/progress.jsonl"):
        n += sum(1 for ln in f.read_text(errors="replace").splitlines() if '"ev": "end"' in ln)
    return n


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return ""


def main() -> int:
    # a SIGTERM of the bench must reach its pytest too (the finally in run() kills pytest's process group)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=2, help="xdist workers")
    ap.add_argument("--sigkill-after", type=float, default=None,
                    help="SIGKILL pytest this many seconds after it started")
    ap.add_argument("--serial", action="store_true", help="also run the suites without xdist first (wall ratio)")
    ap.add_argument("extra", nargs="*", help="more pytest arguments (after --)")
    a = ap.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = REPO / "reports" / f"{stamp}-xdist-bench"  # pytest's run dirs are reports/<stamp>-serial, -xdistN
    out.mkdir(parents=True)
    res = []
    if a.serial:
        res.append(run(1, a.extra, f"{stamp}-serial", None, out))
    res.append(run(a.n, a.extra, f"{stamp}-xdist{a.n}", a.sigkill_after, out))
    total = mem_kib("MemTotal") / 2**20
    for r in res:
        label = f"-n {r['n']}" if r["n"] > 1 else "serial"
        killed = f" (SIGKILLed on purpose after {r['tests_ended_at_kill']} tests ended)" if r["killed"] else ""
        print(f"{label}: {r['summary'] or 'no summary'}{killed}; "
              f"wall {r['wall_s']} s; rc {r['rc']}")
        per = ", ".join(f"{k} {v} GiB" for k, v in r["peak_gib"].items())
        top = max(r["peak_gib"].values(), default=0)
        print(f"  peak PSS per worker: {per}; all workers {r['peak_total_gib']} GiB; machine {total:.1f} GiB, "
              f"lowest MemAvailable {r['min_available_gib']} GiB; workers that fit by memory: "
              f"{int(total // top) if top else '-'}")
        print(f"  processes seen in worker trees: {r['processes_seen']}; left alive 90 s after pytest ended: "
              f"{len(r['left_alive'])}" + "".join(f"\n    {c}" for c in r["left_alive"]))
    if len(res) == 2 and res[1]["wall_s"] and not res[1]["killed"]:
        print(f"wall ratio serial / -n {a.n} = {res[0]['wall_s'] / res[1]['wall_s']:.2f}")
    (out / "result.json").write_text(json.dumps(res, indent=2))
    print(f"(details: {out}/result.json)")
    ok = all(not r["left_alive"] and (r["killed"] or r["rc"] == 0) for r in res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
