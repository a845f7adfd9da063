"""SGLang's own KV defences as checkers (issue 30, the defence arm): ``kv_checksum`` and ``kv_canary``.

SGLang 0.5.23 ships two defences of its KV cache, both CUDA-only in practice
(:data:`kvchaos.cluster.spec.DEFENCES_NEED_CUDA`), both off by default:

* ``--disaggregation-enable-kv-checksum``: prefill digests the pages it sends (Adler-32), decode digests
  what it received before the request's first batch; a mismatch is logged (``KV checksum mismatch
  req=<rid> bootstrap_room=<room> expected=<hex> got=<hex>``, ``disaggregation/decode.py:3331-3335``; a
  peer TP rank's: ``... on a peer rank req=<rid> bootstrap_room=<room>``, ``:3347-3350``; logged at
  ``:3351``) and the request is aborted with HTTP 500 and the message ``KV checksum mismatch``
  (``:3365-3369``; with ``SGLANG_IS_IN_CI`` the scheduler raises instead, ``:3363-3364``). Decode admits
  a prefill of another KV layout unverified, once per layout: ``KV checksum skipped: prefill layout
  signature <hex> differs from this decode's <hex>`` (``:2592``); a checksum on one role only misaligns
  the metadata buffers and prefill logs ``Decode <addr> registered <n> metadata buffers but this prefill
  has <m>; ... enabled on one engine only: --disaggregation-enable-kv-checksum, ...``
  (``disaggregation/common/conn.py:624-633``).
* ``--kv-canary log|raise``: a stamp per KV slot, checked each forward; a violation is one structured
  line, ``kv_canary violation: launch_tag=<tag> fail_reason=<reasons> slot_idx=<slot> position=<pos>
  stored_token=<t> expected_token=<t> stored_chain_hash=<hex> expected_aux=<hex>``, then ``KV cache
  canary violation detected (kernel_kind=<tag>, slot_idx=<slot>, position=<pos>)`` and detail lines
  (``kv_canary/runner/violation_reporter.py:114-129``): logged as a WARNING in ``log`` mode (``:62-65``),
  raised as ``RuntimeError`` in ``raise`` mode (``:66-67``: the scheduler dies). Installed, it says so
  once per role: ``install_canary: disaggregation_mode=<mode> config=CanaryConfig(mode=<CanaryMode.LOG:
  'log'>, ...`` (``kv_canary/api.py:114-126``); a forward it could not verify: ``kv-canary: per-forward
  verify skipped this step due to overflow (total=<n>, capacity=<m>)`` (``runner/enable_warner.py:30-35``).
  The canary names a slot, never a request.

Each checker reads the defence's own signals: the engines' logs over the experiment (where the arm's
``observed`` record, written when the experiment opened — :func:`observe` — says they are and how far
they had got), ``engine_error`` records whose line is one of the above, and (the checksum) the replies
decode aborted with ``KV checksum mismatch``. Per defence:

* **FAIL** when it fired, a witness per firing (the request or the slot, the role, the line);
* **PASS** only when it was demonstrably on on both roles (``/server_info`` at the experiment's start, or
  its flag, server args or install line in the role's log), both logs were read over the experiment,
  it never said it skipped anything, and at least one request was served;
* **UNKNOWN** with the reason otherwise — always on a CPU device.

``leak = True``: a mismatch means decode holds KV that is not what prefill sent, a canary violation a
slot read or written for a request that does not own it: the engine's own evidence of the corruption a
leak is made of (the checksum aborts its request, so its FAIL is the evidence, not a leak the client
saw). A leak checker's FAIL is red in every experiment that is not a planted one. ``log_only = False``:
the checkers need the engines' logs and the arm's record, so the policy never runs them by itself — they
judge only where the defence arm adds them (``--kvchaos-defences``, :func:`arm_checkers`), never by
default, never on CPU. Added unclaimed, their UNKNOWN is shown, not red, and adding them can only add
red: the status of an experiment is the worst of its items.
"""

from __future__ import annotations

import os
import re

from kvchaos.cluster.spec import DEFENCES_NEED_CUDA
from kvchaos.history import as_history, layout_spec, witness
from kvchaos.workload.snapshots import server_field

from .base import Checker, Verdict, ladder

