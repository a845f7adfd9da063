"""The one history of an experiment: records, the loader that validates them, the index checkers read.

An experiment's event log (``kvchaos.workload.events.EventLog``, JSONL) is its history, as in Jepsen:
the driver writes what the client sent and received, the faults what they did, the in-engine agents
what the engines did (copied in as ``{"ev": "agent", "agent_ev": ...}``). Every checker judges a
:class:`History`, built here and nowhere else — from a file (:func:`load`) or from the records an
experiment holds in memory (:class:`History` itself) — so the CLI, the suites, the report and shrink
all read one log the same way.

Validation (bad input is a :class:`HistoryError` naming ``file:line``; nothing is silently dropped
or overwritten):

* every line is one JSON object with an ``ev`` string; a key given twice in one record is an error
  (JSON readers keep the last one: the first value would vanish);
* a request has at most one ``plan``, ``send``, ``body`` and ``end``, and at most one final
  ``status`` (streams also log their headers' status, ``headers_only``): a second one is an error —
  it would replace what the client received the first time;
* a last line that is not JSON (a crash mid-write) is kept as a ``truncated`` record and makes the
  history *incomplete* (:attr:`History.problems`): the policy turns every PASS of an incomplete
  history into UNKNOWN — the lost record could have been the leaking reply. A bad line anywhere
  else is an error;
* the fields checkers read have the types they need.

Schema. An experiment's header (``ev: experiment``) carries ``schema`` (:data:`SCHEMA`). Logs written
before the header carried it are schema 1 and read as they are (:func:`migrate`): a log on disk is
never rejected for its age. A log of a newer schema is bad input: its records could mean what this
kvchaos does not know.

What the client received (:meth:`History.client_views`): every byte of every reply, error and stream,
whatever the driver's parse made of it — the parsed text, the error, the raw body, every string of the
raw body read by JSON path (:func:`raw_views`: a whole JSON body, each server-sent event — after a line
the driver could not parse, a line cut short, ``[DONE]`` — or each line of a line-delimited stream; each
path's values joined in order, so a canary streamed a token per chunk in any field is whole again),
every string in the reply's metadata, the output token ids decoded with the probe's tokenizer, and
every other record of the request (error records, a ``pd_direct`` prefill leg's error bodies), read by
path across the records of one kind. Isolation scans all of them.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from kvchaos import canary
from kvchaos.model import char_vocab
from kvchaos.probe.kinds import PACE_MAX

SCHEMA = 3
# the record that closes an experiment (schema 3): what its writer wrote before it, so a log cut at a line
# boundary, or with records dropped, added or changed, says so (:func:`close_record`, History._wholeness)
CLOSE = "experiment_end"
ONCE_PER_RID = ("plan", "send", "body", "end")
# records that are not something the client received (the prompt is the harness's own text; faults
# and agent events are the harness's and the engines' evidence). Every other record that names a
# request is part of what its client saw and is scanned.
NOT_RECEIVED = frozenset(("plan", "send", "fault", "agent", "experiment", CLOSE, "method", "probe", "engine_error",
                          "observed", "aborted", "run", "truncated", "cache_flushed", "engine_healed",
                          "leak_seen", "heal_failed", "stall"))


class HistoryError(ValueError):
    """A log kvchaos cannot judge as written (the message names the file, the line and the problem)."""


# --------------------------------------------------------------------------- loading
def _object(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise _DuplicateKey(k)
        d[k] = v
    return d


class _DuplicateKey(ValueError):
    pass


def _reject_constant(name):  # NaN / Infinity are not JSON; Python's reader accepts them
    raise ValueError(f"{name} is not JSON")


class Records(list):
    """Records read from a file, with the line each came from (``lines``, same order)."""
    lines: list


def parse(text: str, source: str = "<log>") -> Records:
    """The records of one JSONL log. A last line that is not JSON is kept as a ``truncated`` record."""
    lines = text.splitlines()
    last = max((i for i, x in enumerate(lines) if x.strip()), default=-1)
    out, at = Records(), []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{source}:{i + 1}"
        try:
            e = json.loads(line, object_pairs_hook=_object, parse_constant=_reject_constant)
        except _DuplicateKey as k:
            raise HistoryError(f"{where}: key {str(k)!r} given twice in one record (a reader would keep only the "
                               "last value)") from None
        except ValueError as err:
            if i == last:  # a crash mid-write loses at most this line (EventLog writes whole lines)
                out.append({"ev": "truncated", "line": i + 1, "text": line[:100000],
                            "error": getattr(err, "msg", str(err))})
                at.append(i + 1)
                continue
            raise HistoryError(f"{where}: not JSON: {getattr(err, 'msg', err)}") from None
        if not isinstance(e, dict):
            raise HistoryError(f"{where}: not a JSON object but {type(e).__name__}: not an event record")
        if not isinstance(e.get("ev"), str) or not e["ev"]:
            raise HistoryError(f"{where}: record without \"ev\" (every event record names its type)")
        out.append(e)
        at.append(i + 1)
    out.lines = at
    return out


def load(path: str | Path) -> "History":
    """Read and validate one event log from disk."""
    return History(read_records(path), source=str(path))


def read_records(path: str | Path) -> list[dict]:
    """The records of one event log on disk, each line checked (:func:`parse`), not yet indexed."""
    p = Path(path)
    if not p.exists():
        raise HistoryError(f"{path}: no such file")
    if p.is_dir():
        raise HistoryError(f"{path}: is a directory, not an event log")
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise HistoryError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise HistoryError(f"{path}: not a UTF-8 text file (byte {e.start}): not an event log") from None
    records = parse(text, str(path))
    if not records:
        raise HistoryError(f"{path}: empty log: no event records")
    return records


def migrate(records: list[dict]) -> tuple[list[dict], int]:
    """Records of any schema in today's form, and the schema they were written in. Schema 1 (no
    ``schema`` in the header, or no header) has the same records as schema 2 minus the header's
    ``schema`` and the decode agent's ``kv_prealloc`` evidence: nothing to rewrite, only less
    evidence (a finding whose mechanism needs ``kv_prealloc`` does not match such a log)."""
    head = next((e for e in records if e.get("ev") == "experiment"), None)
    schema = head.get("schema", 1) if head else 1
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
        raise HistoryError(f"experiment header: schema must be a positive integer, got {schema!r}")
    if schema > SCHEMA:
        # its records may mean what this kvchaos does not know (a new place a reply's text is carried, a new
        # record that voids others): read as far as understood, such a log could be judged green wrongly
        raise HistoryError(f"experiment header: written with history schema {schema}, newer than this kvchaos reads "
                           f"(1 to {SCHEMA}): judge it with the kvchaos that wrote it")
    return records, schema


def split_experiments(records: list[dict]) -> list[list[dict]]:
    """The experiments of one log, each from its header to the record before the next header (records
    before the first header go with the first): a file an experiment was appended to (an event log is
    opened for appending; a test run twice writes two) holds several, each judged under its own header.
    A log's line numbers (:class:`Records`) go with each part."""
    heads = [i for i, e in enumerate(records) if e.get("ev") == "experiment"]
    if len(heads) < 2:
        return [records]
    lines = getattr(records, "lines", None)
    bounds = [0] + heads[1:] + [len(records)]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        part = Records(records[a:b])
        part.lines = lines[a:b] if lines else None
        out.append(part)
    return out


