"""How long a request's KV takes to go from prefill to decode, per KV layout — the race windows.

Reads experiment histories (``events.jsonl`` files, or run directories holding them) and, for every
request whose KV prefill wrote, pairs the engines' own events (the in-engine agent's):

  * ``write``: one Mooncake write (``write_end``: ``wall_start`` to ``wall``), its pages and bytes;
  * ``reserved-unwritten``: decode pre-allocated the request's pages (``kv_prealloc``) until prefill's last
    write into them ended — the window in which an abort, a delay or an early free of those pages races
    the transfer (``early_free``, ``double_alloc``, the GLM-5.3 stale pages);
  * ``transfer``: prefill's first ``transfer_start`` of the request to its last ``write_end``.

Bytes are the layout's KV bytes per token (its probe's geometry, :mod:`kvchaos.probe.like`) times the
pages' tokens. One table per layout with medians and 90th percentiles, then each layout's medians as a
ratio of the first layout's (the baseline: name it first).

Usage: python bench/transfer_window.py RUN_OR_EVENTS [...] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvchaos.cluster.layouts import DTYPES, parse  # noqa: E402
from kvchaos.history import agent_kind  # noqa: E402
from kvchaos.probe import ensure_probe, like  # noqa: E402


def histories(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(p.rglob("*events.jsonl"))
        elif p.exists():
            out.append(p)
        else:
            raise SystemExit(f"transfer_window: {p}: no such file or directory")
    return out


def bytes_per_token(layout: str) -> int | None:
    """KV bytes one token holds in ``layout``'s pool (all layers); None for a layout that is not a probe's."""
    try:
        lay = parse(layout)
    except ValueError:
        return None
    dtype = "fp8_e4m3" if lay.dtype == "fp8" else DTYPES[lay.dtype]
    geo = like.geometry(lay.like) if lay.like else like.load_path(str(ensure_probe(lay.attention) / "config.json"))
    return geo.bytes_per_token(dtype)


def measure(path: Path) -> tuple[str | None, list[dict], list[dict]]:
    """(layout, writes, requests) of one history."""
    writes, prealloc, first_start, last_end = [], {}, {}, {}
    layout = None
    with open(path) as f:
        for line in f:
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue  # a cut last line
            if e.get("ev") == "experiment":
                layout = (e.get("layout") or {}).get("kv_layout")
                continue
            kind = agent_kind(e) if e.get("source") == "agent" else None
            rid = e.get("rid")
            if kind == "write_end" and isinstance(e.get("wall_start"), (int, float)):
                tokens = int(e.get("pages") or 0) * int(e.get("page_size") or 1)
                writes.append({"s": e["wall"] - e["wall_start"], "tokens": tokens})
                last_end[rid] = max(last_end.get(rid, 0.0), e["wall"])
            elif kind == "kv_prealloc":
                prealloc.setdefault(rid, e["wall"])
            elif kind == "transfer_start":
                first_start.setdefault(rid, e["wall"])
    reqs = [{"rid": rid, "transfer_s": end - first_start[rid] if rid in first_start else None,
             "unwritten_s": end - prealloc[rid] if rid in prealloc else None} for rid, end in last_end.items()]
    return layout, writes, reqs


def _q(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(paths: list[Path]) -> dict[str, dict]:
    by: dict[str, dict] = defaultdict(lambda: {"histories": 0, "writes": [], "requests": []})
    for p in paths:
        layout, writes, reqs = measure(p)
        if layout is None or not writes:
            continue
        by[layout]["histories"] += 1
        by[layout]["writes"] += writes
        by[layout]["requests"] += reqs
    out = {}
    for layout, d in by.items():
        bpt = bytes_per_token(layout)
        ws, rs = d["writes"], d["requests"]
        mb = [w["tokens"] * bpt / 1e6 for w in ws] if bpt else []
        rate = [w["tokens"] * bpt / w["s"] / 1e6 for w in ws if bpt and w["s"] > 0 and w["tokens"]]
        out[layout] = {
            "histories": d["histories"], "writes": len(ws), "requests": len(rs), "bytes_per_token": bpt,
            "write_ms": {"p50": _ms(_q([w["s"] for w in ws], .5)), "p90": _ms(_q([w["s"] for w in ws], .9))},
            "write_mb": {"p50": _r(_q(mb, .5)), "p90": _r(_q(mb, .9))},
            "write_mb_per_s": {"p50": _r(_q(rate, .5))},
            "transfer_ms": {"p50": _ms(_q([r["transfer_s"] for r in rs], .5)),
                            "p90": _ms(_q([r["transfer_s"] for r in rs], .9))},
            "reserved_unwritten_ms": {"p50": _ms(_q([r["unwritten_s"] for r in rs], .5)),
                                      "p90": _ms(_q([r["unwritten_s"] for r in rs], .9))},
        }
    return out


def _ms(s):
    return None if s is None else round(s * 1000, 1)


def _r(x):
    return None if x is None else round(x, 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="run directories or events.jsonl files (the baseline layout's first)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    paths = histories(args.paths)
    rows = summarize(paths)
    if not rows:
        raise SystemExit(f"transfer_window: no KV write recorded in {len(paths)} histories (the in-engine agent's "
                         "write_end events): was the agent on?")
    first = next(iter(rows))  # the baseline: summarize keeps the layouts in the order the paths name them
    order = [first] + sorted(k for k in rows if k != first)
    if args.json:
        print(json.dumps({k: rows[k] for k in order}, indent=2))
        return 0
    cols = ("write_ms", "write_mb", "transfer_ms", "reserved_unwritten_ms")
    print(f"{'layout':30s} {'B/token':>8s} {'writes':>6s} {'reqs':>5s}  " + "  ".join(f"{c + ' p50/p90':>28s}" for c in cols)
          + f"  {'MB/s p50':>9s}")
    for k in order:
        r = rows[k]
        print(f"{k:30s} {r['bytes_per_token'] or 0:>8,d} {r['writes']:>6d} {r['requests']:>5d}  "
              + "  ".join(f"{str(r[c]['p50']) + ' / ' + str(r[c]['p90']):>28s}" for c in cols)
              + f"  {str(r['write_mb_per_s']['p50']):>9s}")
    base = rows[first]
    print(f"\nmedians as a ratio of {first}'s:")
    for k in order[1:]:
        r = rows[k]
        ratio = {c: (round(r[c]["p50"] / base[c]["p50"], 1) if r[c]["p50"] and base[c]["p50"] else None) for c in cols}
        print(f"  {k:30s} " + "  ".join(f"{c} x{ratio[c]}" for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
