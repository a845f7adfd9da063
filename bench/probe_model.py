"""Leak sensitivity of the probe model of one KV layout, measured through the real SGLang
prefill/decode cluster (prefill + decode + router, the in-engine fault agent loaded).

Prints, and writes with ``--json``, each with hits/trials:
  * own-canary echo rate, 32 tokens .. 90 % of the context (target >= 99 %);
  * foreign-canary sensitivity over concatenated contexts (target >= 95 %);
  * stale-KV sensitivity measured inside SGLang with the agent — what the incident does: decode's
    pages are filled with donor requests' KV, the victim's transfer is cut short by the agent's
    ``short`` fault (prefill sends its first pages, decode reports success) and decode generates
    over pages last written for other requests. Which donor tokens sit in the victim's unwritten
    pages is reconstructed from the agent's transfer events (decode page indices); a trial counts
    when a whole donor canary lies there in consecutive slots in order, and is a hit when the reply
    recites it (``kvchaos.probe.measure.measure_stale_kv``). Reported as measured: no target;
  * determinism across runs and batch compositions;
  * the random tiny model (single server, the layout's page size and dtype) as the blind baseline
    (expected 0 %);
plus the layout, backend, versions and wall times.

Usage: python bench/probe_model.py [--profile cpu] [--layout mla-p64-bf16] [--backend mooncake_tcp]
                                   [--quick] [--json OUT.json] [--echo N] [--contamination N] [--stale N]
One layout per run (default: the profile's own). The pool is at least twice the context (8192 tokens
on the CPU profile) so 90 %-of-context prompts are admitted. Exit 0 when the echo and foreign targets
hold, the baseline is blind and the stale-KV rate was measured (at least one eligible trial); else 1.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from faults import AGENT_MODULE, open_network_proxy  # noqa: E402 - the fault layer's proxy and agent
from faults.client import AgentClient  # noqa: E402
from kvchaos.cluster import Cluster, ClusterSpec, SingleServer  # noqa: E402
from kvchaos.cluster.layouts import LayoutError, apply, parse  # noqa: E402
from kvchaos.cluster.spec import TRANSFER_BACKENDS, SpecError  # noqa: E402
from kvchaos.probe import recipe_digest  # noqa: E402
from kvchaos.probe.measure import (  # noqa: E402
    CONTAMINATION_THRESHOLD,
    ECHO_THRESHOLD,
    measure_contamination,
    measure_determinism,
    measure_echo,
    measure_stale_kv,
)

REPO = Path(__file__).resolve().parents[1]
QUICK = {"echo": 50, "contamination": 50, "stale": 20, "determinism": 24}
FULL = {"echo": 500, "contamination": 300, "stale": 100, "determinism": 24}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="cpu", help="cluster profile (kvchaos/profiles/<name>.toml or a path)")
    ap.add_argument("--layout", default=None,
                    help="KV layout <attention>-p<page size>-<dtype>, e.g. mla-p64-bf16 (default: the profile's own)")
    ap.add_argument("--backend", default=None, choices=TRANSFER_BACKENDS,
                    help="KV transfer backend (default: the profile's)")
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK['echo']}/{QUICK['contamination']}/{QUICK['stale']} echo/foreign/stale trials")
    ap.add_argument("--echo", type=int, default=None)
    ap.add_argument("--contamination", type=int, default=None)
    ap.add_argument("--stale", type=int, default=None, help="stale-KV trials (each fills decode's pool once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_out", default=None, metavar="OUT.json", help="write the figures here")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """Arguments, with ``spec`` (the profile, layout applied, pool for 90 %-of-context prompts) and
    ``layout`` resolved; a bad profile, layout or backend exits 2 naming what is wrong."""
    ap = parser()
    args = ap.parse_args(argv)
    counts = QUICK if args.quick else FULL
    for k in ("echo", "contamination", "stale"):
        if getattr(args, k) is None:
            setattr(args, k, counts[k])
        elif getattr(args, k) < 0:
            ap.error(f"--{k} must be >= 0")
    args.determinism = counts["determinism"]
    try:
        base = ClusterSpec.load(args.profile)
        layout = parse(args.layout) if args.layout else parse(base.layout)
    except (LayoutError, SpecError) as e:
        ap.error(str(e))
    data = base.to_dict()
    ps = layout.page_size
    data["pool_tokens"] = math.ceil(max(base.pool_tokens, 2 * base.context_length) / ps) * ps
    if args.backend:
        data["transfer_backend"] = args.backend
    try:
        data = apply(data, layout)
        args.spec = ClusterSpec.from_dict(data, source=f"profile {args.profile} with layout {layout.name}")
    except (LayoutError, SpecError) as e:
        ap.error(str(e))
    args.layout = layout.name
    return args


def versions(spec: ClusterSpec) -> dict:
    """Package versions of the engine's interpreter (read from metadata, nothing imported) and the
    harness commit."""
    code = ("import json, sys\nfrom importlib import metadata as m\nout = {'python': sys.version.split()[0]}\n"
            "for p in ('sglang', 'sglang-router', 'torch', 'transformers', 'mooncake-transfer-engine-non-cuda',"
            " 'mooncake-transfer-engine', 'nixl'):\n"
            "    try:\n        out[p] = m.version(p)\n    except m.PackageNotFoundError:\n        pass\n"
            "print(json.dumps(out))")
    try:
        out = json.loads(subprocess.run([spec.python, "-c", code], capture_output=True, text=True,
                                        timeout=60, check=True).stdout)
    except (subprocess.SubprocessError, OSError, json.JSONDecodeError) as e:
        out = {"error": repr(e)[:200]}
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        out["kvchaos"] = rev + ("+dirty" if dirty else "")
    except (subprocess.SubprocessError, OSError):
        pass
    out["platform"] = platform.platform()
    return out


def _lengths(ctx: int) -> list[int]:
    """Prompt lengths of the echo and foreign trials: 32 tokens .. 90 % of the context."""
    return sorted({min(n, ctx * 9 // 10) for n in (32, 48, 64, 128, 256, 512, 1024, 2048, 3072)} | {ctx * 9 // 10})


def _info(args: argparse.Namespace, spec: ClusterSpec) -> dict:
    """What the figures were measured on: layout, profile, backend, pool, model, recipe, versions, counts."""
    kind = spec.model.partition(":")[2] or "mha"
    return {"layout": args.layout, "profile": args.profile, "backend": spec.transfer_backend,
            "pool_tokens": spec.pool_tokens, "context_length": spec.context_length, "page_size": spec.page_size,
            "dtype": spec.dtype, "model": spec.model, "probe_recipe": recipe_digest(kind),
            "versions": versions(spec), "counts": {k: getattr(args, k) for k in ("echo", "contamination", "stale",
                                                                                   "determinism")}}


def _measure_pd(args, spec: ClusterSpec, d: str, lengths: list[int], log, rows: dict, timings: dict) -> None:
    """Echo, foreign, determinism and stale-KV through the PD cluster (into ``rows`` / ``timings``); the
    agent's faults are healed and the cluster stopped whatever happens."""
    ctx = spec.context_length
    t0 = time.monotonic()
    c = Cluster(spec, d, proxy_factory=open_network_proxy, agent_module=AGENT_MODULE).start()
    timings["cluster_start_s"] = round(time.monotonic() - t0, 1)
    agent = AgentClient(c.agent_dir)
    try:
        url = c.endpoints.router
        steps = [("own_echo", lambda: measure_echo(url, args.echo, lengths, seed=args.seed)),
                 ("foreign", lambda: measure_contamination(url, args.contamination, lengths[3:], seed=args.seed + 1)),
                 ("determinism", lambda: measure_determinism(url, args.determinism, seed=args.seed + 2)),
                 ("stale_kv", lambda: measure_stale_kv(url, agent, args.stale, spec.pool_tokens, spec.page_size,
                                                       ctx, seed=args.seed + 3, progress=log))]
        for name, fn in steps:
            t0 = time.monotonic()
            rows[name] = fn()
            timings[f"{name}_s"] = round(time.monotonic() - t0, 1)
            log(f"{rows[name]}   ({timings[f'{name}_s']:.0f} s)")
    finally:
        try:
            still = agent.armed()
            agent.heal_all()
            if still:
                log(f"healed faults still armed: {still}")
        finally:
            t0 = time.monotonic()
            c.stop()
            timings["cluster_stop_s"] = round(time.monotonic() - t0, 1)


