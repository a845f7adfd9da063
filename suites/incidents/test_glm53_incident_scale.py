"""The GLM-5.3 incident at its own numbers: prefill's KV pool 681,280 tokens, context 1,048,576.

``suites/incidents/test_glm53_kv_leak.py`` runs the incident's shape small (pool 576, context 4096) in
every ``make test``. This runs it at the incident's size (``kvchaos.releases.SCALES["incident"]``), on
the MLA probe (DeepSeek-V3 latent geometry, 2 layers, page 64, bf16; served from a copy whose position
limits reach the context: ``kvchaos.probe.reaching``), in each release's own environment:

- **0.5.19** (pre-fix): expected the incident — the victim tenant's prompt (690,000 tokens: over prefill's
  pool, under the context) takes prefill's reject path, decode pre-allocates the whole prompt, receives
  one page, and answers HTTP 200 with other tenants' canaries (its reply budget is one canary: each
  decode step over its context is seconds long on CPU).
- **0.5.23**: expected no leak; what the client sees is recorded (``summary.json``).

120 requests of 15 other tenants go first: they move more tokens through decode than decode's pool has
beyond the victim's prompt, so decode's allocator has merged its freed (stale) pages back in before the
victim is pre-allocated (``releases.Scale``). Measured per run: wall time, the peak resident memory of
each role's process tree, the pools' memory model, the victims' pages as prefill sent them.

    kvchaos repro glm53 --scale largest-fit      # both releases (--scale incident: the incident's own)
    pytest suites/incidents/test_glm53_incident_scale.py -m slow -k "at-largest-fit and 0.5.19"

Scales (``kvchaos.releases.SCALES``): ``incident`` (the incident's own numbers) and ``largest-fit`` (the
same shape at 5/8: pool 425,792, context 655,360; the largest that fits a 24 GiB CPU machine). A scale
whose memory model (``Scale.need_bytes``) is over this machine's memory is skipped, saying so.
``slow``: not in ``make test`` (one cold start per release with GB-sized pools, then minutes of decode
over a context of hundreds of thousands of tokens on CPU).
"""

from __future__ import annotations

import json
import os
import time
from importlib import metadata

import pytest

from faults import FaultKit
from kvchaos import releases
from kvchaos.cluster import ClusterSpec
from kvchaos.cluster.layouts import apply, parse
from kvchaos.experiment import FAIL, PASS
from kvchaos.oracles import HttpSemantics, Isolation, Liveness, kv_pages_written
from kvchaos.suite import own_cluster, server_field
from kvchaos.workload import EventLog

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
LAYOUT = "mla-p64-bf16"  # the incident's model is MLA; production PD runs page 64
PREFIX_VERSION = "0.5.19"
FIXED_VERSION = "0.5.23"
MLA_BYTES_PER_TOKEN = 2 * (512 + 64) * 2  # the MLA probe: 2 layers x (kv_lora_rank + rope) x bf16
FIXED_BOUND_S = 120.0  # 0.5.23 never answers these prompts (sglang-intake-reject-hang): how long to wait


def _python(version: str) -> str:
    """The engine's interpreter: the harness's own where it is that release, else its environment."""
    try:
        if metadata.version("sglang") == version:
            return ""
    except metadata.PackageNotFoundError:
        pass
    return releases.engine_python(version)


