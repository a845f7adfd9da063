"""Green must never lie: properties of ``kvchaos judge`` and of the suites' policy over generated logs.

1. ``test_leak_never_green[<class>]``: a log in which the CLIENT received a foreign canary (owned by
   another request of the log, of another judged log, or of nobody) is never green — ``kvchaos judge``
   exits 1 or 3 (2 too where the shape is malformed input), also with ``--accept-known`` and with
   ``--checkers liveness``, and the suites' policy (:func:`suite_judgement`) is red. One test per
   shape class; inside a class Hypothesis draws its variants, and the test checks it ran every one.
2. ``test_clean_logs_with_power_are_green``: logs where every request recites exactly its own canaries
   (>= 60 complete HTTP-200 probe requests, every shape of reply, < 20 % clean noise) are green.
3. ``test_power_never_faked``: the power floor gamed (requests with no canaries, two with many, most
   replies 503) is not green.
4. ``test_generators_produce_every_shape``: what the generators write really has each shape (read
   back from the files, not from the generator's own labels), and every leak log's leak-free twin is
   green — so a leak property cannot pass because a shape never occurs or the log was red anyway.
5. ``test_generated_records_are_the_drivers``: the records the generators write for a reply are the
   ones ``kvchaos.workload.driver.Driver`` writes when a local server sends it the same bytes.

Logs are written by ``tests/strategies.py`` with ``EventLog`` as the driver writes them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import io
import json
import tempfile
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, event, find, given, settings

from kvchaos import canary
from kvchaos.cli import main as kvchaos_main

from tests import strategies as S


# ============================================================================== ADAPTER
# The only code in this file that knows the suites' API: what an Experiment does with its records —
# the checkers it was given plus the leak checkers that always run, the history indexed once, the
# canary registry handed to the checkers, the policy's gate and judgement (isolation and liveness
# required; known findings accepted, as CI's CPU profile does: a KNOWN accepted counts as green).
from kvchaos.history import History, read_records  # noqa: E402
from kvchaos.oracles import Isolation, Liveness, Sensitivity  # noqa: E402
from kvchaos.policy import Context, Policy  # noqa: E402


def load_history(path) -> list[dict]:
    """How a suite reads an event log back from disk: the one loader."""
    return read_records(path)


def suite_judgement(events: list[dict], registry) -> tuple[bool, str]:
    """(green, detail) of one experiment's events; ``registry``: every canary minted in the session."""
    p = Policy(accept_known=True)
    checks, claimed = p.checks([Isolation(), Sensitivity(), Liveness(bound_s=60)])
    try:
        h = History(events)
    except ValueError as e:  # a history the loader refuses (a record twice, ...) is never green
        return False, f"history refused: {e}"
    j = p.judge(p.gate(checks.check(h, registry), h), Context.of(h, (), registry),
                required={"isolation": "pass", "liveness": "pass"}, claimed=claimed)
    return not j.red, f"{j.status}: {j.message()}"
# ============================================================================== end of adapter


# no Phase.explain: its line tracing makes every shrink step of a failing example ~50x slower
PROPERTY = dict(derandomize=True, deadline=None, database=None, print_blob=False,
                phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                       HealthCheck.large_base_example])
LEAK_EXAMPLES = 12       # drawn per class (22 classes), plus the simplest example of every variant not drawn
MIRROR_EXAMPLES = 60
POWER_EXAMPLES = 8
SHAPE_EXAMPLES = 6       # drawn per class in the coverage test, plus every variant not drawn


def judge(paths, *flags) -> tuple[int, str]:
    """``kvchaos judge PATHS FLAGS`` in-process: (exit code, stdout + stderr)."""
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        try:
            rc = kvchaos_main(["judge", *map(str, paths), *flags])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return rc, out.getvalue()


def suite(logs: dict, sc: S.Scenario) -> tuple[bool, str]:
    """The suites' policy over every judged log (the session: the judged logs' canaries): green only
    if every one is green."""
    reg = canary.Registry()
    histories = []
    for path in logs["judged"]:
        try:
            evs = load_history(path)
        except ValueError as e:  # a loader that rejects malformed input: not green (only allowed for those)
            if not sc.malformed:
                raise
            return False, f"load_history rejected {path}: {e}"
        histories.append((path, evs))
        reg.add_plans({e["rid"]: e for e in evs if e.get("ev") == "plan" and e.get("rid")}, str(path))
    details = []
    for path, evs in histories:
        green, detail = suite_judgement(evs, reg)
        details.append(f"{Path(path).name}: {detail}")
        if not green:
            return False, "\n".join(details)
    return True, "\n".join(details)