def _measure_baseline(args, spec: ClusterSpec, d: str, lengths: list[int], log, rows: dict, timings: dict) -> None:
    """The random tiny model on a single server (the layout's page size and dtype): the blind baseline."""
    tiny_spec = ClusterSpec.from_dict({**spec.to_dict(), "model": "tiny:0", "name": f"{spec.name}-tiny"})
    log(f"random tiny model (single server, page size {spec.page_size}, {spec.dtype}): the blind baseline")
    t0 = time.monotonic()
    tiny = SingleServer(tiny_spec, d).start()
    try:
        rows["tiny_echo"] = measure_echo(tiny.url, 50, lengths[:8], seed=args.seed)
        rows["tiny_foreign"] = measure_contamination(tiny.url, 50, lengths[3:8], seed=args.seed + 1)
    finally:
        tiny.stop()
    timings["baseline_s"] = round(time.monotonic() - t0, 1)


def _print_rates(args, spec: ClusterSpec, info: dict, rows: dict, timings: dict, wall: float) -> None:
    """The figures: every rate (with its first failures), the stale-KV trial's breakdown, the wall times."""
    stale = rows["stale_kv"]
    n = stale.notes
    print(f"\nprobe model, layout {args.layout}, through SGLang PD (prefill+decode+router, {spec.transfer_backend}, "
          f"pool {spec.pool_tokens}, context {spec.context_length}); {info['versions'].get('sglang', '?')}:")
    for k in ("own_echo", "foreign", "stale_kv", "determinism", "tiny_echo", "tiny_foreign"):
        r = rows[k]
        fails = [{k2: (v[:60] if isinstance(v, str) else v) for k2, v in f.items()} for f in r.failures[:2]]
        print(f"  {r}" + (f"   first failures: {fails}" if fails and not k.startswith("tiny") else ""))
    print(f"  stale-KV: {n['attempted']} trials, {stale.trials} with a whole donor canary in the stale pages, "
          f"{n['no_whole_canary']} without ({n['excluded_with_donor_canary_in_reply']} of those still recited a "
          f"donor canary), {n['errors']} errors; whole stale canaries recited {n['whole_canaries_recited']}/"
          f"{n['whole_canaries']}; {n['donors']} donors, {n['donor_tokens']} donor tokens; prefill kept "
          f"{n['keep_pages']} page(s) of {n['page_size']}; stale slots known "
          f"{n['stale_slots'] - n['unknown_stale_slots']}/{n['stale_slots']}")
    coll = stale.trials - n["without_tail_collision"]
    print(f"  stale-KV by position collision (a donor token written at a position the probe's offset heads read "
          f"while the victim recites): with {n['hits_with_tail_collision']}/{coll}, "
          f"without {n['hits_without_tail_collision']}/{n['without_tail_collision']}; own canary recited intact "
          f"in {n['own_recital_intact']}/{stale.trials} (hits among them {n['hits_with_own_recital_intact']})")
    print(f"  wall time {wall:.0f} s ({', '.join(f'{k} {v}' for k, v in timings.items())})")


