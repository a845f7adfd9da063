"""Oracles: functions of the event log returning ``pass`` / ``fail`` / ``unknown`` with witnesses.

One module per checker (``base`` holds what they share); this package re-exports them.

* :func:`isolation` — a response holding a canary minted for another request is a LEAK; the
  witness names victim rid and tenant, owner rid and tenant, the matched text and its offsets.
  Exact payloads and partial matches (any ``partial_len``-character window of a payload) are
  found in one Aho-Corasick pass (pyahocorasick). Without power in every exercised class the
  verdict is ``unknown``, never ``pass`` (``kvchaos.oracles.isolation``).
* :func:`sensitivity` — the power report: own-canary echo per exercised class.
* :func:`differential` — greedy output vs the same prompt served alone on a clean single server.
* :func:`http_semantics` — a prompt the engine must reject (over the pool or the context) must get
  a 4xx with an error; HTTP 200 with content is a failure.
* :func:`liveness` — every request ends, within the bound; the cluster answers afterwards; the KV
  pool returns to its idle baseline (no pages lost).
* :func:`kv_lifecycle` — from the engines' own evidence (the in-engine agent's ``write_end`` on
  prefill, ``kv_released`` on decode): no KV write lands in decode pages after decode gave them back
  (an abort that frees pages while a write to them is in flight: late writes into recycled pages).
  Sees the bug even when no reply happens to show the foreign data.
* :func:`integrity` — every reply of a probe request is exactly what its prompt must give (the probe's
  recital, known before it is sent: ``kvchaos.probe.contract``) and its metadata are its own; a reply
  that differs in one character is a FAIL, whoever's bytes are wrong (``kvchaos.oracles.integrity``).
* :func:`page_ownership` — from the engines' own ledger (the agent's ``page_conflict``): no KV page is
  given to a request while another live request holds it, released twice, or used while free; judged
  in the experiment where it happened (``kvchaos.oracles.page_ownership``).
* :func:`abort_semantics` — a request aborted at any stage comes back as aborted (an error, or 200
  with finish reason ``abort``), never as a 200 success while the abort provably reached it in time.
* :func:`retraction` — from decode's own evidence: every request decode retracted got its own KV
  back bit-exact when it resumed, and none was answered without being resumed.
* :class:`KvChecksum`, :class:`KvCanary` — SGLang's own KV defences (``kvchaos.oracles.defences``):
  a checksum mismatch or a kv_canary violation in the engines' logs is a FAIL. Only the defence arm
  (``--kvchaos-defences``, CUDA) adds them; never a default, never always run.
"""

from __future__ import annotations

from kvchaos.history import History, agent_kind, as_history

from .abort_semantics import AbortSemantics, abort_semantics
from .base import FAIL, PASS, STATUSES, UNKNOWN, Checker, Composite, Verdict, check_safe, compose
from .cache import CacheIsolation, TimingIsolation, cache_isolation, timing_isolation
from .defences import KvCanary, KvChecksum
from .differential import Differential, differential
from .http_semantics import HttpSemantics, http_semantics
from .integrity import Integrity, integrity
from .isolation import (CORRUPTING_FAULTS, DEFAULT_FLOOR, ECHO_RATE, Isolation, Sensitivity, SensitivityFloor,
                        binomial_lower_bound, isolation, power, scan, sensitivity)
from .kv_lifecycle import KVLifecycle, kv_lifecycle
from .kvpages import kv_page_size, kv_pages_written, pages_for
from .liveness import Liveness, liveness
from .page_ownership import PageOwnership, page_ownership
from .retraction import Retraction, retraction

Run = as_history  # the index every checker reads: kvchaos.history.History

__all__ = ["FAIL", "PASS", "STATUSES", "UNKNOWN", "CORRUPTING_FAULTS", "DEFAULT_FLOOR", "ECHO_RATE",
           "AbortSemantics", "CacheIsolation", "Checker", "Composite", "Differential", "History", "HttpSemantics",
           "Integrity", "Isolation", "KVLifecycle", "Liveness", "PageOwnership", "Retraction", "Run", "Sensitivity",
           "SensitivityFloor",
           "TimingIsolation", "Verdict", "abort_semantics", "agent_kind", "as_history", "binomial_lower_bound",
           "cache_isolation", "check_safe", "compose", "default_checkers", "differential", "http_semantics",
           "integrity", "isolation", "kv_lifecycle", "kv_page_size", "kv_pages_written", "liveness", "page_ownership",
           "pages_for", "power",
           "retraction", "scan", "sensitivity", "timing_isolation",
           "KvCanary", "KvChecksum"]  # the defence arm's (kvchaos.oracles.defences)


def default_checkers(bound_s: float = 60.0) -> Composite:
    """What ``kvchaos judge`` applies to a log: every oracle that needs nothing but the log (the
    policy adds the leak checkers that always run, :func:`kvchaos.policy.with_always`)."""
    return compose(Isolation(), Integrity(), Sensitivity(), HttpSemantics(), Liveness(bound_s=bound_s), KVLifecycle(),
                   PageOwnership())
