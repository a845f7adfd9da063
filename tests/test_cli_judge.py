"""``kvchaos judge LOG [LOG ...]`` as a user runs it (a subprocess): planted event logs on disk,
judged by the default checkers under the policy; exit 0 PASS, 1 FAIL, 3 UNKNOWN, 2 bad input.

Every log here is written by the helpers below in the driver's format (plan, send, status, body,
end, probes; an ``experiment`` header naming the engine). A clean request echoes its own canaries
the way the probe model does: ``payload + "]["`` for each."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvchaos import canary
from kvchaos.probe.contract import recital
from tests.util import child_env

REPO = Path(__file__).resolve().parents[1]
UNMINTED = "[QZ7XK2MBNW]"


def kvchaos(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "kvchaos", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=child_env())


# --------------------------------------------------------------------------- planted logs
class Log:
    """An event log being planted: ``request(...)`` appends one request's records."""

    def __init__(self, seed: int, prefix: str = "r", version: str | None = "0.5.23"):
        self.rng = random.Random(seed)
        self.prefix, self.n, self.t = prefix, 0, 1000.0
        self.records: list[dict] = []
        if version is not None:
            self.rec("experiment", id=f"exp-{seed}", name="planted", seed=seed,
                     engine={"name": "sglang", "version": version, "roles": {}})
        self.rec("probe", phase="before", role="prefill", kv_used=0, ok=True)
        self.rec("probe", phase="before", role="decode", kv_used=0, ok=True)

    def rec(self, ev: str, **fields) -> dict:
        self.t += 0.001
        r = {"t": self.t, "wall": 1.8e9 + self.t, "ev": ev, **fields}
        self.records.append(r)
        return r

    def mint(self, n: int) -> list[str]:
        cs = canary.mint(self.rng, n)
        assert UNMINTED not in cs
        return cs

    def request(self, n_canaries: int | None = None, *, canaries=None, text=None, extra_text: str = "",
                status: int | None = 200, error: str | None = None, outcome: str = "ok", complete: bool = True,
                raw: str | None = None, stream: bool = False, expect_echo: bool = True) -> tuple[str, list[str]]:
        """One request: its plan, send, status, body and end. ``text`` defaults to the echo of its own
        canaries (what the probe model answers), followed by ``extra_text``."""
        self.n += 1
        tenant = f"t{self.n % 7:03d}"
        rid = f"{self.prefix}{self.n:04d}-{tenant}"
        cs = canaries if canaries is not None else self.mint(n_canaries or 2 + self.n % 2)
        if text is None:
            text = echo(cs) if status == 200 else ""
        text += extra_text
        self.rec("plan", rid=rid, tenant=tenant, kind="stream" if stream else "plain", endpoint="generate",
                 canaries=cs, n_tokens=400, max_new_tokens=12 * len(cs) + 2, abort_after_ms=None,
                 expect_echo=expect_echo, oversized=False, extra={})
        sent = self.rec("send", rid=rid, url="http://127.0.0.1:30000/generate", stream=stream)
        if status is not None:
            self.rec("first_byte", rid=rid)
            self.rec("status", rid=rid, status=status)
        self.rec("body", rid=rid, text=text, error=error, raw=raw, complete=complete,
                 meta={"finish_reason": {"type": "length"}} if status == 200 else {})
        self.rec("end", rid=rid, outcome=outcome, latency_s=0.4)["wall"] = sent["wall"] + 0.4  # requests overlap
        return rid, cs

    def clean(self, n: int) -> "Log":
        for _ in range(n):
            self.request()
        return self

    def write(self, path: Path) -> Path:
        self.rec("probe", phase="after", role="prefill", kv_used=0, ok=True)
        self.rec("probe", phase="after", role="decode", kv_used=0, ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        return path


def echo(cs: list[str]) -> str:
    return recital(cs)  # what the probe answers: kvchaos.probe.contract


def sse_line(text: str) -> str:
    """A ``/generate`` stream's data line, as the client read it."""
    return "data: " + json.dumps({"text": text, "meta_info": {"finish_reason": None}})


def no_traceback(p):
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr


# --------------------------------------------------------------------------- 1: cut stream with a leak
def test_cut_stream_with_another_requests_canary_is_a_leak(tmp_path):
    log = Log(seed=1).clean(30)
    owner_rid, owner_cs = log.request(3)
    own = log.mint(2)
    partial = echo(own[:1]) + canary.payload(owner_cs[1]) + "]["  # cut after the foreign canary
    victim_rid, _ = log.request(canaries=own, text=partial, outcome="cut", complete=False, stream=True,
                                raw=sse_line(partial)[:-3])  # the last SSE line, cut mid-way
    p = kvchaos("judge", str(log.write(tmp_path / "cut.jsonl")))
    no_traceback(p)
    assert p.returncode == 1, p.stdout + p.stderr
    out = p.stdout
    assert "isolation: FAIL — LEAK" in out
    assert f"victim {victim_rid}" in out and f"of owner {owner_rid}" in out, out
    assert canary.payload(owner_cs[1]) in out and "origin this log" in out and "reply incomplete" in out
    assert "sensitivity: PASS" in out                   # 31 clean requests: the evidence floor holds
    assert "status: FAIL" in out and str(tmp_path / "cut.jsonl") in out


# --------------------------------------------------------------------------- 2: unknown origin
def test_canary_minted_by_nobody_is_a_leak_of_unknown_origin(tmp_path):
    log = Log(seed=2).clean(30)
    victim_rid, _ = log.request(2, extra_text=UNMINTED[1:])       # the trigger supplies the "["
    p = kvchaos("judge", str(log.write(tmp_path / "unknown.jsonl")))
    no_traceback(p)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "unknown origin" in p.stdout and f"victim {victim_rid}" in p.stdout
    assert "QZ7XK2MBNW" in p.stdout and "status: FAIL" in p.stdout


# --------------------------------------------------------------------------- 3: too little evidence
def test_mostly_http_500_is_too_little_evidence(tmp_path):
    log = Log(seed=3)
    for _ in range(99):
        log.request(2, status=500, error="Internal Server Error", outcome="http_error")
    log.request(2)
    p = kvchaos("judge", str(log.write(tmp_path / "errors.jsonl")))
    no_traceback(p)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "isolation: UNKNOWN" in p.stdout and "sensitivity: UNKNOWN" in p.stdout
    assert "status: UNKNOWN" in p.stdout and "FAIL" not in p.stdout


# --------------------------------------------------------------------------- 4: clean
def test_clean_log_passes(tmp_path):
    log = Log(seed=4).clean(30)
    plans = [r for r in log.records if r["ev"] == "plan"]
    assert len(plans) == 30 and all(len(r["canaries"]) in (2, 3) for r in plans)
    path = log.write(tmp_path / "clean.jsonl")
    p = kvchaos("judge", str(path))
    no_traceback(p)
    assert p.returncode == 0, p.stdout + p.stderr
    for line in ("isolation: PASS", "sensitivity: PASS", "liveness: PASS", "status: PASS"):
        assert line in p.stdout, p.stdout
    assert "kv_lifecycle: UNKNOWN" in p.stdout and "informational" in p.stdout  # printed, does not decide
    p = kvchaos("judge", "--json", str(path))
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    (one,) = doc["logs"]
    assert doc["exit_code"] == 0 and one["file"] == str(path) and one["status"] == "pass" and one["version"] == "0.5.23"
    assert {v["oracle"]: v["status"] for v in one["verdicts"]} == {
        "isolation": "pass", "integrity": "pass", "sensitivity": "pass", "http_semantics": "unknown",
        "liveness": "pass",
        "kv_lifecycle": "unknown", "page_ownership": "unknown", "retraction": "unknown"}  # retraction always runs


def test_too_few_canaries_per_request_is_not_a_pass(tmp_path):
    """30 requests of one canary each: 30 trials cannot bound the echo rate above 0.95."""
    log = Log(seed=5)
    for _ in range(30):
        log.request(1)
    p = kvchaos("judge", str(log.write(tmp_path / "thin.jsonl")))
    assert p.returncode == 3 and "isolation: UNKNOWN" in p.stdout, p.stdout


# --------------------------------------------------------------------------- 5: bad input
def test_bad_input_exits_2_naming_file_and_problem(tmp_path):
    good = Log(seed=6).clean(30).write(tmp_path / "good.jsonl")
    lines = good.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:10] + ['{"ev": "plan", "rid": '] + lines[10:]) + "\n")
    cases = [
        ((str(bad),), f"{bad}:11: not JSON"),
        ((str(tmp_path / "missing.jsonl"),), f"{tmp_path / 'missing.jsonl'}: no such file"),
        ((str(good), str(tmp_path / "missing.jsonl")), "missing.jsonl: no such file"),  # nothing judged
    ]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases.append(((str(empty),), f"{empty}: empty log"))
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    cases.append(((str(blank),), f"{blank}: empty log"))
    noplan = tmp_path / "noplan.jsonl"
    noplan.write_text('{"ev": "probe", "phase": "before"}\n')
    cases.append(((str(noplan),), f"{noplan}: no requests to judge"))
    noev = tmp_path / "noev.jsonl"
    noev.write_text("\n".join(lines[:3] + ['{"rid": "x"}'] + lines[3:]) + "\n")
    cases.append(((str(noev),), f'{noev}:4: record without "ev"'))
    norid = tmp_path / "norid.jsonl"
    norid.write_text("\n".join(lines[:3] + ['{"ev": "plan", "canaries": []}'] + lines[3:]) + "\n")
    cases.append(((str(norid),), f"{norid}:4: plan without a rid"))
    badcanary = tmp_path / "badcanary.jsonl"
    bad_plan = '{"ev": "plan", "rid": "z1", "canaries": ["[abc]"]}'
    badcanary.write_text("\n".join(lines[:3] + [bad_plan] + lines[3:]) + "\n")
    cases.append(((str(badcanary),), f"{badcanary}:4: plan z1: canaries must be a list of canaries"))
    twice = tmp_path / "twice.jsonl"
    plan = next(x for x in lines if '"ev": "plan"' in x)
    twice.write_text("\n".join(lines + [plan]) + "\n")
    cases.append(((str(twice),), "a second 'plan' record for request"))
    body = next(x for x in lines if '"ev": "body"' in x)
    twobodies = tmp_path / "twobodies.jsonl"  # a second reply record would replace what the client got first
    twobodies.write_text("\n".join(lines + [body]) + "\n")
    cases.append(((str(twobodies),), "a second 'body' record for request"))
    dupkey = tmp_path / "dupkey.jsonl"  # JSON readers keep the last value: the first would vanish
    dupkey.write_text("\n".join(lines[:3] + [body[:-1] + ', "text": ""}'] + lines[3:]) + "\n")
    cases.append(((str(dupkey),), "key 'text' given twice in one record"))
    notobj = tmp_path / "notobj.jsonl"
    notobj.write_text("\n".join(lines[:3] + ["[1, 2]"] + lines[3:]) + "\n")
    cases.append(((str(notobj),), f"{notobj}:4: not a JSON object"))
    cases.append(((str(tmp_path),), "is a directory"))
    cases.append(((str(good), str(good)), "given twice"))
    cases.append(((str(good), "--checkers", "isolation,nope"), "unknown checker(s) nope; allowed: isolation, "
                                                              "integrity, sensitivity, http_semantics, liveness, "
                                                              "kv_lifecycle, page_ownership"))
    cases.append(((str(good), "--bound-s", "0"), "--bound-s must be > 0"))
    for args, msg in cases:
        p = kvchaos("judge", *args)
        no_traceback(p)
        assert p.returncode == 2, (args, p.returncode, p.stdout, p.stderr)
        assert msg in p.stderr, (args, p.stderr)
        assert "status:" not in p.stdout, args                     # bad input: nothing judged


