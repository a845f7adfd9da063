"""Canary scan: the isolation oracle's Aho-Corasick pass vs a naive substring loop, 100k live canaries.

Prints build time, scan time over N responses for both, the speed-up ratio, and checks that both
find the same hits. Usage: python bench/canary_scan.py [--canaries 100000] [--responses 300]
"""

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvchaos import canary  # noqa: E402
from kvchaos.oracles.isolation import automaton, scan  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--canaries", type=int, default=100_000)
    ap.add_argument("--responses", type=int, default=300)
    args = ap.parse_args()
    rng = random.Random(0)
    plans = {}
    for i in range(args.canaries // 2):
        plans[f"r{i}"] = {"tenant": f"t{i % 64}", "canaries": canary.mint(rng, 2)}
    all_payloads = [canary.payload(c) for p in plans.values() for c in p["canaries"]]
    texts = []
    for _ in range(args.responses):
        picks = rng.sample(all_payloads, 3)
        texts.append(canary.filler(rng, 300) + "".join(p + "][" for p in picks) + canary.filler(rng, 200))

    t0 = time.perf_counter()
    auto = automaton([(rid, p["tenant"], c, None) for rid, p in plans.items() for c in p["canaries"]], partial_len=8)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    ac_hits = [sorted({k for _, _, k, own in scan(t, auto) if any(o[3] == "exact" for o in own)}) for t in texts]
    ac = time.perf_counter() - t0

    t0 = time.perf_counter()
    naive_hits = [sorted(p for p in all_payloads if p in t) for t in texts]
    naive = time.perf_counter() - t0
    assert ac_hits == naive_hits, "Aho-Corasick and the naive loop disagree"
    print(f"{len(all_payloads)} live canaries (+ {3 * len(all_payloads)} partial windows), {len(texts)} responses")
    print(f"aho-corasick: build {build:.2f} s, scan {1e3 * ac:.1f} ms ({1e6 * ac / len(texts):.0f} us/response)")
    print(f"naive loop:   scan {1e3 * naive:.0f} ms ({1e6 * naive / len(texts):.0f} us/response), exact hits only")
    print(f"scan speed-up aho-corasick/naive = {naive / ac:.0f}x; break-even after {build / (naive / len(texts) - ac / len(texts)):.0f} responses")


if __name__ == "__main__":
    main()