def _tail(out: str, n: int = 2400) -> str:
    """The head of a judge's output (the first log's verdicts) and its last line."""
    return out if len(out) <= n else out[:n - 300] + "\n...\n" + out[-300:]


def _where(sc: S.Scenario, logs: dict) -> str:
    m = logs["meta"]
    return f"foreign canary {m.get('foreign')} (owner: {m.get('owner')}) in the reply of {m.get('victims')}"


@functools.cache
def canonical(cls: str, variant: str) -> S.Scenario:
    """The simplest scenario of ``variant`` (run when the drawn examples missed it)."""
    return find(S.leak_scenarios(cls, variant), lambda _sc: True,
                settings=settings(database=None, derandomize=True, phases=[Phase.generate], max_examples=1))


def _kind(e: BaseException) -> str:
    """Which assertion failed (its message up to the exit code / verdict)."""
    return str(e).split(" on a log", 1)[0].split(" exit ", 1)[0] if isinstance(e, AssertionError) else type(e).__name__


def every_variant(cls: str, prop, check) -> None:
    """Run the Hypothesis property ``prop`` (which calls ``check`` and returns the variants it passed),
    then ``check`` on the canonical example of every variant of ``cls`` that no drawn example passed
    (so each variant is checked through every assertion even when the drawn ones failed early); raise
    every failure together."""
    errors, passed, kinds = [], set(), set()
    try:
        prop(passed)
    except Exception as e:  # noqa: BLE001 - Hypothesis' falsifying example(s), reported with the rest
        errors.append(e)
        kinds |= {_kind(x) for x in (e.exceptions if isinstance(e, BaseExceptionGroup) else [e])}
    for v in sorted(S.VARIANTS[cls] - passed):
        sc = canonical(cls, v)
        try:
            check(sc)
            passed.add(v)
        except AssertionError as e:
            if _kind(e) not in kinds:  # one example per failing assertion, as Hypothesis reports them
                kinds.add(_kind(e))
                errors.append(AssertionError(f"{e}\nFalsifying example (the simplest of variant {v!r}): {sc!r}"))
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ExceptionGroup(f"{cls}: {len(errors)} failures", errors)
    assert passed == S.VARIANTS[cls], f"{cls}: checked variants {sorted(passed)}, want {sorted(S.VARIANTS[cls])}"


# ------------------------------------------------------------------------------ 1. leak never green
def check_leak(sc: S.Scenario, tmp_path: Path) -> None:
    allowed = {1, 2, 3} if sc.malformed else {1, 3}
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        logs = sc.write(Path(d))
        where = _where(sc, logs)
        rc, out = judge(logs["judged"])
        assert rc in allowed, f"kvchaos judge exit {rc} on a log with a leak: {where}\n{_tail(out)}"
        rc, out = judge(logs["judged"], "--accept-known")
        assert rc in allowed, f"kvchaos judge --accept-known exit {rc} on a log with a leak: {where}\n{_tail(out)}"
        green, detail = suite(logs, sc)
        assert not green, f"suite_judgement green on a log with a leak: {where}\n{_tail(detail)}"
        rc, out = judge(logs["judged"], "--checkers", "liveness")
        assert rc in allowed, (f"kvchaos judge --checkers liveness exit {rc} on a log with a leak: {where}\n"
                               f"{_tail(out)}")


@pytest.mark.parametrize("cls", list(S.LEAK_CLASSES))
def test_leak_never_green(cls, tmp_path):
    def prop(passed: set):
        @settings(max_examples=LEAK_EXAMPLES, **PROPERTY)
        @given(sc=S.leak_scenarios(cls))
        def leak_never_green(sc):
            event(f"variant={sc.variant}")
            check_leak(sc, tmp_path)
            passed.add(sc.variant)

        leak_never_green()

    every_variant(cls, prop, lambda sc: check_leak(sc, tmp_path))