@pytest.mark.backends("mooncake_tcp")
@pytest.mark.parametrize("version", [PREFIX_VERSION, FIXED_VERSION])
@pytest.mark.parametrize("scale", list(releases.SCALES), ids=[f"at-{s}" for s in releases.SCALES])
def test_incident_scale(scale, version, experiment, seeds, kvchaos_spec, kvchaos_run_dir, kvchaos_reaper):
    if kvchaos_spec.device != "cpu":
        pytest.skip("the release environments are built for the CPU profile")
    sc = releases.SCALES[scale]
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = sc.need_bytes(MLA_BYTES_PER_TOKEN, releases.CPU_ATTENTION_BYTES_PER_TOKEN if version == PREFIX_VERSION else 0)
    if need > total:
        pytest.skip(f"scale {scale} needs about {need / 2**30:.1f} GiB resident (pools, processes and decode's "
                    f"CPU attention over a {max(sc.oversized):,}-token victim) and this machine has "
                    f"{total / 2**30:.1f} GiB: run --scale largest-fit here, or this one on a larger machine")
    base = apply(kvchaos_spec.to_dict(), parse(LAYOUT), name=f"{kvchaos_spec.name}-{scale}-{version}")
    spec = ClusterSpec.from_dict({**releases.scaled_spec(base, sc), "engine_python": _python(version)})
    out = kvchaos_run_dir / "incidents" / f"glm53-{scale}-{version}"
    plans, victim = releases.scaled_plans(sc, seeds(releases.GLM53_SEED))
    big = [p for p in plans if p.oversized]
    big[0].after = plans[len(plans) - len(big) - 1].rid  # the background has cycled decode's free list
    for a, b in zip(big, big[1:]):
        b.after = a.rid
    bound = sc.bound_s if version == PREFIX_VERSION else FIXED_BOUND_S
    t_start = time.monotonic()
    with own_cluster(spec, kvchaos_run_dir / spec.name, kvchaos_reaper) as (c, _):
        started_s = time.monotonic() - t_start
        pf, dc = (c.server_info(r) for r in ("prefill", "decode"))
        described = c.describe()
        assert server_field(pf, "version") == server_field(dc, "version") == version
        assert server_field(pf, "max_total_num_tokens") == sc.prefill_pool, pf
        assert server_field(pf, "context_length") == sc.context, pf
        assert server_field(pf, "max_req_input_len") < min(sc.oversized) <= max(sc.oversized) < sc.context
        t0 = time.monotonic()
        # a fault kit of this cluster's own (none is armed): the session's would start the session cluster
        with EventLog(kvchaos_run_dir / "events" / f"{spec.name}-faults.jsonl") as flog, \
                releases.PeakRss(described["pids"]) as mem:
            with experiment(f"glm53-{scale}-{version}", plans,
                            [Isolation(), HttpSemantics(), Liveness(bound_s=bound)], cluster=c,
                            faults=FaultKit(c, flog), path=out / "events.jsonl", seed=seeds(releases.GLM53_SEED),
                            concurrency=16, timeout_s=bound, settle_s=0) as ex:
                pass
        wall = time.monotonic() - t0
    ends = {e["rid"]: e for e in ex.events if e["ev"] == "end"}
    bodies = {e["rid"]: e for e in ex.events if e["ev"] == "body"}
    sent = kv_pages_written(ex.events)
    iso = ex.by["isolation"]
    first = None
    if iso.witnesses:
        first = min(ends.get(w["victim_rid"], {}).get("t", float("inf")) for w in iso.witnesses) - ex.events[0]["t"]
    summary = {
        "version": version, "experiment": ex.id, "scale": releases.scale_record(sc), "layout": LAYOUT,
        "model": described.get("model_path"), "memory_model": sc.memory_model(MLA_BYTES_PER_TOKEN), "peak_rss": mem.to_dict(),
        "cluster_start_s": round(started_s, 1), "wall_s": round(wall, 1), "victim_tenant": victim,
        "prefill": {k: server_field(pf, k) for k in ("max_total_num_tokens", "max_req_input_len", "context_length")},
        "decode": {k: server_field(dc, k) for k in ("max_total_num_tokens", "context_length")},
        "victims": {p.rid: {"prompt_tokens": p.n_tokens, "outcome": ends.get(p.rid, {}).get("outcome"),
                            "status": ends.get(p.rid, {}).get("status"),
                            "latency_s": ends.get(p.rid, {}).get("latency_s"),
                            "kv_pages_sent_by_prefill": sent.get(p.rid),
                            "reply": (bodies.get(p.rid, {}).get("text") or "")[:200],
                            "error": bodies.get(p.rid, {}).get("error")} for p in big},
        "verdicts": {v.oracle: v.status for v in ex.verdicts},
        "first_witness": dict(iso.witnesses[0]) if iso.witnesses else None,
        "time_to_first_detection_s": first,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if version == PREFIX_VERSION:
        # the incident: every witness is the victim tenant reading another tenant's data with HTTP 200,
        # only the oversized prompts are victims, and prefill sent each of them one page
        assert iso.status == FAIL, iso
        assert all(w["victim_tenant"] == victim and w["status"] == 200 and w["owner_tenant"] != victim
                   for w in iso.witnesses), iso.witnesses[:3]
        assert {w["victim_rid"] for w in iso.witnesses} <= {p.rid for p in big}
        assert any(w["owner_tenant"] is not None for w in iso.witnesses), iso.witnesses[:3]
        assert all(sent.get(p.rid) == 1 for p in big), {p.rid: sent.get(p.rid) for p in big}
        ex.require(planted=f"pre-fix release sglang {PREFIX_VERSION} at scale {scale}",
                   isolation=FAIL, http_semantics=FAIL)
    else:
        ex.require(isolation=PASS, http_semantics=PASS, liveness=PASS)