def test_a_cut_last_line_is_judged_but_nothing_can_pass(tmp_path):
    """A crash mid-write loses the record being written — which could have been the leaking reply:
    the rest is judged (a leak in it is still a FAIL), but nothing passes on an incomplete history."""
    path = Log(seed=7).clean(30).write(tmp_path / "crashed.jsonl")
    with open(path, "a") as f:
        f.write('{"t": 1.0, "ev": "body", "rid": "r00')              # a crash mid-write
    p = kvchaos("judge", str(path))
    no_traceback(p)
    assert p.returncode == 3, p.stdout + p.stderr
    n = len(path.read_text().splitlines())
    assert f"history incomplete: {path}:{n}: the last line is cut" in p.stderr
    assert "status: UNKNOWN" in p.stdout and "the history is incomplete" in p.stdout
    log = Log(seed=7).clean(30)
    _o, cs = log.request(2)
    log.request(2, extra_text=canary.payload(cs[0]) + "][")
    leaky = log.write(tmp_path / "leaky.jsonl")
    with open(leaky, "a") as f:
        f.write('{"t": 1.0, "ev": "body", "rid": "r00')
    assert kvchaos("judge", str(leaky)).returncode == 1


# --------------------------------------------------------------------------- 6: across logs
def test_canary_minted_in_another_given_log_is_a_leak_naming_that_log(tmp_path):
    b = Log(seed=9, prefix="b")
    b.clean(15)
    b_rid, b_cs = b.request(2)
    b.clean(15)
    a = Log(seed=8, prefix="a").clean(30)
    victim_rid, _ = a.request(2, extra_text=canary.payload(b_cs[0]) + "][")
    pa, pb = a.write(tmp_path / "A.jsonl"), b.write(tmp_path / "B.jsonl")
    p = kvchaos("judge", str(pa), str(pb))
    no_traceback(p)
    assert p.returncode == 1, p.stdout + p.stderr
    block_a, block_b = p.stdout.split(f"== {pb}")
    assert f"victim {victim_rid}" in block_a and f"of owner {b_rid}" in block_a
    assert f"origin session ({pb})" in block_a and "status: FAIL" in block_a
    assert "status: PASS" in block_b                                  # B itself is clean
    alone = kvchaos("judge", str(pa))                                # without B, nobody minted it
    assert alone.returncode == 1 and "unknown origin" in alone.stdout and str(pb) not in alone.stdout
    doc = json.loads(kvchaos("judge", "--json", str(pa), str(pb)).stdout)
    assert [(x["file"], x["status"]) for x in doc["logs"]] == [(str(pa), "fail"), (str(pb), "pass")]
    (w,) = [w for v in doc["logs"][0]["verdicts"] if v["oracle"] == "isolation" for w in v["witnesses"]]
    assert (w["victim_rid"], w["owner_rid"], w["origin"]) == (victim_rid, b_rid, f"session ({pb})")


