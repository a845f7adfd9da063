"""JSONL event log: one JSON object per line, each with a monotonic timestamp.

Every record has ``t`` (seconds, ``time.monotonic()`` — comparable within one run), ``wall``
(Unix time, for humans), ``ev`` (the event type) and usually ``rid``. Event types written by the
driver: ``run`` (seed, config), ``plan`` (what a request is and whose canaries it carries),
``send``, ``first_byte``, ``status``, ``body``, ``abort``, ``error``, ``end``; faults write
``fault``; probes of the cluster write ``probe``. Nothing is buffered beyond one line: a crash
loses at most the line being written.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from kvchaos.history import read_records


class EventLog:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else None
        self.records: list[dict] = []
        self._lock = threading.Lock()
        self._f = None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", buffering=1)

    def emit(self, ev: str, **fields) -> dict:
        rec = {"t": time.monotonic(), "wall": time.time(), "ev": ev, **fields}
        with self._lock:
            self.records.append(rec)
            if self._f:
                self._f.write(json.dumps(rec, default=str) + "\n")
        return rec

    def since(self, n: int) -> list[dict]:
        """The records after the first ``n`` (a copy: other threads may be writing)."""
        with self._lock:
            return self.records[n:]

    def close(self):
        if self._f:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load_events(path: str | Path) -> list[dict]:
    """Read an event log: the one loader (:func:`kvchaos.history.read_records`): every line a JSON
    object with an ``ev``, no key twice; a cut last line is kept as a ``truncated`` record."""
    return read_records(path)
