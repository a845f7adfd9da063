"""Provoke sglang-router-drops-cache-salt against a running PD cluster (e.g. `kvchaos up`).

    python provoke.py ROUTER_URL PREFILL_URL DECODE_URL BOOTSTRAP_PORT

Sends, through the router and then straight to prefill + decode (the router's own PD dispatch, by hand:
the same body to both with bootstrap_host/port/room), a prompt sharing a 400-character prefix with
the one before it, under salts None, None, "A", "B", "A", and an int salt. Prints HTTP status and
meta_info.cached_tokens per request. A router that forwards cache_salt shows what the direct path
shows: 0 cached for the first request of each salt, 400 only within a salt, HTTP 400 for the int."""

import concurrent.futures as cf
import random
import sys

import requests

from kvchaos import canary
from kvchaos.probe import prompt

ROUTER, PREFILL, DECODE, BOOT = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
SALTS = [None, None, "A", "B", "A", 5]


def body(text, salt):
    b = {"text": text, "sampling_params": {"max_new_tokens": 30, "temperature": 0}}
    return b if salt is None else {**b, "cache_salt": salt}


def via_router(text, salt):
    r = requests.post(ROUTER + "/generate", json=body(text, salt), timeout=60)
    return r.status_code, (r.json().get("meta_info") or {}).get("cached_tokens") if r.status_code == 200 else None


def direct(text, salt, rng, pool):
    b = {**body(text, salt), "bootstrap_host": "127.0.0.1", "bootstrap_port": BOOT, "bootstrap_room": rng.randrange(2**62)}
    fp = pool.submit(requests.post, PREFILL + "/generate", json=b, timeout=60)
    fd = pool.submit(requests.post, DECODE + "/generate", json=b, timeout=60)
    fp.result()
    r = fd.result()
    return r.status_code, (r.json().get("meta_info") or {}).get("cached_tokens") if r.status_code == 200 else None


def main():
    with cf.ThreadPoolExecutor(2) as pool:
        for name, send in (("router", via_router), ("direct", None)):
            rng = random.Random(f"{name}-{random.random()}")  # fresh prefixes per run: nothing cached before
            shared = canary.filler(rng, 400)
            for salt in SALTS:
                text = shared + prompt(rng, 120, canary.mint(rng, 1))
                got = send(text, salt) if send else direct(text, salt, rng, pool)
                print(f"{name:6s} salt={salt!r:5s} HTTP {got[0]} cached_tokens={got[1]}")


if __name__ == "__main__":
    main()