def record_line(rec: dict) -> str:
    """A record as :class:`kvchaos.workload.events.EventLog` writes it (one line, no newline): the digest of
    a closing record is over these."""
    return json.dumps(rec, default=str)


def digest(records) -> str:
    h = hashlib.sha256()
    for r in records:
        h.update(record_line(r).encode())
        h.update(b"\n")
    return "sha256:" + h.hexdigest()


def close_record(log, experiment_id) -> dict:
    """Write ``log``'s closing record (:data:`CLOSE`): the count of the records before it since the
    experiment's header, their digest, how many requests were planned, sent and ended, and the faults'
    actions — so the judge can tell a whole log from one cut at a line boundary or edited."""
    recs = log.since(0)
    start = max((i for i, e in enumerate(recs) if e.get("ev") == "experiment"), default=0)
    mine = recs[start:]
    count = defaultdict(int)
    for e in mine:
        if e.get("ev") in ("plan", "send", "end"):
            count[e["ev"]] += 1
        elif e.get("ev") == "fault" and isinstance(e.get("action"), str):
            count["fault " + e["action"]] += 1
    return log.emit(CLOSE, id=experiment_id, records=len(mine), digest=digest(mine),
                    counts=dict(sorted(count.items())))


# --------------------------------------------------------------------------- the index
def agent_kind(e: dict) -> str | None:
    """Agent events appear raw (``ev``, with ``source: agent``) or copied into an experiment's log
    (``ev == "agent"``, ``agent_ev``)."""
    if e.get("ev") == "agent":
        return e.get("agent_ev")
    return e.get("ev") if e.get("source") == "agent" else None


@dataclass(frozen=True)
class View:
    """One rendering of what a client received for a request: ``name`` says which."""
    name: str
    text: str