# --------------------------------------------------------------------------- the SGLang 0.5.23 strings
CHECKSUM_ABORT = "KV checksum mismatch"  # the abort's message (disaggregation/decode.py:3365-3369), HTTP 500
CHECKSUM_MISMATCH = re.compile(r"KV checksum mismatch (?P<peer>on a peer rank )?req=(?P<engine_rid>\S+) "
                               r"bootstrap_room=(?P<room>\S+)"
                               r"(?: expected=(?P<expected>0x[0-9a-fA-F]+) got=(?P<got>0x[0-9a-fA-F]+))?")
REPLY_ABORT = re.compile(r'"(?:message|detail)"\s*:\s*"' + CHECKSUM_ABORT)  # the error body / stream abort
CHECKSUM_CUT = re.compile(r"KV checksum mismatch (?P<peer>on a peer rank )?req=(?P<engine_rid>\S+)")  # a line cut short
CHECKSUM_SKIPPED = re.compile(r"KV checksum skipped: prefill layout signature (?P<theirs>\S+) differs from "
                              r"this decode's (?P<mine>[0-9a-fA-Fx]+)")
CHECKSUM_ONE_SIDED = re.compile(r"Decode (?P<peer>\S+) registered (?P<remote>\d+) metadata buffers but this "
                                r"prefill has (?P<local>\d+)")
CANARY_VIOLATION = "kv_canary violation:"
CANARY_HEADER = re.compile(r"KV cache canary violation detected \(kernel_kind=(?P<launch_tag>[^,)]*)"
                           r"(?:, slot_idx=(?P<slot_idx>-?\d+))?(?:, position=(?P<position>-?\d+))?")
CANARY_OVERFLOW = re.compile(r"kv-canary: per-forward verify skipped this step due to overflow"
                             r"(?: \(total=(?P<total>\d+), capacity=(?P<capacity>\d+)\))?")
CANARY_INSTALLED = re.compile(r"install_canary: disaggregation_mode=(?P<mode>\S+) "
                              r"config=CanaryConfig\(mode=<CanaryMode\.(?P<canary>[A-Z]+)")
# what says a defence is on: the server args SGLang logs at start (entrypoints/engine.py:1185), the
# command line kvchaos' launcher writes at the head of each launch's log (kvchaos/cluster/procs.py)
SERVER_ARGS = "server_args={"
ARGS_CHECKSUM = re.compile(r"'disaggregation_enable_kv_checksum': (?P<v>True|False)")
ARGS_CANARY = re.compile(r"'kv_canary': '(?P<v>[a-z]+)'")
LAUNCH = re.compile(r"^# kvchaos: (?P<role>[\w-]+): (?P<argv>.*)$")
CHECKSUM_FLAG = "--disaggregation-enable-kv-checksum"
CANARY_FLAG = "--kv-canary"
CANARY_ON = ("log", "raise")
ROLES = ("prefill", "decode")
_KV = re.compile(r"(\w+)=(\S+)")
MAX_LOG_BYTES = 512 * 1024 * 1024  # a log larger than this is not read whole (the head is skipped)


# --------------------------------------------------------------------------- what the arm records
def observe(cluster) -> dict:
    """What the defence arm records when an experiment opens (the ``observed`` record's ``defences``):
    each role's defence settings from its ``/server_info`` and where its log stands (path, byte
    offset), so that the checkers read the experiment's part of each log and nothing before it."""
    roles, logs = {}, {}
    for role in ROLES:
        try:
            info = cluster.server_info(role)
            roles[role] = {"kv_checksum": server_field(info, "disaggregation_enable_kv_checksum"),
                           "kv_canary": server_field(info, "kv_canary"), "device": server_field(info, "device")}
        except Exception as e:  # noqa: BLE001 - an unreachable server is recorded: the checkers say UNKNOWN
            roles[role] = {"error": f"{type(e).__name__}: {e}"[:300]}
    paths = cluster.log_paths() if callable(getattr(cluster, "log_paths", None)) else {}
    for role in ROLES:
        p = paths.get(role)
        if not p:
            continue
        try:
            logs[role] = {"path": str(p), "offset": os.path.getsize(p)}
        except OSError as e:
            logs[role] = {"path": str(p), "error": f"{type(e).__name__}: {e}"[:300]}
    return {"roles": roles, "logs": logs}