def test_another_log_with_the_same_rids_is_still_scanned(tmp_path):
    """Two runs of a workload name their requests alike; B's canaries still count in A."""
    b = Log(seed=11, prefix="r").clean(30)
    b_rid, b_cs = b.request(2)
    a = Log(seed=10, prefix="r").clean(30)
    victim_rid, _ = a.request(2, extra_text=canary.payload(b_cs[1]) + "][")
    pa, pb = a.write(tmp_path / "A.jsonl"), b.write(tmp_path / "B.jsonl")
    p = kvchaos("judge", str(pa), str(pb))
    assert p.returncode == 1, p.stdout + p.stderr
    # the victim's own rid names another request in B: B's canary is still foreign, owned by B's request
    assert f"of owner {b_rid} " in p.stdout and f"origin session ({pb})" in p.stdout


# --------------------------------------------------------------------------- policy options
def test_known_finding_needs_the_engine_version_and_acceptance(tmp_path):
    from kvchaos.policy import Registry

    fid = "sglang-short-transfer-unchecked"
    try:
        Registry.load().get(fid)
    except Exception:  # noqa: BLE001
        pytest.skip(f"{fid} is no longer listed in kvchaos/findings.toml")

    def planted(version):
        log = Log(seed=12, version=version).clean(30)
        owner, owner_cs = log.request(2)
        log.clean(5)
        victim, _ = log.request(2, extra_text=canary.payload(owner_cs[0]) + "][")
        log.clean(30)
        # the mechanism, as the engines report it: the owner's transfer wrote decode pages 100..109,
        # decode gave them to the victim next, and a short fault let the victim's transfer write one
        pg = list(range(100, 110))
        log.rec("agent", agent_ev="write_end", rid=owner, room=1, pages=10, dst_pages=pg, dst_pages_total=10,
                dst_page_offset=0, ret=0)
        log.rec("agent", agent_ev="kv_prealloc", rid=victim, room=2, dst_pages=pg, dst_pages_total=10,
                prev_holders=[[0, 10, owner]])
        log.rec("agent", agent_ev="fault_fired", kind="short", rid=victim, role="prefill", pages_sent=1,
                pages_reserved=10)
        log.rec("agent", agent_ev="write_end", rid=victim, room=2, pages=1, dst_pages=pg[:1], dst_pages_total=1,
                dst_page_offset=0, ret=0)
        return log.write(tmp_path / f"short-{version}.jsonl")

    known = planted("0.5.23")
    p = kvchaos("judge", str(known))
    assert p.returncode == 1, p.stdout + p.stderr                     # KNOWN, not accepted: red
    assert f"KNOWN {fid}" in p.stdout and "not accepted" in p.stdout
    p = kvchaos("judge", "--accept-known", str(known))
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"status: KNOWN {fid} (accepted)" in p.stdout
    p = kvchaos("judge", "--accept-known", str(planted(None)))        # no header: no engine version
    assert p.returncode == 1 and "status: FAIL" in p.stdout and "known findings not applied" in p.stderr


