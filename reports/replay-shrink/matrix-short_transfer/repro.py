"""Repro written by ``kvchaos shrink``: starts the cluster recorded in minimal.json beside this file,
arms the recorded faults, sends the minimal plans and prints the verdicts (kvchaos.shrink.reproduce).
Needs kvchaos and the engine: ``python repro.py [--times N]``, each run on a fresh cluster (the shrink ran
every attempt as on one: caches flushed, canaries of its own, so the minimal keeps the traffic its
pages need); exit 0 when every run failed the same way."""

import argparse
import sys
from pathlib import Path

from kvchaos.shrink import reproduce

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--times", type=int, default=1)
    n = ap.parse_args().times
    sys.exit(0 if reproduce(Path(__file__).resolve().parent, n) == n else 1)
