"""The generators make every shape (property 4 of ``tests/test_properties.py``): what they write
really has each shape — read back from the files, not from the generator's own labels — and every leak
log's leak-free twin shows the victims nothing foreign and, where the class allows, is green; so a leak
property cannot pass because a shape never occurs or the log was red anyway."""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings

from kvchaos import canary

from tests import strategies as S
from tests.property_harness import (PROPERTY, SHAPE_EXAMPLES, _tail, every_variant, integrity_names_only, judge_doc,
                                     suite)


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


def _line_features(lines: list[str], pay: str) -> set:
    """Malformed lines of the log: a last line cut short, a line with a key twice (holding ``pay``?)."""
    feats = set()
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
    return feats


def _owner_features(f: str, logs: dict, recs: list[dict], plans: dict, victims: set) -> set:
    """Who owns the foreign canary ``f`` (this log, another judged or unjudged log, nobody), and
    whether the owner was sent after a victim ended."""
    main = logs["main"]
    in_log = any(f in (p.get("canaries") or ()) for p in plans.values())
    other = [p for p in logs["all"] if p != main]
    in_other = [p for p in other if any(f in (r.get("canaries") or ()) for r in _records(p) if r.get("ev") == "plan")]
    judged = {str(p) for p in logs["judged"]}
    feats = {"owner:log" if in_log else "owner:other-log" if any(str(p) in judged for p in in_other)
             else "owner:unjudged-log" if in_other else "owner:nobody"}
    if in_log or in_other:
        ends = {r["rid"]: r for r in recs if r.get("ev") == "end"}
        sends = {r["rid"]: r for r in recs if r.get("ev") == "send"}
        owner_rid = next((rid for rid, p in plans.items() if f in (p.get("canaries") or ())), None)
        for v in victims:
            if owner_rid in sends and v in ends and sends[owner_rid]["wall"] > ends[v]["wall"]:
                feats.add("owner-sent-after-victim-ended")
    return feats


def _fault_features(recs: list[dict], victims: set, pay: str) -> set:
    """The faults and legs around the leak: a short transfer on a victim, decode SIGKILLed, the
    foreign payload in a prefill leg's error."""
    feats = set()
    if any(r.get("agent_ev") == "fault_fired" and r.get("kind") == "short" and r.get("rid") in victims for r in recs):
        feats.add("short-fault-on-victim")
    if any(r.get("ev") == "fault" and r.get("kind") == "sigkill" for r in recs):
        feats.add("decode-sigkill")
    if any(r.get("ev") == "prefill_leg" and pay in (r.get("error") or "") for r in recs):
        feats.add("leak-in-prefill-leg-error")
    return feats


def _victim_features(v: str, recs: list[dict], plans: dict, pay: str) -> set:
    """One victim's request: its body records, outcome, status, endpoint, kind, and where its first
    body record holds ``pay``."""
    feats = set()
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
        feats |= _body_features(b, pay)
    return feats


def _body_features(b: dict, pay: str) -> set:
    """A body record: ``raw`` absent or null, ``pay`` in its text, error, meta or only its output ids,
    and where in the raw bytes."""
    feats = set()
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
    if raw:
        feats |= _raw_features(b, raw, pay)
    return feats


def _raw_features(b: dict, raw: str, pay: str) -> set:
    """Where the raw bytes hold ``pay``: contiguous, split across SSE events, nine characters, split
    into a partial line; after ``[DONE]``, in a line cut short, after a malformed line."""
    feats = set()
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
            if _malformed_data_line(line):
                feats.add("leak-after-malformed-line")
    return feats


def _malformed_data_line(line: str) -> bool:
    """A ``data:`` line (not ``[DONE]``) that is not a JSON object."""
    line = line.strip()
    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
        return False
    try:
        ok = isinstance(json.loads(line[5:].strip()), dict)
    except ValueError:
        ok = False
    return not ok


def observed(sc: S.Scenario, logs: dict) -> set:
    """Shape features read back from the files: where the client's bytes hold the foreign payload."""
    meta = logs["meta"]
    f = meta.get("foreign")
    if not f:
        return set()
    pay = canary.payload(f)
    victims = set(meta.get("victims") or ())
    main = logs["main"]
    lines = _lines(main)
    recs = _records(main)
    plans = {r["rid"]: r for r in recs if r.get("ev") == "plan"}
    feats = _line_features(lines, pay) | _owner_features(f, logs, recs, plans, victims) \
        | _fault_features(recs, victims, pay)
    for v in victims:
        feats |= _victim_features(v, recs, plans, pay)
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
            # ... but for integrity: the twin's stand-in bytes (lower-case filler where the foreign payload was) are
            # a reply corrupted without a foreign canary in it — integrity's class — so an integrity FAIL naming
            # the victims, and only them, is the one red the twin may have
            flags = ("--accept-known",) if sc.accept_known else ()
            rc, doc, out = judge_doc(twin["judged"], *flags)
            assert doc is not None, f"kvchaos judge --json printed no document (exit {rc})\n{_tail(out)}"
            red = [(lg["file"], v) for lg in doc["logs"] for v in lg["verdicts"] if v.get("outcome") != "ok"
                   and not (v.get("outcome") == "known" and (v.get("known") or {}).get("accepted"))]
            bad = [(f, v["oracle"], v["status"]) for f, v in red if not integrity_names_only(v, victims)]
            assert not bad, f"the leak-free twin is red by more than integrity on its victims: {bad}\n{_tail(out)}"
            green, detail = suite(twin, sc, corrupted=victims)
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