class History:
    """One experiment's records, validated, and indexed by request. ``problems``: what makes the
    history incomplete (a cut last line); the policy never lets an incomplete history PASS."""

    def __init__(self, records: list[dict], source: str = "<history>"):
        lines = getattr(records, "lines", None)
        records, self.schema = migrate(list(records))
        self.records = records
        line = dict(zip(map(id, records), lines)) if lines else {}  # where each record is, for messages
        self.source = source
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.header = next((e for e in records if e.get("ev") == "experiment"), {})
        self.plans: dict[str, dict] = {}
        self.sends: dict[str, dict] = {}
        self.bodies: dict[str, dict] = {}
        self.ends: dict[str, dict] = {}
        self.statuses: dict[str, int] = {}       # final status, else the headers' (a stream cut short)
        self._final: dict[str, dict] = {}
        self.received: dict[str, list[dict]] = defaultdict(list)  # rid -> every client-side record
        self.unattributed: list[dict] = []  # records naming no request that are not the harness's own
        self.by_ev: dict[str, list[dict]] = defaultdict(list)
        self.agent: list[dict] = []               # agent events (their kind: agent_kind(e))
        self._engine_rids: dict[str, str] | None = None  # engine_rids(), read once
        self._replies: dict[str, str] = {}  # reply_text(), read once per request
        self._docs: dict[str, tuple[list, list[str]]] = {}  # _body_docs(), parsed once per request
        self._agent_kinds: list[str] = []
        for e in records:
            ev = e.get("ev")
            self.by_ev[ev].append(e)
            where = f"{source}:{line.get(id(e), '?')}"
            if ev == "truncated":
                self.problems.append(f"{where}: the last line is cut ({e.get('error')}): a record was lost — "
                                     "what it said cannot be judged")
                continue
            kind = agent_kind(e)
            if kind is not None:
                self.agent.append(e)
                self._agent_kinds.append(kind)
                continue
            _check_types(e, where)
            rid = e.get("rid")
            if rid is None:
                if ev not in NOT_RECEIVED:
                    self.unattributed.append(e)  # a record of unknown kind naming no request: scanned too
                continue
            if ev in ONCE_PER_RID:
                seen = {"plan": self.plans, "send": self.sends, "body": self.bodies, "end": self.ends}[ev]
                if rid in seen:
                    raise HistoryError(f"{where}: a second {ev!r} record for request {rid!r} (first at line "
                                       f"{line.get(id(seen[rid]), '?')}): one request, one {ev}")
                seen[rid] = e
            elif ev == "status":
                if not e.get("headers_only"):
                    if rid in self._final:
                        raise HistoryError(f"{where}: a second final status for request {rid!r} (first at line "
                                           f"{line.get(id(self._final[rid]), '?')})")
                    self._final[rid] = e
                    self.statuses[rid] = e.get("status")
                elif rid not in self._final:
                    self.statuses[rid] = e.get("status")
            if ev not in NOT_RECEIVED:
                self.received[rid].append(e)
        for rid, e in self.ends.items():  # a reply cut before its status was logged has it on its end
            if rid not in self.statuses and e.get("status") is not None:
                self.statuses[rid] = e.get("status")
        self.problems += self._wholeness(records, line)

    def _wholeness(self, records: list[dict], line: dict) -> list[str]:
        """What says this history is not all its writer wrote: more than one experiment header (each must be
        judged under its own: :func:`split_experiments`), a request sent and never ended (the driver ends
        every request it sends), and, from schema 3 on, a missing or contradicted closing record."""
        out = []
        heads = self.by_ev.get("experiment", [])
        if len(heads) > 1:
            out.append(f"{self.source}: {len(heads)} experiments in one history: each must be judged under its own "
                       "header (kvchaos judge splits a file that holds several)")
        unended = [rid for rid in self.sends if rid not in self.ends]
        if unended:
            out.append(f"{self.source}: {len(unended)} request(s) sent and never ended ({', '.join(unended[:3])}"
                       f"{', ...' if len(unended) > 3 else ''}): the log stops before what they received")
        closes = self.by_ev.get(CLOSE, [])
        if not heads or self.schema < 3:
            if closes:
                out.append(f"{self.source}: a closing record in a log without a schema-3 header")
            return out
        if not closes:
            return out + [f"{self.source}: no closing record ({CLOSE}): the log was cut, or its writer died, after "
                          f"line {line.get(id(records[-1]), len(records))} — what came after cannot be judged"]
        close = closes[-1]
        at = next(i for i in range(len(records) - 1, -1, -1) if records[i] is close)
        start = next(i for i, e in enumerate(records) if e is heads[0])
        before = records[start:at]
        if len(closes) > 1 or at != len(records) - 1:
            out.append(f"{self.source}: records after the experiment's closing record (line "
                       f"{line.get(id(close), '?')}): nothing is written after it")
        if close.get("records") != len(before):
            out.append(f"{self.source}: the closing record counts {close.get('records')!r} records before it, the "
                       f"log holds {len(before)}: records were lost or added")
        elif close.get("digest") != digest(before):
            out.append(f"{self.source}: the records before the closing record are not those its writer wrote "
                       "(their digest differs): the log was edited")
        return out

    # ------------------------------------------------------------------ requests
    @property
    def complete(self) -> bool:
        return not self.problems

    def responses(self) -> list[str]:
        """Every request the client got anything for (a body, an error body, a stream, a leg's error)."""
        return [rid for rid, recs in self.received.items() if any(_strings(r) for r in recs)]

    @property
    def pace(self) -> float:
        """The cluster's pace the header records (``layout.spec.pace``: how many times longer a token took
        than on the profile's own probe; 1 when not recorded). Validated on load: 1 to ``PACE_MAX``."""
        pace = _header_pace(self.header)
        return 1.0 if pace is None else float(pace)

    def outcome(self, rid: str) -> str | None:
        return (self.ends.get(rid) or {}).get("outcome")

    def client_views(self, rid: str) -> list[View]:
        """Everything the client received for ``rid``, every way it can be read (module doc)."""
        out: list[View] = []
        others: dict[str, list[dict]] = defaultdict(list)
        model = layout_spec(self.header).get("model")
        for r in self.received.get(rid, ()):
            ev = r.get("ev")
            if ev == "body":
                for k in ("text", "error", "raw"):
                    if isinstance(r.get(k), str) and r[k]:
                        out.append(View(f"body.{k}", r[k]))
                if isinstance(r.get("raw"), str) and r["raw"]:
                    out += [View(f"body.raw by path: {n}", t) for n, t in docs_views(*self._body_docs(rid)) if t]
                meta = _strings(r.get("meta"))
                if meta:
                    out.append(View("body.meta", "\n".join(meta)))
                ids = r.get("output_ids")
                if isinstance(ids, list) and ids and _decodes_probe_ids(model):
                    out.append(View("body.output_ids (probe tokenizer)", decode_probe_ids(ids)))
                rest = [s for k, v in r.items() if k not in ("text", "error", "raw", "meta", "output_ids", "rid", "ev")
                        for s in _strings(v)]
                if rest:
                    out.append(View("body (other fields)", "\n".join(rest)))
            else:
                others[ev].append({k: v for k, v in r.items() if k not in ("rid", "ev")})
        for ev, docs in others.items():  # records of one kind read as one stream of documents, by path
            out += [View(f"{ev} by path: {n}", t) for n, t in joined_views(docs) if t]
        return out

    def unattributed_views(self) -> list[View]:
        """Records that name no request and are not the harness's own: whatever they carry is read as
        something a client may have received."""
        return [View(f"{e.get('ev')} (no rid)", "\n".join(s for k, v in e.items() if k != "ev" for s in _strings(v)))
                for e in self.unattributed]

    def response_text(self, rid: str) -> str:
        """Every view of what the client received, joined: what isolation scans and what a witness's
        ``offsets`` index."""
        return "\n".join(v.text for v in self.client_views(rid))

    def _body_docs(self, rid: str) -> tuple[list, list[str]]:
        """:func:`body_docs` of ``rid``'s raw body, parsed once (its views and its reply text both read them)."""
        if rid not in self._docs:
            raw = (self.bodies.get(rid) or {}).get("raw")
            self._docs[rid] = body_docs(raw) if isinstance(raw, str) else ([], [])
        return self._docs[rid]

    @property
    def incremental_streaming(self) -> bool | None:
        """Does decode stream /generate chunks as each one's new text only (``--incremental-streaming-output``)?
        The header's ``engine.incremental_streaming_output``; None where not recorded."""
        eng = self.header.get("engine")
        inc = eng.get("incremental_streaming_output") if isinstance(eng, dict) else None
        return inc if isinstance(inc, bool) else None

    def reply_text(self, rid: str) -> str:
        """The reply as the driver parsed it (the own-canary echo is read here); a /generate stream's from
        its raw chunks where they are not cumulative (``--incremental-streaming-output``: each chunk holds
        only its new text, and a driver that kept the last chunk kept only the reply's end)."""
        if rid in self._replies:
            return self._replies[rid]
        b = self.bodies.get(rid) or {}
        text = b.get("text") or ""
        raw = b.get("raw")
        if isinstance(raw, str) and "data:" in raw:  # read once: power, integrity and the report all ask
            whole = reply_of_chunks(self._body_docs(rid)[0], self.incremental_streaming)
            if whole is not None and len(whole) > len(text) and whole.endswith(text):
                text = whole
        self._replies[rid] = text
        return text

    def finish_reason(self, rid: str):
        """A reply's finish reason: /generate's ``meta_info.finish_reason.type``, or an OpenAI choice's
        ``finish_reason`` string (the driver puts both in the body's meta)."""
        meta = (self.bodies.get(rid) or {}).get("meta")
        fr = meta.get("finish_reason") if isinstance(meta, dict) else None
        return fr.get("type") if isinstance(fr, dict) else fr

    def window(self, rid: str) -> tuple[float, float] | None:
        """Wall-clock span of a request, send to end (None when it was never sent)."""
        s, e = self.sends.get(rid), self.ends.get(rid)
        if s is None or not _num(s.get("wall")):
            return None
        end = e.get("wall") if e is not None and _num(e.get("wall")) else math.inf
        return float(s["wall"]), float(end)

    def agent_events(self, *kinds: str) -> list[dict]:
        """The engines' events (raw or copied in as ``agent``), of these kinds (all when none given)."""
        return [e for e, k in zip(self.agent, self._agent_kinds) if not kinds or k in kinds]

    def engine_rids(self) -> dict[str, str]:
        """Engine-side request id -> the client's rid, for the requests decode knows only by an id of
        its own (the OpenAI routes through sglang-router reach the engines under a fresh id, not the
        client's rid). Decode's ``kv_prealloc`` lists the canaries of the request's input; an engine id
        is named only where exactly one plan of this log carries exactly those canaries, or, where none
        does, exactly one carries every one of them (a conversation's later turn repeats its earlier
        turns' canaries and adds its own) — never by order or timing. Ids that are a plan's own rid are
        left out."""
        if self._engine_rids is not None:
            return self._engine_rids
        owner: dict[str, set] = defaultdict(set)
        for rid, p in self.plans.items():
            for c in p.get("canaries") or ():
                owner[c].add(rid)
        out: dict[str, str] = {}
        for e in self.agent_events("kv_prealloc"):
            eid, cs = e.get("rid"), e.get("canaries")
            if not eid or eid in self.plans or not cs or not isinstance(cs, list):
                continue
            who = set.intersection(*[owner.get(c, set()) for c in cs])
            same = {r for r in who if set(self.plans[r].get("canaries") or ()) == set(cs)}
            if len(same) == 1 or (not same and len(who) == 1):
                out[eid] = next(iter(same or who))
        self._engine_rids = out
        return out

    def decode_ids(self, rid: str) -> set[str]:
        """The ids decode knew ``rid`` by: its own, and the engine-side ids :meth:`engine_rids` names
        back to it."""
        return {rid} | {e for e, r in self.engine_rids().items() if r == rid}

    def fault_records(self, action: str | None = None) -> list[dict]:
        return [e for e in self.by_ev.get("fault", ()) if action is None or e.get("action") == action]


