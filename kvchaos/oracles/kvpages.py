"""KV pages as the in-engine agent reports them: how many pages prefill wrote per request, the page
size, how many pages hold n tokens."""

from __future__ import annotations

from collections import defaultdict

from kvchaos.history import History, agent_kind


def _records(events) -> list[dict]:
    return events.records if isinstance(events, History) else events


def kv_pages_written(events) -> dict[str, int]:
    """Per rid, the KV pages prefill wrote to decode (the sum of the agent's ``write_end`` pages over
    every chunk of the request's transfer; a chunked prefill sends several). Pages of
    :func:`kv_page_size` tokens each."""
    out: dict[str, int] = defaultdict(int)
    for e in _records(events):
        if agent_kind(e) == "write_end" and e.get("rid") and isinstance(e.get("pages"), int):
            out[e["rid"]] += e["pages"]
    return dict(out)


def kv_page_size(events) -> int:
    """The KV page size the agent's transfer events report (1 when they do not say)."""
    for e in _records(events):
        if agent_kind(e) in ("transfer_start", "write_end") and isinstance(e.get("page_size"), int):
            return e["page_size"]
    return 1


def pages_for(n_tokens: int, page_size: int) -> int:
    """KV pages that hold ``n_tokens`` (the last one may be partly filled)."""
    return -(-int(n_tokens) // max(1, int(page_size)))