def test_checkers_subset_and_bound(tmp_path):
    log = Log(seed=13).clean(30)
    slow_rid, _ = log.request(2)
    next(r for r in log.records if r["ev"] == "end" and r["rid"] == slow_rid)["latency_s"] = 90.0
    path = log.write(tmp_path / "slow.jsonl")
    p = kvchaos("judge", str(path))                                  # any checker's FAIL counts
    assert p.returncode == 1 and "liveness: FAIL" in p.stdout and slow_rid in p.stdout, p.stdout
    p = kvchaos("judge", "--bound-s", "120", str(path))
    assert p.returncode == 0 and "liveness: PASS" in p.stdout, p.stdout
    p = kvchaos("judge", "--checkers", "isolation,liveness", str(path))  # named: each must PASS
    assert p.returncode == 1 and "liveness: FAIL" in p.stdout and "sensitivity:" not in p.stdout, p.stdout
    p = kvchaos("judge", "--checkers", "isolation,liveness", "--bound-s", "120", str(path))
    assert p.returncode == 0 and "liveness: PASS" in p.stdout, p.stdout
    p = kvchaos("judge", "--checkers", "kv_lifecycle", str(path))   # named but nothing to judge: UNKNOWN
    assert p.returncode == 3 and "kv_lifecycle: UNKNOWN" in p.stdout and "status: UNKNOWN" in p.stdout, p.stdout