# --------------------------------------------------------------------------- reading the logs
class Line(str):
    """One log line, with where it came from (role, log path, byte offset)."""

    role: str
    log: str | None
    offset: int | None

    def __new__(cls, text: str, role: str, log: str | None = None, offset: int | None = None):
        s = super().__new__(cls, text)
        s.role, s.log, s.offset = role, log, offset
        return s


class LogRead:
    """One role's log as the checkers read it: the launches whose lines reach into the window (their
    command line, server args and canary install lines), the window's lines, and what was read."""

    def __init__(self, role: str, path: str, start: int):
        self.role, self.path, self.start = role, path, start
        self.end = start
        self.error: str | None = None
        self.lines: list[Line] = []     # the window: [start, end)
        self.launches: list[dict] = []  # each launch of the role that covers the window, oldest first

    def read(self) -> "LogRead":
        try:
            size = os.path.getsize(self.path)
            if size < self.start:
                self.error = f"{self.path} is shorter ({size} bytes) than where the experiment began ({self.start})"
                return self
            head = max(0, size - MAX_LOG_BYTES)
            with open(self.path, "rb") as f:
                f.seek(head)
                data = f.read(size - head)
        except OSError as e:
            self.error = f"{type(e).__name__}: {e}"[:300]
            return self
        cut = data.rfind(b"\n") + 1  # whole lines only: a line still being written is not read
        pos = head
        launch = {"at": None, "argv": None, "server_args": None, "installed": None}
        for raw in data[:cut].split(b"\n")[:-1]:
            text = raw.decode("utf-8", "replace")
            at, pos = pos, pos + len(raw) + 1
            m = LAUNCH.match(text)
            if m and m["role"] == self.role:
                if at > self.start and any(v is not None for v in launch.values()):
                    self.launches.append(launch)  # restarted during the experiment: both launches count
                launch = {"at": at, "argv": m["argv"], "server_args": None, "installed": None}
            elif SERVER_ARGS in text:
                launch["server_args"] = _server_args(text)
            else:
                mi = CANARY_INSTALLED.search(text)
                if mi:
                    launch["installed"] = mi["canary"].lower()
            if at >= self.start:
                self.lines.append(Line(text, self.role, self.path, at))
        self.launches.append(launch)
        self.end = head + cut
        if head > self.start:
            self.error = f"{self.path}: only its last {MAX_LOG_BYTES} bytes were read (from {head})"
        return self


def _server_args(text: str) -> dict:
    out = {}
    m = ARGS_CHECKSUM.search(text)
    if m:
        out["kv_checksum"] = m["v"] == "True"
    m = ARGS_CANARY.search(text)
    if m:
        out["kv_canary"] = m["v"]
    return out


def _argv_flags(argv: str) -> dict:
    toks = argv.split()
    out = {"kv_checksum": CHECKSUM_FLAG in toks, "kv_canary": "none"}
    for i, t in enumerate(toks):
        if t == CANARY_FLAG and i + 1 < len(toks):
            out["kv_canary"] = toks[i + 1]
        elif t.startswith(CANARY_FLAG + "="):
            out["kv_canary"] = t.split("=", 1)[1]
    return out