def as_history(h) -> History:
    """A :class:`History`, from one or from a list of records."""
    return h if isinstance(h, History) else History(h)


# --------------------------------------------------------------------------- views
# What the client received is read by JSON path, not by field name: every string value of every
# document a body held (a whole JSON body, each server-sent event, each line of a line-delimited
# stream), grouped by where it sat. A path's values in the order received are joined, so text an
# engine streams in pieces — content, a reasoning parser's reasoning_content, a tool call's arguments,
# /generate's incremental chunks, logprob tokens, an error's message — is whole again wherever it was
# carried, and a field an engine adds tomorrow needs no code here. Each value is read on its own too. A
# value that extends the one before it (cumulative /generate chunks, a field every chunk repeats) replaces
# it in the join rather than following it: joining a reply's prefixes would set its beginnings against its
# ends (a probe's reply opens mid-canary: such joins read as canary-shaped runs nobody minted).
JsonPath = tuple


def string_paths(v, path: JsonPath = ()) -> list[tuple[JsonPath, str]]:
    """Every non-empty string inside ``v`` with its path, depth-first in document order. A list item
    that is an object with an integer ``index`` (OpenAI's choices, tool calls) is placed by that index,
    not by its position: chunk after chunk, one choice's pieces share one path."""
    if isinstance(v, str):
        return [(path, v)] if v else []
    if isinstance(v, dict):
        return [x for k, x2 in v.items() for x in string_paths(x2, path + (str(k),))]
    if isinstance(v, (list, tuple)):
        out = []
        for i, x in enumerate(v):
            at = x.get("index") if isinstance(x, dict) else None
            at = at if isinstance(at, int) and not isinstance(at, bool) else i
            out += string_paths(x, path + (at,))
        return out
    return []


