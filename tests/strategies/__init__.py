"""Hypothesis generators of event logs for the property tests (``tests/test_properties*.py``).

Every log is written with :class:`kvchaos.workload.events.EventLog` record by record in the order
and with the fields ``kvchaos/workload/driver.py`` writes them (``plan`` for every request first,
then per request ``send``, ``status`` (``headers_only`` for streams), ``first_byte``, ``error``,
``abort``, ``body``, ``end``; ``prefill_leg`` in pd_direct mode), inside an experiment's frame
(``experiment`` header, ``probe`` before/after, ``method``, copied ``fault`` and ``agent`` records).

:func:`exchange` is the driver's reading of one HTTP reply replayed on bytes (:mod:`.replay`).

A generated :class:`Scenario` is data (what Hypothesis draws and prints); ``Scenario.write(dir,
leak=...)`` renders it. With ``leak=False`` the same logs are written with the foreign canary's
payload replaced by lower-case filler of the same length (the leak-free twin: same structure).

The package, by concern: :mod:`.replies` (what the probe model says and the server sends),
:mod:`.replay` (the driver's records of a reply), :mod:`.logs` (writing a log), :mod:`.clean`
(plans, clean replies, noise), :mod:`.scenario` (scenarios, builders, variants, the leak scenarios'
shared parts), the leak classes in :mod:`.leaks_stream` (the client's bytes), :mod:`.leaks_records`
(errors, records, other logs, malformed records) and :mod:`.leaks_known` (known findings), and
:mod:`.powered` (clean logs with power; the power floor gamed). This module re-exports them all and
holds the class table.
"""

from __future__ import annotations

from kvchaos.workload.events import EventLog
from kvchaos.workload.plan import RequestPlan

from .clean import DELIVERIES, NOISE, Mint, clean_request, noise_request, reply_wire
from .leaks_known import cut_short_leak, short_after_leak, short_blind_leak
from .leaks_records import (
    cross_log_leak,
    cut_last_leak,
    duplicate_leak,
    http_error_leak,
    leg_leak,
    raw_missing_leak,
    unknown_origin_leak,
)
from .leaks_stream import (
    MALFORMED_LINES,
    abort_leak,
    after_done_leak,
    after_malformed_leak,
    complete_leak,
    cut_leak,
    stream_leak,
)
from .logs import LogSpec, Req
from .powered import MIRROR_MIN, gamed_power, mirror
from .replay import Wire, exchange, send
from .replies import (
    BOOTSTRAP_PORT,
    DECODE,
    EOS,
    ERROR_SHAPES,
    ERROR_STATUSES,
    ERROR_TYPES,
    LAYOUT,
    MODEL,
    PATHS,
    PREFILL,
    ROUTER,
    TIMEOUT_S,
    VOCAB,
    complete_body,
    error_body,
    ids_of,
    order,
    pieces,
    recite,
    sse_events,
    twin_payload,
)
from .scenario import (
    BUILDERS,
    COMBOS,
    EP,
    LEAK_BASE_N,
    VARIANTS,
    Scenario,
    builder,
    leak_base,
    mirror_summary,
    owner_kinds,
    splits,
)

# everything the single module tests/strategies.py offered, as before
__all__ = [
    "BOOTSTRAP_PORT", "BUILDERS", "COMBOS", "DECODE", "DELIVERIES", "EOS", "EP", "ERROR_SHAPES",
    "ERROR_STATUSES", "ERROR_TYPES", "EventLog", "LAYOUT", "LEAK_BASE_N", "LEAK_CLASSES", "LogSpec",
    "MALFORMED_LINES", "MIRROR_MIN", "MODEL", "Mint", "NOISE", "PATHS", "PREFILL", "ROUTER", "Req",
    "RequestPlan", "Scenario", "TIMEOUT_S", "VARIANTS", "VOCAB", "Wire", "abort_leak", "after_done_leak",
    "after_malformed_leak", "builder", "clean_request", "complete_body", "complete_leak", "cross_log_leak",
    "cut_last_leak", "cut_leak", "cut_short_leak", "duplicate_leak", "error_body", "exchange", "gamed_power",
    "http_error_leak", "ids_of", "leak_base", "leak_scenarios", "leg_leak", "mirror", "mirror_summary",
    "noise_request", "order", "owner_kinds", "pieces", "raw_missing_leak", "recite", "reply_wire", "send",
    "short_after_leak", "short_blind_leak", "splits", "sse_events", "stream_leak", "twin_payload",
    "unknown_origin_leak",
]

# ----------------------------------------------------------------- the class table
LEAK_CLASSES = {
    "complete-generate": complete_leak,
    "complete-openai": complete_leak,
    "stream-generate": stream_leak,
    "stream-openai-split": stream_leak,
    "stream-cut-mid-line": cut_leak,
    "stream-after-done": after_done_leak,
    "stream-after-malformed-line": after_malformed_leak,
    "aborted": abort_leak,
    "disconnected": abort_leak,
    "timeout": abort_leak,
    "http-error": http_error_leak,
    "raw-missing": raw_missing_leak,
    "prefill-leg-error": leg_leak,
    "cross-log": cross_log_leak,
    "unknown-origin": unknown_origin_leak,
    "duplicate-body-record": duplicate_leak,
    "duplicate-json-key": duplicate_leak,
    "cut-last-line": cut_last_leak,
    "short-blind-known": short_blind_leak,
    "short-owner-after-victim": short_after_leak,
    "checkers-liveness": complete_leak,
    "cut-short-recital": cut_short_leak,
}


def leak_scenarios(cls: str, variant: str | None = None):
    """Scenarios of shape class ``cls`` (every variant of :data:`VARIANTS`, or only ``variant``)."""
    return LEAK_CLASSES[cls](cls, variant)