# ------------------------------------------------------------------------------ 2. clean logs with power are green
def test_clean_logs_with_power_are_green(tmp_path):
    seen = Counter()

    @settings(max_examples=MIRROR_EXAMPLES, **PROPERTY)
    @given(sc=S.mirror())
    def clean_is_green(sc):
        for lg in sc.params["logs"]:
            seen.update(f"{'generate' if lg['pd'] else S.EP[k[0]]}/{k.split('/')[1]}" for k in lg["base"])
            seen.update(f"noise:{w}" for w in lg["noise"] if w != "leg_error" or lg["pd"])
            seen.update(["pd" if lg["pd"] else "router", f"logs:{len(sc.params['logs'])}"])
        with tempfile.TemporaryDirectory(dir=tmp_path) as d:
            logs = sc.write(Path(d))
            rc, out = judge(logs["judged"])
            assert rc == 0, f"kvchaos judge exit {rc} on clean logs with power\n{_tail(out)}"
            green, detail = suite(logs, sc)
            assert green, f"suite_judgement red on clean logs with power\n{_tail(detail)}"

    clean_is_green()
    want = {f"{e}/{d}" for e in S.EP.values() for d in S.DELIVERIES} | {f"noise:{w}" for w in S.NOISE} \
        | {"pd", "router", "logs:1", "logs:2"}
    assert not want - set(seen), f"the mirror property never ran {sorted(want - set(seen))}"


# ------------------------------------------------------------------------------ 3. power is never faked
def test_power_never_faked(tmp_path):
    @settings(max_examples=POWER_EXAMPLES, **PROPERTY)
    @given(sc=S.gamed_power())
    def gamed_is_not_green(sc):
        with tempfile.TemporaryDirectory(dir=tmp_path) as d:
            logs = sc.write(Path(d))
            rc, out = judge(logs["judged"])
            assert rc in (1, 3), (f"kvchaos judge exit {rc} on a log whose power floor is gamed (requests without "
                                  f"canaries, most replies 503)\n{_tail(out)}")
            rc, out = judge(logs["judged"], "--accept-known")
            assert rc in (1, 3), f"kvchaos judge --accept-known exit {rc} on a gamed power floor\n{_tail(out)}"
            green, detail = suite(logs, sc)
            assert not green, f"suite_judgement green on a gamed power floor\n{_tail(detail)}"

    gamed_is_not_green()


# ------------------------------------------------------------------------------ 4. the generators make every shape
def _lines(path: Path) -> list[str]:
    return [x for x in path.read_text().split("\n") if x.strip()]


def _records(path: Path) -> list[dict]:
    out = []
    for x in _lines(path):
        try:
            out.append(json.loads(x))
        except json.JSONDecodeError:
            pass
    return out


def _dup_keys(line: str) -> bool:
    dup = []

    def hook(pairs):
        keys = [k for k, _v in pairs]
        if len(keys) != len(set(keys)):
            dup.append(keys)
        return dict(pairs)
    try:
        json.loads(line, object_pairs_hook=hook)
    except json.JSONDecodeError:
        return False
    return bool(dup)


def _deltas(raw: str) -> str:
    """Every streamed text of every ``data:`` line of ``raw`` that parses, concatenated (deltas),
    whether before or after ``[DONE]`` or a malformed line."""
    out = []
    for line in raw.split("\n"):
        line = line.strip()
        if not line.startswith("data:"):
            continue
        try:
            ev = json.loads(line[5:].strip())
        except ValueError:
            continue
        if isinstance(ev, dict):
            for ch in ev.get("choices") or []:
                out.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
    return "".join(out)


