"""Writing event logs: a :class:`LogSpec` (its requests, in send order, and the experiment's frame
around them) rendered record by record with :class:`EventLog` as the driver and Experiment write it,
and the hand-written lines of the malformed-record shapes (a key twice, a record twice, a cut last line)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvchaos.workload.events import EventLog
from kvchaos.workload.plan import RequestPlan

from .replay import Wire, exchange, send
from .replies import LAYOUT, TIMEOUT_S

# --------------------------------------------------------------------------- writing logs
class _Tap:
    """An EventLog stand-in that hands ``body`` records of one rid to ``on_body`` (the duplicate-record
    and hand-written-line shapes) and stops writing after a record when asked (a crash)."""

    def __init__(self, log: EventLog, rid: str, on_body):
        self.log, self.rid, self.on_body = log, rid, on_body

    def emit(self, ev, **fields):
        if ev == "body" and fields.get("rid") == self.rid:
            return self.on_body(self.log, fields)
        return self.log.emit(ev, **fields)


class _Crashed(Exception):
    pass


@dataclass
class Req:
    plan: RequestPlan
    wire: Wire
    special: str | None = None   # dup_body | dup_key | cut_last
    clean_wire: Wire | None = None  # for dup_body / dup_key: what the later (clean) record says
    dup_keys: str = "text,raw"      # dup_key: which keys the hand-written line repeats


@dataclass
class LogSpec:
    name: str
    reqs: list                           # Req, in send order
    version: str | None = "0.5.23"
    pd: bool = False
    probes: bool = True
    faults: list = field(default_factory=list)   # fault records (copied at the end, as Experiment does)
    agents: list = field(default_factory=list)   # agent events (copied as ev "agent")
    # requests in flight together: the driver sends a wave of them, then each one's reply is logged (so
    # a request's window overlaps those of its wave, as at the driver's concurrency)
    concurrency: int = 16
    judged: bool = True                  # given to ``kvchaos judge`` / in the session registry
    meta: dict = field(default_factory=dict)  # what was planted: {"foreign": canary, "victims": [rid], "owner": ...}

    def write(self, path: Path) -> Path:
        log = EventLog(path)
        try:
            self._write(log, path)
        except _Crashed:
            pass
        finally:
            log.close()
        return path

    def _write(self, log: EventLog, path: Path) -> None:
        if self.version is not None:
            log.emit("experiment", id=f"{self.name}-0001", name=self.name, test=f"suites/test_x.py::{self.name}",
                     seed=7, run_seed=7, plans_digest="0" * 12, n=len(self.reqs), concurrency=64,
                     timeout_s=TIMEOUT_S, engine={"name": "sglang", "version": self.version,
                                                  "roles": {"prefill": self.version, "decode": self.version}},
                     layout=LAYOUT, via="pd" if self.pd else "router",
                     checkers=["Isolation()", "Sensitivity()", "Liveness(bound_s=60)"])
        if self.probes:
            for role in ("prefill", "decode"):
                log.emit("probe", phase="before", role=role, kv_used=0, ok=True, waited_s=0.0)
        log.emit("method", faults=sorted({f["fault"] for f in self.faults if f.get("fault")}), during=False)
        for r in self.reqs:
            log.emit("plan", rid=r.plan.rid, **{k: v for k, v in r.plan.to_dict().items() if k != "rid"})
        sends = {}
        for i, r in enumerate(self.reqs):
            if i % self.concurrency == 0:  # the next wave goes out
                for q in self.reqs[i:i + self.concurrency]:
                    sends[q.plan.rid] = send(log, q.plan, self.pd)["wall"]
            if r.special is None:
                exchange(log, r.plan, r.wire, self.pd, sent=True)
                continue
            clean = _body_fields(r.plan, r.clean_wire, self.pd) if r.clean_wire is not None else None

            def on_body(lg, fields, r=r, clean=clean):
                if r.special == "dup_body":  # the leaky record, then a second, clean one for the same rid
                    lg.emit("body", **fields)
                    return lg.emit("body", **clean)
                if r.special == "dup_key":  # one line, written by hand: every key again with clean values
                    rec = {"t": 0.0, "wall": 0.0, "ev": "body", **fields}
                    rec["t"], rec["wall"] = time.monotonic(), time.time()
                    head = json.dumps(rec)[:-1]
                    keys = ("text", "raw") if r.dup_keys == "text,raw" else tuple(clean)
                    tail = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in clean.items() if k in keys)
                    with open(path, "a") as f:  # EventLog writes whole lines (line-buffered, append mode)
                        f.write(head + ", " + tail + "}\n")
                    return rec
                if r.special == "cut_last":  # the process dies while writing this line
                    line = json.dumps({"t": time.monotonic(), "wall": time.time(), "ev": "body", **fields})
                    with open(path, "a") as f:  # no newline: the line was never finished
                        f.write(line[:-5])
                    raise _Crashed()
                raise AssertionError(r.special)

            exchange(_Tap(log, r.plan.rid, on_body), r.plan, r.wire, self.pd, sent=True)
        if self.probes:
            for role in ("prefill", "decode"):
                log.emit("probe", phase="after", role=role, kv_used=0, ok=True, waited_s=0.0)
            log.emit("probe", phase="after", role="router", ok=True, detail="HTTP 200")
        def when(v):  # ("sent", rid): when that request was sent (a fault acting on it)
            return sends[v[1]] if isinstance(v, tuple) and v[0] == "sent" else v

        for f in self.faults:
            log.emit("fault", **{k: when(v) for k, v in f.items()})
        for a in self.agents:
            log.emit("agent", **{k: when(v) for k, v in a.items()})


def _body_fields(p: RequestPlan, w: Wire, pd: bool) -> dict:
    """The fields of the ``body`` record the driver logs for ``w``."""
    mem = EventLog()
    exchange(mem, p, w, pd)
    rec = next(r for r in mem.records if r["ev"] == "body")
    return {k: v for k, v in rec.items() if k not in ("t", "wall", "ev")}
