"""Probes of the cluster recorded in the event log: does it answer, and how full is the KV pool."""

from __future__ import annotations

import httpx

from kvchaos.cluster.metrics import Metrics


def kv_used(url: str) -> int | None:
    """Tokens held by requests in the server's KV pool: max_total_num_tokens minus free
    (kv_available_tokens) minus reclaimable prefix-cache pages (kv_evictable_tokens)."""
    m = Metrics.fetch(url)
    total = m.value("sglang:max_total_num_tokens")
    names = {s.name for s in m.samples}
    if not total or "sglang:kv_available_tokens" not in names:
        return None
    return int(total - m.value("sglang:kv_available_tokens") - m.value("sglang:kv_evictable_tokens"))


def snapshot(cluster, log, phase: str, answer: bool = True) -> bool:
    """Emit ``probe`` events for prefill and decode (KV use) and, with ``answer``, a 1-token request."""
    ok_all = True
    for role in ("prefill", "decode"):
        url = getattr(cluster.endpoints, role)
        try:
            used = kv_used(url)
            log.emit("probe", phase=phase, role=role, kv_used=used, ok=True)
        except httpx.HTTPError as e:
            ok_all = False
            log.emit("probe", phase=phase, role=role, ok=False, detail=repr(e))
    if answer:
        try:
            r = cluster.generate(text="kvchaos liveness probe", max_new_tokens=1, timeout=30)
            ok = r.status_code == 200
            log.emit("probe", phase=phase, role="router", ok=ok, detail=f"HTTP {r.status_code}")
        except httpx.HTTPError as e:
            ok = False
            log.emit("probe", phase=phase, role="router", ok=False, detail=repr(e))
        ok_all &= ok
    return ok_all