def observed(sc: S.Scenario, logs: dict) -> set:
    """Shape features read back from the files: where the client's bytes hold the foreign payload."""
    meta = logs["meta"]
    f = meta.get("foreign")
    feats = set()
    if not f:
        return feats
    pay = canary.payload(f)
    victims = set(meta.get("victims") or ())
    main = logs["main"]
    lines = _lines(main)
    recs = _records(main)
    try:
        json.loads(lines[-1])
    except json.JSONDecodeError:
        feats.add("cut-last-line")
        if pay in lines[-1]:
            feats.add("leak-in-cut-last-line")
    for x in lines:
        if _dup_keys(x):
            feats.add("duplicate-json-key")
            if pay in x:
                feats.add("leak-in-duplicate-key-line")
    plans = {r["rid"]: r for r in recs if r.get("ev") == "plan"}
    in_log = any(f in (p.get("canaries") or ()) for p in plans.values())
    other = [p for p in logs["all"] if p != main]
    in_other = [p for p in other if any(f in (r.get("canaries") or ()) for r in _records(p) if r.get("ev") == "plan")]
    judged = {str(p) for p in logs["judged"]}
    feats.add("owner:log" if in_log else "owner:other-log" if any(str(p) in judged for p in in_other)
              else "owner:unjudged-log" if in_other else "owner:nobody")
    if in_log or in_other:
        ends = {r["rid"]: r for r in recs if r.get("ev") == "end"}
        sends = {r["rid"]: r for r in recs if r.get("ev") == "send"}
        owner_rid = next((rid for rid, p in plans.items() if f in (p.get("canaries") or ())), None)
        for v in victims:
            if owner_rid in sends and v in ends and sends[owner_rid]["wall"] > ends[v]["wall"]:
                feats.add("owner-sent-after-victim-ended")
    if any(r.get("agent_ev") == "fault_fired" and r.get("kind") == "short" and r.get("rid") in victims for r in recs):
        feats.add("short-fault-on-victim")
    if any(r.get("ev") == "fault" and r.get("kind") == "sigkill" for r in recs):
        feats.add("decode-sigkill")
    if any(r.get("ev") == "prefill_leg" and pay in (r.get("error") or "") for r in recs):
        feats.add("leak-in-prefill-leg-error")
    for v in victims:
        bodies = [r for r in recs if r.get("ev") == "body" and r.get("rid") == v]
        if len(bodies) > 1:
            feats.add("duplicate-body-record")
        end = next((r for r in recs if r.get("ev") == "end" and r.get("rid") == v), None)
        if end:
            feats.add(f"outcome:{end['outcome']}")
            if end.get("status"):
                feats.add(f"status:{end['status'] // 100}xx")
        p = plans.get(v) or {}
        feats.add(f"endpoint:{p.get('endpoint')}")
        feats.add(f"kind:{p.get('kind')}")
        for b in bodies[:1]:
            raw = b.get("raw")
            if "raw" not in b:
                feats.add("raw-absent")
            elif raw is None:
                feats.add("raw-null")
            if pay in (b.get("text") or ""):
                feats.add("leak-in-text")
            if pay in (b.get("error") or ""):
                feats.add("leak-in-error")
            if pay in json.dumps(b.get("meta")):
                feats.add("leak-in-meta")
            ids = b.get("output_ids") or []
            inv = {i: ch for ch, i in S.VOCAB.items()}
            if pay in "".join(inv.get(i, "") for i in ids if isinstance(i, int)) and pay not in (b.get("text") or ""):
                feats.add("leak-only-in-output-ids")
            if not raw:
                continue
            if pay in raw:
                feats.add("leak-contiguous-in-raw")
            elif pay in _deltas(raw):
                feats.add("leak-split-across-sse-events")
            elif pay[:9] in raw or pay[:9] in _deltas(raw):
                feats.add("leak-nine-chars")
            else:
                # the rest of a split payload in a line cut short: the raw bytes hold every character
                txt = _deltas(raw)
                if any(txt.endswith(pay[:k]) and pay[k:] in raw for k in range(1, 10)):
                    feats.add("leak-split-into-partial-line")
            first = min((raw.find(x) for x in (pay, pay[:3]) if raw.find(x) >= 0), default=-1)
            if "data: [DONE]" in raw and 0 <= raw.find("data: [DONE]") < first:
                feats.add("leak-after-done")
            if b.get("complete") is False and not raw.endswith("\n"):
                feats.add("cut-mid-line")
            if b.get("chunks") is not None:
                for line in raw[:max(first, 0)].split("\n")[:-1]:  # whole lines before the leak
                    line = line.strip()
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        try:
                            ok = isinstance(json.loads(line[5:].strip()), dict)
                        except ValueError:
                            ok = False
                        if not ok:
                            feats.add("leak-after-malformed-line")
    return feats