# --------------------------------------------------------------------------- the checkers
class _Defence(Checker):
    """What both defences share: where the evidence is, whether the defence was on, the verdict."""

    leak = True       # its FAIL is the engine's own evidence of corrupted or foreign KV
    log_only = False  # it needs the engines' logs and the arm's record: only the defence arm runs it
    defence = ""      # what the witnesses and reasons call it
    flag = ""

    def __init__(self, read_logs: bool = True):
        self.read_logs = read_logs

    # -- what each defence decides
    def enabled(self, setting: dict) -> bool | None:
        raise NotImplementedError

    def scan(self, lines: list[Line], h) -> tuple[list, list]:
        """(witnesses, gaps) in these lines: each firing; each thing it said it did not check."""
        raise NotImplementedError

    def from_replies(self, h) -> list:
        return []

    # -- shared
    def check(self, history, registry=None) -> Verdict:
        h = as_history(history)
        arm = _arm_record(h)
        device = _device(h, arm)
        reads = self._read(arm) if self.read_logs else {}
        lines = [ln for r in reads.values() for ln in r.lines] + _engine_error_lines(h)
        witnesses, gaps = self.scan(lines, h)
        witnesses = _merge(witnesses, self.from_replies(h))
        on = {role: self._on(role, arm, reads.get(role)) for role in ROLES}
        served = sum(1 for rid in h.plans if h.statuses.get(rid) == 200)
        stats = {"defence": self.defence, "device": device, "served": served, "fired": len(witnesses),
                 "on": {r: {"on": v, "evidence": ev} for r, (v, ev) in on.items()},
                 "logs": {r: {"path": x.path, "from": x.start, "to": x.end, "lines": len(x.lines),
                              **({"error": x.error} if x.error else {})} for r, x in reads.items()},
                 "gaps": [g["line"][:300] for g in gaps][:20]}
        missing_logs = [r for r in ROLES if r not in reads or reads[r].error]
        off = [r for r in ROLES if on[r][0] is not True]
        unknown = [
            (device == "cpu", f"device cpu: {DEFENCES_NEED_CUDA}"),
            (arm is None, f"the defence arm recorded nothing for this experiment (no 'observed' record with "
                          f"'defences': run it with --kvchaos-defences / KVCHAOS_DEFENCES=1): {self.flag} cannot "
                          "be shown on, and its log lines were not read"),
            (bool(off), lambda: f"{self.flag} not demonstrably on on {' and '.join(off)}: " + "; ".join(
                f"{r}: {on[r][1] or ['no evidence']}" for r in off)[:600]),
            (bool(missing_logs), lambda: "the engine log of " + " and ".join(missing_logs) + " was not read over "
                                 "the experiment: " + "; ".join(
                                     (reads[r].error if r in reads else "no log path recorded (an attached "
                                      "cluster's logs are not the harness's)") for r in missing_logs)[:600]),
            (bool(gaps), lambda: f"{self.defence} said it did not check everything: {gaps[0]['line'][:300]}"
                                 + (f" (and {len(gaps) - 1} more)" if len(gaps) > 1 else "")),
            (served == 0, f"no request was served: {self.defence} checked nothing"),
        ]
        return ladder(self.name, stats, witnesses, self.summary, unknown,
                      f"{self.defence} was on on both roles and did not fire over {served} served request(s) "
                      f"({sum(len(x.lines) for x in reads.values())} log lines read)")

    def summary(self, witnesses) -> str:
        raise NotImplementedError

    def _read(self, arm) -> dict:
        out = {}
        for role, where in ((arm or {}).get("logs") or {}).items():
            if role not in ROLES or not isinstance(where, dict) or not where.get("path"):
                continue
            offset = where.get("offset", 0)
            ok = isinstance(offset, int) and not isinstance(offset, bool) and offset >= 0
            r = LogRead(role, str(where["path"]), offset if ok else 0)
            if where.get("error") or not ok:
                r.error = str(where.get("error") or f"the arm recorded no usable offset ({offset!r})")[:300]
                out[role] = r
                continue
            out[role] = r.read()
        return out

    def _on(self, role: str, arm, read: LogRead | None) -> tuple[bool | None, list[str]]:
        """Whether the defence was on on ``role`` over the experiment: every piece of evidence says on
        and there is some. Evidence: ``/server_info`` when the experiment opened; per launch of the role
        that reached into the experiment, the launcher's command line, the server args SGLang logged and
        (the canary) its install line."""
        said = []
        info = ((arm or {}).get("roles") or {}).get(role) or {}
        if info and "error" not in info:
            v = self.enabled(info)
            if v is not None:
                said.append((v, f"/server_info: {self._show(info)}"))
        for launch in (read.launches if read is not None else []):
            for src, setting in (("command line", _argv_flags(launch["argv"]) if launch["argv"] else None),
                                 ("server_args", launch["server_args"]),
                                 ("install_canary",
                                  {"kv_canary": launch["installed"]} if launch["installed"] else None)):
                if setting:
                    v = self.enabled(setting)
                    if v is not None:
                        said.append((v, f"{src}: {self._show(setting)}"))
        if not said:
            return None, []
        return all(v for v, _ in said), [s for _, s in said]

    def _show(self, setting: dict) -> str:
        raise NotImplementedError