def _unmet(args, rows: dict) -> list[str]:
    """Why the targets are not met (empty: they are)."""
    echo, cont, stale = rows["own_echo"], rows["foreign"], rows["stale_kv"]
    why = []
    if echo.rate < ECHO_THRESHOLD:
        why.append(f"own echo {100 * echo.rate:.1f} % < {100 * ECHO_THRESHOLD:.0f} %")
    if cont.rate < CONTAMINATION_THRESHOLD:
        why.append(f"foreign {100 * cont.rate:.1f} % < {100 * CONTAMINATION_THRESHOLD:.0f} %")
    if rows["tiny_echo"].hits or rows["tiny_foreign"].hits:
        why.append("the random baseline is not blind")
    if args.stale and not stale.trials:
        why.append("stale-KV not measured: no trial had a whole donor canary in the stale pages")
    if rows["determinism"].rate < 1.0:
        why.append("not deterministic")
    return why


def main(argv=None) -> int:
    args = parse_args(argv)
    spec = args.spec
    t_all = time.monotonic()
    lengths = _lengths(spec.context_length)
    info = _info(args, spec)
    log = lambda msg: print(f"[{time.monotonic() - t_all:7.1f} s] {msg}", flush=True)  # noqa: E731
    log(f"layout {args.layout}: starting PD cluster ({spec.transfer_backend}, pool {spec.pool_tokens}, "
        f"context {spec.context_length}, model {spec.model})")
    rows, timings = {}, {}
    d = tempfile.mkdtemp(prefix="kvc-probe-bench-")  # kept (with the engines' logs) when the run fails
    ok_run = False
    try:
        _measure_pd(args, spec, d, lengths, log, rows, timings)
        _measure_baseline(args, spec, d, lengths, log, rows, timings)
        ok_run = True
    finally:
        if ok_run:
            shutil.rmtree(d, ignore_errors=True)
        else:
            print(f"run failed: the cluster's logs are kept in {d}/logs", file=sys.stderr, flush=True)
    for k in ("tiny_echo", "tiny_foreign"):
        rows[k].name = f"random tiny model: {rows[k].name}"
    wall = time.monotonic() - t_all
    _print_rates(args, spec, info, rows, timings, wall)
    why = _unmet(args, rows)
    print("  " + ("targets met" if not why else "NOT MET: " + "; ".join(why)))
    if args.json_out:
        out = {**info, "rates": {k: r.to_dict() for k, r in rows.items()}, "timings_s": timings,
               "wall_s": round(wall, 1), "ok": not why, "why": why}
        Path(args.json_out).write_text(json.dumps(out, indent=1, default=str))
    return 0 if not why else 1


if __name__ == "__main__":
    sys.exit(main())