# what each class must show, read back from its files, over its examples
REQUIRED = {
    "complete-generate": {"endpoint:generate", "leak-in-text", "leak-contiguous-in-raw", "owner:log", "owner:other-log",
                          "owner:nobody", "outcome:ok"},
    "complete-openai": {"endpoint:completions", "endpoint:chat", "leak-in-text", "leak-contiguous-in-raw"},
    "stream-generate": {"kind:stream", "leak-contiguous-in-raw", "leak-in-text"},
    "stream-openai-split": {"kind:stream", "leak-split-across-sse-events", "leak-in-text", "endpoint:completions",
                            "endpoint:chat"},
    "stream-cut-mid-line": {"outcome:cut", "cut-mid-line", "leak-split-into-partial-line", "leak-contiguous-in-raw"},
    "stream-after-done": {"leak-after-done", "leak-split-across-sse-events", "leak-contiguous-in-raw", "outcome:ok"},
    "stream-after-malformed-line": {"leak-after-malformed-line", "leak-split-across-sse-events", "outcome:error",
                                    "leak-contiguous-in-raw"},
    "aborted": {"outcome:aborted", "leak-split-into-partial-line", "leak-in-text"},
    "disconnected": {"outcome:disconnected", "leak-split-across-sse-events", "leak-contiguous-in-raw"},
    "timeout": {"outcome:timeout", "decode-sigkill", "leak-split-into-partial-line"},
    "http-error": {"status:4xx", "status:5xx", "outcome:http_error", "leak-in-error", "leak-contiguous-in-raw"},
    "raw-missing": {"raw-absent", "raw-null", "leak-in-text", "leak-in-meta", "leak-only-in-output-ids",
                    "leak-in-error"},
    "prefill-leg-error": {"leak-in-prefill-leg-error"},
    "cross-log": {"owner:other-log"},
    "unknown-origin": {"owner:nobody", "leak-in-text"},
    "duplicate-body-record": {"duplicate-body-record", "leak-contiguous-in-raw"},
    "duplicate-json-key": {"duplicate-json-key", "leak-in-duplicate-key-line"},
    "cut-last-line": {"cut-last-line", "leak-in-cut-last-line"},
    "short-blind-known": {"short-fault-on-victim", "owner:log"},
    "short-owner-after-victim": {"short-fault-on-victim", "owner-sent-after-victim-ended"},
    "checkers-liveness": {"leak-in-text"},
    "cut-short-recital": {"leak-nine-chars", "owner:log", "owner:unjudged-log"},
}


def check_shape(sc: S.Scenario, tmp_path: Path, feats: Counter) -> None:
    """Read back what was written: its shape features (into ``feats``); the leak-free twin shows the
    victims nothing foreign and, where the class allows, is green."""
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        logs = sc.write(Path(d) / "leak")
        feats.update(observed(sc, logs))
        twin = sc.write(Path(d) / "twin", leak=False)
        pay = canary.payload(logs["meta"]["foreign"])
        victims = set(twin["meta"]["victims"])
        for x in _lines(twin["main"]):  # what the victims' client saw holds no foreign payload
            if any(f'"rid": "{v}"' in x for v in victims) and '"ev": "plan"' not in x:
                assert pay not in x, f"the twin of {sc} still shows {pay}: {x[:300]}"
        if sc.twin_green:  # the leak is the only thing that can make the leak log red
            flags = ("--accept-known",) if sc.accept_known else ()
            rc, out = judge(twin["judged"], *flags)
            assert rc == 0, f"the leak-free twin is not green (kvchaos judge {flags} exit {rc})\n{_tail(out)}"
            green, detail = suite(twin, sc)
            assert green, f"the leak-free twin is not green under the suites' policy\n{_tail(detail)}"


@pytest.mark.parametrize("cls", list(S.LEAK_CLASSES))
def test_generators_produce_every_shape(cls, tmp_path):
    feats = Counter()

    def prop(passed: set):
        @settings(max_examples=SHAPE_EXAMPLES, **PROPERTY)
        @given(sc=S.leak_scenarios(cls))
        def shape(sc):
            check_shape(sc, tmp_path, feats)
            passed.add(sc.variant)

        shape()

    every_variant(cls, prop, lambda sc: check_shape(sc, tmp_path, feats))
    missing = REQUIRED[cls] - set(feats)
    assert not missing, f"{cls}: generated logs never showed {sorted(missing)} (saw {sorted(feats)})"