class KvChecksum(_Defence):
    """``kv_checksum``: decode's Adler-32 of the KV it received is prefill's. FAIL names each request
    decode aborted for a mismatch (its rid, bootstrap room, both digests, the log line or the reply)."""

    name = "kv_checksum"
    defence = "the KV checksum"
    flag = CHECKSUM_FLAG

    def enabled(self, setting):
        v = setting.get("kv_checksum")
        return None if v is None else bool(v)

    def _show(self, setting):
        return f"kv_checksum={setting.get('kv_checksum')}"

    def scan(self, lines, h):
        ids = h.engine_rids()
        witnesses, gaps, seen = [], [], {}
        for ln in lines:
            m = CHECKSUM_MISMATCH.search(ln) or CHECKSUM_CUT.search(ln)
            if m:
                m = {"room": None, "expected": None, "got": None, **m.groupdict()}
                erid = m["engine_rid"]
                key = (ln.role, erid, m["room"])  # every TP rank logs the request: one witness per request
                if key in seen:
                    if m["expected"] and not seen[key].get("expected"):
                        seen[key].update(expected=m["expected"], got=m["got"])
                    continue
                rid = erid if erid in h.plans else ids.get(erid)
                digests = (f"expected {m['expected']}, got {m['got']}" if m["expected"] else
                           "on a peer TP rank" if m["peer"] else "the line is cut short" if m["room"] is None else
                           "digests not logged")
                witnesses.append(witness(
                    defence=self.name, role=ln.role, rid=rid, engine_rid=erid, bootstrap_room=m["room"],
                    expected=m["expected"], got=m["got"], peer_rank=bool(m["peer"]), line=ln.strip()[:500],
                    log=ln.log, offset=ln.offset, source="log",
                    problem=f"decode's KV checksum mismatch ({digests}; room {m['room']}"
                            + ("" if rid else f", engine id {erid} matches no request of this log")
                            + "): the KV decode received is not what prefill sent; the request was aborted"))
                seen[key] = witnesses[-1]
                continue
            if CHECKSUM_SKIPPED.search(ln) or CHECKSUM_ONE_SIDED.search(ln):
                gaps.append({"role": ln.role, "line": ln.strip()})
        return witnesses, gaps

    def from_replies(self, h):
        """The requests the client saw aborted for a mismatch: a reply (an error body, or a stream's
        abort finish reason) carrying SGLang's message."""
        out = []
        for rid in h.plans:
            body = h.bodies.get(rid) or {}
            meta = body.get("meta") if isinstance(body.get("meta"), dict) else {}
            fr = meta.get("finish_reason") if isinstance(meta.get("finish_reason"), dict) else {}
            said = [str(body.get("error") or ""), str(fr.get("message") or "")]
            raw = body.get("raw") if isinstance(body.get("raw"), str) else ""
            status = h.statuses.get(rid)
            if any(CHECKSUM_ABORT in s for s in said) or REPLY_ABORT.search(raw) or (
                    isinstance(status, int) and status >= 500 and CHECKSUM_ABORT in raw):
                out.append(witness(defence=self.name, role="decode", rid=rid, status=status,
                                   source="reply", outcome=h.outcome(rid),
                                   problem=f"aborted by decode's KV checksum: the reply says {CHECKSUM_ABORT!r}"))
        return out

    def summary(self, witnesses):
        rids = [w.get("rid") or f"engine id {w.get('engine_rid')}" for w in witnesses]
        return (f"{len(witnesses)} KV checksum mismatch(es): decode received KV that is not what prefill sent "
                f"and aborted the request ({', '.join(map(str, rids[:5]))}{', ...' if len(rids) > 5 else ''})")