def path_name(path: JsonPath) -> str:
    out = ""
    for c in path:
        out += f"[{c}]" if isinstance(c, int) or c == "*" else (f".{c}" if out else c)
    return out or "(value)"


def _wild(path: JsonPath) -> JsonPath:
    return tuple("*" if isinstance(c, int) else c for c in path)


def joined_views(docs: list) -> list[tuple[str, str]]:
    """The strings of ``docs`` (JSON values in the order the client received them), read two ways: every
    value on its own line (``values``), and each path's text across the documents — by exact path (one
    choice, one tool call) and with list positions left open (a token list: logprob tokens), a document's
    values at one path joined first — read as deltas (joined) or as cumulative text (:func:`_runs`) as
    :func:`cumulative_chunks` says. A path with one document's text only is in ``values`` whole."""
    values: list[str] = []
    exact: dict[JsonPath, list[str]] = defaultdict(list)
    wild: dict[JsonPath, list[str]] = defaultdict(list)
    for d in docs:
        mine_exact: dict[JsonPath, list[str]] = defaultdict(list)
        mine_wild: dict[JsonPath, list[str]] = defaultdict(list)
        for path, s in string_paths(d):
            values.append(s)
            mine_exact[path].append(s)
            mine_wild[_wild(path)].append(s)
        for path, vs in mine_exact.items():
            exact[path].append("".join(vs))
        for path, vs in mine_wild.items():
            wild[path].append("".join(vs))
    out = [("values", "\n".join(values))] if values else []
    seen = set()
    for group in (exact, wild):
        for path, vals in group.items():
            if len(vals) < 2:
                continue
            if cumulative_chunks(vals):
                runs = _runs(vals)
                if len(runs) < 2:
                    continue  # the last value holds every one before it: in ``values`` whole
                text = "".join(runs)
            else:
                text = "".join(vals)
            if (path_name(_wild(path)), text) in seen:
                continue  # no list on the path: the exact and the open path are the same reading
            seen.add((path_name(_wild(path)), text))
            out.append((f"{path_name(path)} joined", text))
    return out


