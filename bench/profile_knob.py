"""One CPU-profile knob, A against B: the clean control alone on a fresh cluster at each value in turn.

    python bench/profile_knob.py KVCHAOS_TRANSFER_WAIT_NICE 0 19 [--pairs 2] [--test NODEID]

Each run is ``pytest NODEID --kvchaos-seed 0 --kvchaos-profile P`` where P is the CPU profile with the
knob (a ``[cluster.env]`` key) set to the value; the runs alternate A, B, A, B, ... so a machine that
drifts over the hour drifts under both. Prints each run's wall time and the machine's busy CPU-seconds
(``/proc/stat``), then B's means over A's. Keep the machine otherwise quiet while it runs.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "kvchaos" / "profiles" / "cpu.toml"


def busy_cpu_s() -> float:
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (f[0] + f[1] + f[2] + f[5] + f[6]) / 100  # user nice system irq softirq, in USER_HZ


def profile_with(knob: str, value: str, text: str) -> str:
    """The profile's text with ``knob = "value"`` under ``[cluster.env]`` (replaced where it is set)."""
    line = f'{knob} = "{value}"'
    pat = re.compile(rf"^{re.escape(knob)}\s*=.*$", re.M)
    if pat.search(text):
        return pat.sub(line, text, count=1)
    if "[cluster.env]\n" not in text:
        raise SystemExit(f"{PROFILE}: no [cluster.env] table to set {knob} in")
    return text.replace("[cluster.env]\n", f"[cluster.env]\n{line}\n", 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("knob", help="a [cluster.env] key of the CPU profile")
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--test", default="suites/test_clean_control.py")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"[A-Z][A-Z0-9_]*", args.knob):
        ap.error(f"knob {args.knob!r} is not an environment variable name")
    if args.pairs < 1:
        ap.error("--pairs must be >= 1")
    text = PROFILE.read_text()
    got: dict[str, list[tuple[float, float]]] = {args.a: [], args.b: []}
    with tempfile.TemporaryDirectory(prefix="kvchaos-knob-") as tmp:
        for i in range(args.pairs):
            for value in (args.a, args.b):
                prof = Path(tmp) / f"cpu-{value}.toml"
                prof.write_text(profile_with(args.knob, value, text))
                log = Path(tmp) / f"run-{i}-{value}.log"
                c0, t0 = busy_cpu_s(), time.monotonic()
                with open(log, "w") as fh:
                    rc = subprocess.call([sys.executable, "-m", "pytest", args.test, "-p", "no:cacheprovider", "-q",
                                          "--kvchaos-seed", "0", "--kvchaos-profile", str(prof)],
                                         cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
                wall, cpu = time.monotonic() - t0, busy_cpu_s() - c0
                print(f"{args.knob}={value:<6} rc={rc} wall={wall:7.1f} s cpu={cpu:6.0f} s", flush=True)
                if rc != 0:
                    print(log.read_text()[-3000:], file=sys.stderr)
                    return rc
                got[value].append((wall, cpu))
    mean = {v: (sum(w for w, _ in r) / len(r), sum(c for _, c in r) / len(r)) for v, r in got.items()}
    (wa, ca), (wb, cb) = mean[args.a], mean[args.b]
    print(f"{args.knob}: {args.b} against {args.a}, means of {args.pairs}: wall {wb:.1f} / {wa:.1f} s = "
          f"{wb / wa:.2f}x; CPU {cb:.0f} / {ca:.0f} s = {cb / ca:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