class KvCanary(_Defence):
    """``kv_canary``: no KV slot's stamp disagrees with what was written or expected there. FAIL names
    each violation (role, slot, position, launch tag, failure reasons, the line): the canary knows slots,
    not requests."""

    name = "kv_canary"
    defence = "the KV canary"
    flag = CANARY_FLAG

    def enabled(self, setting):
        v = setting.get("kv_canary")
        return None if v is None else str(v).lower() in CANARY_ON

    def _show(self, setting):
        return f"kv_canary={setting.get('kv_canary')}"

    def scan(self, lines, h):
        witnesses, gaps, seen = [], [], set()
        prev = None  # the last violation's (role, slot, position): its header line follows it
        for ln in lines:
            i = ln.find(CANARY_VIOLATION)
            if i >= 0:
                tail = ln[i:].strip()
                f = dict(_KV.findall(tail[len(CANARY_VIOLATION):]))
                prev = (ln.role, f.get("slot_idx"), f.get("position"))
                if (ln.role, tail) not in seen:  # logged, then raised: one violation
                    seen.add((ln.role, tail))
                    witnesses.append(self._witness(ln, f))
                continue
            m = CANARY_HEADER.search(ln)
            if m:
                if prev != (ln.role, m["slot_idx"], m["position"]):  # a header with no structured line
                    witnesses.append(self._witness(ln, {k: v for k, v in m.groupdict().items() if v is not None}))
                prev = None
                continue
            if CANARY_OVERFLOW.search(ln):
                gaps.append({"role": ln.role, "line": ln.strip()})
        return witnesses, gaps

    def _witness(self, ln: Line, f: dict):
        return witness(
            defence=self.name, role=ln.role, slot_idx=f.get("slot_idx"), position=f.get("position"),
            launch_tag=f.get("launch_tag"), fail_reason=f.get("fail_reason"), stored_token=f.get("stored_token"),
            expected_token=f.get("expected_token"), line=ln.strip()[:500], log=ln.log, offset=ln.offset,
            source="log", problem=f"kv_canary violation on {ln.role}: slot {f.get('slot_idx', '?')} position "
                                  f"{f.get('position', '?')} ({f.get('launch_tag', '?')}: {f.get('fail_reason', '?')})")

    def summary(self, witnesses):
        roles = sorted({w.get("role") for w in witnesses})
        w = witnesses[0]
        return (f"{len(witnesses)} kv_canary violation(s) on {' and '.join(roles)}: a KV slot's stamp is not what "
                f"its writer left (first: slot {w.get('slot_idx')} position {w.get('position')}, "
                f"{w.get('fail_reason')})")


DEFENCES = (KvChecksum, KvCanary)


def arm_checkers() -> list[Checker]:
    """The checkers the defence arm adds to every experiment."""
    return [c() for c in DEFENCES]


# --------------------------------------------------------------------------- helpers
def _arm_record(h) -> dict | None:
    """The defence arm's last ``observed`` record's ``defences``, or None."""
    got = [e["defences"] for e in h.by_ev.get("observed", ()) if isinstance(e.get("defences"), dict)]
    return got[-1] if got else None


def _device(h, arm) -> str | None:
    """The device the engines ran on: the experiment header's cluster spec, else what /server_info said."""
    spec = layout_spec(h.header)
    devices = {spec.get("device")} | {(r or {}).get("device") for r in ((arm or {}).get("roles") or {}).values()
                                      if isinstance(r, dict)}
    devices = {str(d) for d in devices if d}
    if any(d == "cpu" or d.startswith("cpu") for d in devices):
        return "cpu"
    return sorted(devices)[0] if devices else None


def _engine_error_lines(h) -> list[Line]:
    """The lines of the history's ``engine_error`` records (a defence's line registered as an engine
    error reaches the history this way)."""
    out = []
    for e in h.by_ev.get("engine_error", ()):
        line = e.get("line")
        if isinstance(line, str) and line:
            out.append(Line(line, str(e.get("role") or "?"), e.get("log"), None))
    return out


def _merge(from_logs: list, from_replies: list) -> list:
    """One witness per firing: a log line that names a request the client saw aborted carries the reply's
    status; a reply no log line names is a witness of its own; the same line read twice counts once."""
    out, seen = [], set()
    for w in from_logs:
        key = (w.get("role"), w.get("line"))
        if key in seen:
            continue
        seen.add(key)
        out.append(w)
    named = {w.get("rid") for w in out if w.get("rid")}
    for w in from_replies:
        if w["rid"] in named:
            for x in out:
                if x.get("rid") == w["rid"]:
                    x["status"] = w.get("status")
            continue
        out.append(w)
    return out
