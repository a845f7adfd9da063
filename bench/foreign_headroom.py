"""Is a foreign canary seen within a victim's reply budget? Measured on the real PD cluster.

The probe recites the canaries in its context in order of their first character. A stale page puts a
foreign canary into a victim's context; if it sorts after the victim's own canaries and the reply
budget only covers the victim's own recital, the foreign one is cut off. This bench sends prompts
holding ``--own`` canaries of their own and one foreign canary (where a stale page would put it), a
third each sorting before, between and after the own ones, through the router, twice: with the budget
plans had before issue 29 (own recital + 2 tokens) and with today's (``kvchaos.probe.max_new_tokens``:
room for two foreign canaries beyond the own ones). Prints, per budget, how many replies show at least
8 characters of the foreign canary (the isolation checker's partial match), overall and by position,
and writes the figures as JSON.

Usage: python bench/foreign_headroom.py [--n 30] [--own 2] [--layout mha-p1-fp32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from faults import AGENT_MODULE, open_network_proxy  # noqa: E402 - the fault layer's network proxy
from kvchaos import canary, probe  # noqa: E402
from kvchaos.cluster import Cluster, ClusterSpec  # noqa: E402
from kvchaos.cluster.reaper import Reaper  # noqa: E402

POSITIONS = ("before", "between", "after")
BUDGETS = {"before issue 29 (own recital + 2)": lambda k: k * canary.LENGTH + 2,
           "today (kvchaos.probe.max_new_tokens)": probe.max_new_tokens}


def prompts(n: int, own: int, seed: int) -> list[dict]:
    """``n`` prompts: ``own`` canaries each plus one foreign canary whose first character sorts before,
    between or after the own ones (a third each)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        where = POSITIONS[i % 3]
        while True:
            cs = canary.mint(rng, own + 1)
            order = sorted(cs, key=lambda c: canary.ALPHABET.index(c[1]))
            foreign = {"before": order[0], "between": order[len(order) // 2], "after": order[-1]}[where]
            if where != "between" or own >= 2:
                break
        mine = [c for c in cs if c != foreign]
        out.append({"where": where, "own": mine, "foreign": foreign,
                    "text": probe.prompt(rng, rng.randrange(200, 500), cs)})
    return out


def seen(reply: str, c: str, window: int = 8) -> bool:
    pay = canary.payload(c)
    return any(pay[i:i + window] in reply for i in range(len(pay) - window + 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--own", type=int, default=2)
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--layout", default=None, help="a KV layout (kvchaos.cluster.layouts) [the profile's own]")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    spec = ClusterSpec.load("cpu")
    if args.layout:
        from kvchaos.cluster.layouts import apply, parse

        spec = ClusterSpec.from_dict(apply(spec.to_dict(), parse(args.layout)))
    ps = prompts(args.n, args.own, args.seed)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        reaper = Reaper(f"kvc-headroom-{int(time.time())}")
        c = Cluster(spec, Path(tmp), reaper=reaper, proxy_factory=open_network_proxy, agent_module=AGENT_MODULE).start()
        try:
            for name, budget in BUDGETS.items():
                got = {w: [0, 0] for w in POSITIONS}
                own_ok = 0
                for p in ps:
                    r = httpx.post(c.endpoints.router + "/generate", timeout=120, json={
                        "text": p["text"], "sampling_params": {"max_new_tokens": budget(len(p["own"])),
                                                               "temperature": 0}})
                    r.raise_for_status()
                    text = r.json()["text"]
                    got[p["where"]][1] += 1
                    got[p["where"]][0] += seen(text, p["foreign"])
                    own_ok += all(canary.payload(x) in text for x in p["own"])
                rows[name] = {"budget_tokens": budget(args.own),
                              "foreign_seen": sum(v[0] for v in got.values()), "of": len(ps),
                              "by_position": {w: f"{v[0]}/{v[1]}" for w, v in got.items()},
                              "own_recited": f"{own_ok}/{len(ps)}"}
        finally:
            left = c.stop()
            reaper.close()
    out = {"layout": spec.layout, "n": args.n, "own": args.own, "seed": args.seed, "budgets": rows,
           "measured": time.strftime("%Y-%m-%d %H:%M")}
    print(f"foreign canary (>= 8 characters) in replies with {args.own} own canaries, {args.n} prompts, "
          f"{spec.layout}, through sglang-router:")
    for name, r in rows.items():
        print(f"  {name:40s} budget {r['budget_tokens']:3d} tokens: {r['foreign_seen']}/{r['of']} "
              f"(before/between/after the own ones: {r['by_position']['before']}, {r['by_position']['between']}, "
              f"{r['by_position']['after']}); own recited {r['own_recited']}")
    if left:
        print(f"processes left after teardown: {left}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(main())