def _runs(vals: list[str]) -> list[str]:
    """A path's values in order, each run of values that extend the one before (cumulative text: the reply
    so far, chunk after chunk; a field every chunk repeats) kept as its last: joined, these are the text
    as received — a delta stream's pieces one after the other, a cumulative stream once, and what followed
    it (bytes after ``[DONE]``) after it — never a reply's beginnings set against its ends."""
    out: list[str] = []
    for v in vals:
        if out and v.startswith(out[-1]):
            out[-1] = v
        else:
            out.append(v)
    return out


def body_docs(raw: str) -> tuple[list, list[str]]:
    """The JSON documents a raw body held, in order — the body itself, or each server-sent event's
    ``data:`` (whatever came before it: a malformed line, ``[DONE]``), or each line of a line-delimited
    stream — and the lines that are not JSON. A line cut short is closed (:func:`_close`) and read as far
    as it got: a payload split between the last whole event and the cut line is whole again once joined."""
    text = raw.strip()
    if not text:
        return [], []
    try:
        return [json.loads(text)], []
    except ValueError:
        pass
    sse = any(line.lstrip().startswith("data:") for line in raw.split("\n"))
    docs, bad = [], []
    for line in raw.split("\n"):
        line = line.strip()
        if sse:
            if not line.startswith("data:"):
                continue
            line = line[5:].strip()
        if not line or line == "[DONE]":
            continue
        try:
            docs.append(json.loads(line))
            continue
        except ValueError:
            pass
        closed = _close(line)
        if closed is not None:
            docs.append(closed)
        else:
            bad.append(line)
    return docs, bad


def _close(data: str):
    """A JSON text cut short, closed where it stopped (an open string ended, a dangling key given a
    null, open objects and arrays closed); None when it is not a JSON text cut short."""
    stack, in_str, esc = [], False, False
    for ch in data:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not stack or stack.pop() != ch:
                return None
    if not stack and not in_str:
        return None
    tail = data
    if in_str:
        tail += ("\\" if esc else "") + '"'
    for attempt in ("", "null", ":null"):
        try:
            return json.loads(tail + attempt + "".join(reversed(stack)))
        except ValueError:
            continue
    stripped = tail.rstrip().rstrip(",:")  # a cut after a comma or colon
    try:
        return json.loads(stripped + "".join(reversed(stack)))
    except ValueError:
        return None


_STRING = re.compile(r'"((?:[^"\\]|\\.)*)(?:"|$)')


def _fragments(data: str) -> list[str]:
    """The string literals of a line that is no JSON at all, in order (what it carried still reached
    the client)."""
    out = []
    for m in _STRING.finditer(data):
        frag = m.group(1)
        try:
            frag = json.loads(f'"{frag}"')
        except ValueError:
            pass
        if frag:
            out.append(frag)
    return out


def raw_views(raw: str) -> list[tuple[str, str]]:
    """What a raw body carried: :func:`docs_views` of its documents (:func:`body_docs`)."""
    return docs_views(*body_docs(raw))


def docs_views(docs: list, bad: list[str]) -> list[tuple[str, str]]:
    """A body's documents read by path (:func:`joined_views`), plus the string literals of its lines that are
    no JSON (``bad``)."""
    out = joined_views(docs)
    frags = [f for line in bad for f in _fragments(line)]
    if frags:
        out += [("lines that are not JSON", "\n".join(frags)), ("lines that are not JSON, joined", "".join(frags))]
    return out


def stream_reply_text(raw: str, incremental: bool | None = None) -> str | None:
    """A /generate stream's reply text from its raw body: the chunks' texts joined where the engine streams
    only each chunk's new text (``incremental``: its ``--incremental-streaming-output``, which the
    experiment's header records), else the last chunk's; unrecorded, the last chunk's where every chunk
    reads as cumulative (:func:`cumulative_chunks`; SGLang's default), else the chunks' texts joined. None when the body
    holds no ``text`` chunks. (The reading decides only what the reply is held to: isolation scans both.)"""
    return reply_of_chunks(body_docs(raw)[0], incremental)


def reply_of_chunks(docs: list, incremental: bool | None) -> str | None:
    """:func:`stream_reply_text` of a body's documents (:func:`body_docs`)."""
    texts = [d["text"] for d in docs if isinstance(d, dict) and isinstance(d.get("text"), str)]
    if not texts:
        return None
    return "".join(texts) if reads_incremental(texts, incremental) else texts[-1]