# ------------------------------------------------------------------------------ 5. the driver's records
def _driver_cases() -> list:
    """(plan, wire) of every clean and noise shape and of every leak variant's victim (router mode)."""
    m = S.Mint("xdrv", 1)
    cases = []
    for ep in S.PATHS:
        for d in S.DELIVERIES:
            r = S.clean_request(m, ep, d, 2)
            cases.append((r.plan, r.wire))
        for what in S.NOISE:
            if what != "leg_error":
                r = S.noise_request(m, what, ep, False)
                cases.append((r.plan, r.wire))
    for cls in sorted(S.VARIANTS):
        for v in sorted(S.VARIANTS[cls]):
            for spec in canonical(cls, v).build(True):
                if spec.pd or type(spec) is not S.LogSpec:
                    continue
                for r in spec.reqs:
                    if r.special is None and r.plan.rid in (spec.meta.get("victims") or ()):
                        cases.append((dataclasses.replace(r.plan, rid=f"{cls}.{v}.{r.plan.rid}"), r.wire))
    # an abort must come after the bytes were sent (the generator's 5-200 ms can race a local server)
    return [(dataclasses.replace(p, abort_after_ms=150.0) if p.kind == "abort_after" else p, w) for p, w in cases]


async def _drive(cases, timeout_s: float) -> list[dict]:
    """The real driver against a server that sends each plan's wire: its body bytes, then EOF, a
    connection cut short of its Content-Length, or silence (abort, disconnect, timeout)."""
    from kvchaos.workload.driver import Driver
    from kvchaos.workload.events import EventLog

    wires = {p.rid: w for p, w in cases}
    handlers = set()

    async def serve(reader, writer):
        handlers.add(asyncio.current_task())
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            n = next(int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))
            req = json.loads(await reader.readexactly(n))
            if head.split(b" ")[1] == b"/abort_request":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
                await writer.drain()
                return
            w = wires[req["rid"]]
            if w.status is not None:
                sse = req.get("stream") and w.status == 200
                framing = b"Content-Length: %d\r\n" % (len(w.body) + 100) if w.end == "cut" else b""
                writer.write(b"HTTP/1.1 %d X\r\nContent-Type: %s\r\n%sConnection: close\r\n\r\n"
                             % (w.status, b"text/event-stream" if sse else b"application/json", framing) + w.body)
                await writer.drain()
            if w.status is None or w.end in ("abort", "timeout", "disconnect"):
                await asyncio.sleep(30)
        except (asyncio.CancelledError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            handlers.discard(asyncio.current_task())

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    log = EventLog()
    try:
        d = Driver(url, log, concurrency=1, timeout_s=timeout_s, abort_urls=(url, url))
        for p, _w in cases:
            await d.run([p])
    finally:
        srv.close()
        for t in list(handlers):
            t.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
    return log.records


def _comparable(records) -> dict:
    """Per rid, its records without what differs by run: times, URLs, the bounds, a cut's framing."""
    out = {}
    for r in records:
        if r["ev"] == "plan":
            continue
        r = {k: v for k, v in r.items() if k not in ("t", "wall", "latency_s", "url", "after_ms", "bound_s")}
        if "Response payload is not completed" in str(r.get("error")):
            r["error"] = "ClientPayloadError(payload not completed)"  # chunked vs Content-Length wording
        out.setdefault(r["rid"], []).append(r)
    return out


def test_generated_records_are_the_drivers():
    cases = _driver_cases()
    real = _comparable(asyncio.run(_drive(cases, timeout_s=0.5)))
    mem = S.EventLog()
    for p, w in cases:
        S.exchange(mem, p, w)
    model = _comparable(mem.records)
    differ = [rid for rid in model if model[rid] != real.get(rid)]
    detail = "\n".join(f"{rid}:\n  driver:    {json.dumps(real.get(rid))[:700]}\n"
                       f"  generator: {json.dumps(model[rid])[:700]}" for rid in differ[:3])
    assert not differ, f"{len(differ)} of {len(cases)} replies logged differently by the driver\n{detail}"
