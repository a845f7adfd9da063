"""Probes of the cluster recorded in the event log: does it answer, and how full is the KV pool."""

from __future__ import annotations

import time

import httpx

from kvchaos import httpclient
from kvchaos.cluster.layouts import pace_of
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


def snapshot(cluster, log, phase: str, answer: bool = True, settle_s: float = 0.0) -> bool:
    """Emit ``probe`` events for prefill and decode (KV use) and, with ``answer``, a 1-token request.

    ``settle_s``: give the pools up to that long to drain to empty before reading them (SGLang
    holds a failed or aborted transfer's decode pages until its writes drain or
    ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``, 30 s, passes); the wait is
    recorded as ``waited_s`` so a slow release is visible, and pages still held after it are a leak."""
    ok_all = True
    t0 = time.monotonic()
    for role in ("prefill", "decode"):
        url = getattr(cluster.endpoints, role)
        try:
            used = kv_used(url)
            while used and time.monotonic() - t0 < settle_s:
                time.sleep(0.5)
                used = kv_used(url)
            log.emit("probe", phase=phase, role=role, kv_used=used, ok=True,
                     waited_s=round(time.monotonic() - t0, 2))
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


BUSY_GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_prefill_bootstrap_queue_reqs",
               "sglang:num_prefill_inflight_queue_reqs", "sglang:num_decode_prealloc_queue_reqs",
               "sglang:num_decode_transfer_queue_reqs")
WORK_COUNTERS = ("sglang:prefill_effective_tokens_total", "sglang:realtime_tokens_total")


def wait_quiet(cluster, timeout_s: float = 120.0, stable_s: float = 10.0) -> dict:
    """Wait until neither server has queued/running requests and their work counters have not moved
    for ``stable_s`` (a router still retrying a request its client abandoned keeps them moving).
    Returns ``{"quiet": bool, "waited_s": float}``; never waits longer than ``timeout_s`` at the
    cluster's pace (``ClusterSpec.pace``: a slower probe's requests take longer to drain)."""
    timeout_s *= pace_of(cluster)
    t0 = time.monotonic()
    last, since = None, time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        state = []
        for role in ("prefill", "decode"):
            try:
                m = Metrics.fetch(getattr(cluster.endpoints, role))
            except httpx.HTTPError:
                state.append(None)
                continue
            names = {x.name for x in m.samples}
            state.append((sum(m.value(g) for g in BUSY_GAUGES if g in names),
                          tuple(m.value(c) for c in WORK_COUNTERS if c in names)))
        busy = any(st is None or st[0] for st in state)
        if state != last or busy:
            last, since = state, time.monotonic()
        elif time.monotonic() - since >= stable_s:
            return {"quiet": True, "waited_s": round(time.monotonic() - t0, 2)}
        time.sleep(0.5)
    return {"quiet": False, "waited_s": round(time.monotonic() - t0, 2)}


def flush_caches(cluster, timeout_s: float = 30.0) -> dict:
    """SGLang's ``/flush_cache`` on prefill and decode: the prefix tree emptied and the KV allocators'
    free lists back in their start order (``Scheduler.flush_cache``; refused while a request is
    queued, running or parked, so it is retried until ``timeout_s``). The pages' contents stay: a
    caller that must not be fooled by what an earlier run left there re-mints its canaries
    (:func:`kvchaos.shrink.scenario.remint`). Returns ``{role: True | "why not"}``."""
    out = {}
    deadline = time.monotonic() + timeout_s
    for role in ("prefill", "decode"):
        url = getattr(cluster.endpoints, role) + "/flush_cache"
        why = "not tried"
        while True:
            try:
                r = httpclient.post(url, params={"timeout": 1.0}, timeout=10.0)
                if r.status_code == 200:
                    why = True
                    break
                why = f"HTTP {r.status_code}: {r.text.strip()[:120]}"
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        out[role] = why
    return out


def abort_all(cluster) -> dict:
    """SGLang's ``/abort_request`` with ``abort_all`` on prefill and decode: what a run left queued,
    running or parked in the engines is aborted. Returns ``{role: True | "why not"}``."""
    out = {}
    for role in ("prefill", "decode"):
        try:
            r = httpclient.post(getattr(cluster.endpoints, role) + "/abort_request", json={"rid": "", "abort_all": True},
                           timeout=10.0)
            out[role] = True if r.status_code == 200 else f"HTTP {r.status_code}: {r.text.strip()[:120]}"
        except httpx.HTTPError as e:
            out[role] = f"{type(e).__name__}: {e}"
    return out


def settle(cluster, timeout_s: float = 15.0) -> tuple[bool, dict | None]:
    """Bring a cluster a run has finished with back to idle and flushed caches, as a fresh one would
    start: :func:`flush_caches`; where a role refuses (requests the run left in the engine after their
    clients gave up: the hang band, a request parked past its client), :func:`abort_all` and flush
    again. Returns ``(aborted, left)``: whether requests had to be aborted, and None when both roles
    flushed, else ``{role: why}`` for what still refused (the caller replaces the cluster)."""
    got = flush_caches(cluster, timeout_s)
    if all(v is True for v in got.values()):
        return False, None
    aborted = abort_all(cluster)
    got = flush_caches(cluster, timeout_s)
    left = {r: f"{v} (after abort_all: {aborted[r]})" for r, v in got.items() if v is not True}
    return True, left or None


def server_field(info, key):
    """First value of ``key`` anywhere in a nested ``/server_info`` answer (its layout moves between
    releases: 0.5.19 and 0.5.23 keep pool sizes in different places)."""
    if isinstance(info, dict):
        if key in info:
            return info[key]
        info = list(info.values())
    if isinstance(info, list):
        for x in info:
            v = server_field(x, key)
            if v is not None:
                return v
    return None