def reads_incremental(texts: list[str], recorded: bool | None) -> bool:
    """Are these /generate chunk texts each only its new text? What the header recorded of decode's
    ``--incremental-streaming-output`` (``recorded``), else what the chunks say (:func:`cumulative_chunks`)."""
    return recorded if isinstance(recorded, bool) else not cumulative_chunks(texts)


def cumulative_chunks(texts: list[str]) -> bool:
    """Do these texts, received one after the other at one place, read as cumulative (each the text so
    far: SGLang's /generate by default) rather than as deltas (each only what is new)? Judged on the pairs
    whose first text has 2 or more characters (a one-character piece that the next one begins with is as
    likely a delta): cumulative where at least as many of them chain (the second begins with the first) as
    do not, and, with no such pair, where every pair chains. A cumulative stream with a corrupted chunk, or
    with bytes after ``[DONE]``, still reads as one; a delta stream rarely chains at all. A stream of one
    or two chunks can read either way: the runner records the mode (``engine.incremental_streaming_output``)."""
    pairs = list(zip(texts, texts[1:]))
    if not pairs:
        return True
    telling = [b.startswith(a) for a, b in pairs if len(a) >= 2]
    if not telling:
        return all(b.startswith(a) for a, b in pairs)
    return 2 * sum(telling) >= len(telling)


_PROBE_IDS: dict[int, str] | None = None


def decode_probe_ids(ids: list) -> str:
    """Output token ids as the probe's character-level tokenizer reads them (``?`` for an id that is
    not one character)."""
    global _PROBE_IDS
    if _PROBE_IDS is None:
        _PROBE_IDS = {i: t for t, i in char_vocab().items() if len(t) == 1}
    return "".join(_PROBE_IDS.get(i, "?") if isinstance(i, int) else "?" for i in ids)


def _decodes_probe_ids(model) -> bool:
    """Output ids are read with the probe's tokenizer unless the header names another model."""
    return model is None or str(model).startswith(("probe", "like:"))


def layout_spec(header) -> dict:
    """The header's ``layout.spec`` (the cluster spec the runner recorded); {} where absent or not an object."""
    layout = header.get("layout") if isinstance(header, dict) else None
    spec = layout.get("spec") if isinstance(layout, dict) else None
    return spec if isinstance(spec, dict) else {}


def serves_probe(header: dict) -> bool:
    """Does the experiment's served model answer by the probe's reply contract
    (:mod:`kvchaos.probe.contract`)? The header's ``layout.spec.probe`` where the runner recorded it (it
    reads the model directory's ``kvchaos-model.json``); else by the model's name: none named (a log
    written by hand), a layout's ``probe``/``probe:<kind>``, or a probe directory (``probe-<kind>-<digest>``,
    its long-context copies ``...-ctx<n>``: :func:`kvchaos.probe.reaching`)."""
    spec = layout_spec(header)
    if isinstance(spec.get("probe"), bool):
        return spec["probe"]
    model = spec.get("model")
    if model is None or _decodes_probe_ids(model):
        return True
    return str(model).rstrip("/").rsplit("/", 1)[-1].startswith("probe-")


def _strings(v) -> list[str]:
    """Every non-empty string inside ``v`` (dict values, list items), depth-first."""
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, dict):
        return [s for x in v.values() for s in _strings(x)]
    if isinstance(v, (list, tuple)):
        return [s for x in v for s in _strings(x)]
    return []


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _header_pace(head: dict):
    """The pace an experiment header records (``layout.spec.pace``), unchecked; None when absent."""
    return layout_spec(head).get("pace")


def _check_types(e: dict, where: str) -> None:
    """The fields the checkers read, with the types they need (a clear message, never a traceback)."""
    ev = e["ev"]
    rid = e.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise HistoryError(f"{where}: {ev} record: rid must be a non-empty string, got {rid!r}")
    if ev == "plan":
        if rid is None:
            raise HistoryError(f"{where}: plan without a rid")
        cs = e.get("canaries")
        if cs is not None and not (isinstance(cs, list) and all(isinstance(c, str) and canary.is_canary(c) for c in cs)):
            raise HistoryError(f"{where}: plan {rid}: canaries must be a list of canaries "
                               f"([ + 10 of {canary.ALPHABET} + ]), got {cs!r}"[:300])
        mnt = e.get("max_new_tokens")
        if mnt is not None and (not isinstance(mnt, int) or isinstance(mnt, bool)):
            raise HistoryError(f"{where}: plan {rid}: max_new_tokens must be an integer, got {mnt!r}")
    elif ev in ("body", "send", "end", "status") and rid is None:
        raise HistoryError(f"{where}: {ev} record without a rid (which request's is it?)")
    if ev == "body":
        for k in ("text", "error", "raw"):
            if e.get(k) is not None and not isinstance(e[k], str):
                raise HistoryError(f"{where}: body of {rid}: {k!r} must be a string, got {type(e[k]).__name__}")
    elif ev == "status":
        st = e.get("status")
        if st is not None and (not isinstance(st, int) or isinstance(st, bool)):
            raise HistoryError(f"{where}: status of {rid}: not an HTTP status: {st!r}")
    elif ev == "end":
        lat = e.get("latency_s")
        if lat is not None and not _num(lat):
            raise HistoryError(f"{where}: end of {rid}: latency_s must be a number, got {lat!r}")
        st = e.get("status")
        if st is not None and (not isinstance(st, int) or isinstance(st, bool)):
            raise HistoryError(f"{where}: end of {rid}: status is not an HTTP status: {st!r}")
    if ev == "experiment":
        for k in ("engine", "layout"):
            if e.get(k) is not None and not isinstance(e[k], dict):
                raise HistoryError(f"{where}: experiment header: {k!r} must be an object, got {e[k]!r}"[:300])
        pace = _header_pace(e)
        # liveness multiplies its bound by it: a header cannot stretch that bound without limit
        if pace is not None and not (_num(pace) and 1 <= pace <= PACE_MAX):
            raise HistoryError(f"{where}: experiment header: layout.spec.pace must be a number from 1 to {PACE_MAX}, "
                               f"got {pace!r}"[:300])
    for k in ("wall", "t"):
        if k in e and e[k] is not None and not _num(e[k]):
            raise HistoryError(f"{where}: {ev} record: {k!r} must be a number, got {e[k]!r}")


