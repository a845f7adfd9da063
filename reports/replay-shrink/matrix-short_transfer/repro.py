"""Repro written by ``kvchaos shrink``: starts the cluster recorded in minimal.json beside this file,
arms the recorded faults, sends the minimal plans and prints the verdicts (kvchaos.shrink.reproduce).
Needs kvchaos and the engine: ``python repro.py [--times N]`` (3 by default: on a fresh cluster a leak of
stale pages may need earlier traffic in the pool); exit 0 when any run failed the same way."""

import argparse
import sys
from pathlib import Path

from kvchaos.shrink import reproduce

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--times", type=int, default=3)
    sys.exit(0 if reproduce(Path(__file__).resolve().parent, ap.parse_args().times) else 1)