# --------------------------------------------------------------------------- witnesses
class Witness(dict):
    """One piece of evidence behind a verdict: a dict (serialized as it is) that renders itself —
    the one line the CLI, the terminal, JUnit and the report show for it."""

    def line(self, width: int = 240) -> str:
        return render_witness(self, width)


def witness(**fields) -> Witness:
    return Witness(fields)


def render_witness(w: dict, width: int = 240) -> str:
    """The one-line rendering of a witness (a :class:`Witness` or one read back from JSON)."""
    if not isinstance(w, dict):
        return str(w)[:width]
    if "victim_rid" in w and "cached_tokens" in w:  # a prefix-cache witness
        s = (f"victim {w['victim_rid']} ({w.get('victim_tenant')}, salt {w.get('victim_salt')!r}) was served "
             f"{w.get('cached_tokens')} cached tokens, its own salt's prefixes explain {w.get('same_salt_prefix')}")
        if w.get("owner_rid"):
            s += f"; from {w['owner_rid']} ({w.get('owner_tenant')}, salt {w.get('owner_salt')!r})"
        if "engine_salt" in w:
            s += f"; the engine used salt {w['engine_salt']!r}"
        return s[:width * 2]
    if "victim_rid" in w and "expected" in w and "got" in w:  # an integrity witness: a reply not what it must be
        at = f"at {w['position']}" if w.get("position") is not None else f"in {w.get('view')}"
        s = (f"{w['victim_rid']} ({w.get('victim_tenant')}): {w.get('problem')} {at}: expected {w['expected']!r}, "
             f"got {w['got']!r}; HTTP {w.get('status')}, {w.get('outcome')}")
        if w.get("owner_rid"):
            s += f"; the wrong bytes are {w['owner_rid']}'s ({w.get('owner_how')})"
        return s[:width * 2]
    if "victim_rid" in w:
        s = f"victim {w['victim_rid']} ({w.get('victim_tenant')}) holds {w.get('matched')!r} ({w.get('match')})"
        if w.get("owner_rid"):
            s += f" of owner {w['owner_rid']} ({w.get('owner_tenant')}), origin {w.get('origin')}"
        else:
            s += ": canary of unknown origin (minted by nobody known to this judgement)"
        s += f"; in {w.get('view')}" if w.get("view") else ""
        s += f"; HTTP {w.get('status')}, {w.get('outcome')}"
        s += "" if w.get("complete", True) else ", reply incomplete"
        mech = w.get("mechanism")
        if isinstance(mech, dict) and mech.get("shown"):
            s += f"; mechanism: {mech.get('what')}"
        return s[:width * 2]
    if "conflict" in w and "holder" in w:  # a page_ownership witness: the engines' own ledger
        pages = w.get("pages") or ([w["page"]] if w.get("page") is not None else [])
        n = w.get("n_pages") or len(pages)
        what = f"page {pages[0]}" + (f" (+{n - 1} more)" if n > 1 else "") if pages else "pages"
        s = f"{w.get('conflict')}: {what} on {w.get('role')}"
        s += f", held by {w['holder']}" if w.get("holder") else ""
        s += f", given to {w['to']}" if w.get("to") else ""
        s += f", in {w['where']}" if w.get("where") else ""
        return (s + f" — {w.get('problem')}")[:width * 2]
    keep = ("rid", "tenant", "problem", "outcome", "status", "latency_s", "missing", "room", "pages",
            "after_release_ms", "release_outcome", "kv_used_before", "kv_used_after", "error", "stage")
    s = ", ".join(f"{k}={w[k]}" for k in keep if w.get(k) is not None)
    return (s or json.dumps(w, default=str))[:width]
