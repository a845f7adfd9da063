"""Known silent engine failures: found in the server logs (the prefill log excerpt is the real one from
a CI run on sglang 0.5.23, tests/data/prefill-transfer-worker-died.log), healed by restarting the role,
and KNOWN (the registry's sglang-mooncake-transfer-worker-dies) only when liveness caught it: never
hiding an isolation, kv_lifecycle or differential FAIL or an isolation UNKNOWN."""

import tomllib
from pathlib import Path

import pytest

from kvchaos import oracles
from kvchaos.cluster import ClusterSpec
from kvchaos.cluster.engine_errors import ENGINE_ERRORS, FINDINGS_FILE, load_engine_errors, scan_engine_errors
from kvchaos.cluster.launcher import Cluster
from kvchaos.oracles import Verdict

REAL = (Path(__file__).parent / "data" / "prefill-transfer-worker-died.log").read_text()


def test_the_real_transfer_worker_death_is_found_once(tmp_path):
    log = tmp_path / "prefill.log"
    head, tail = REAL.split("RuntimeError: Transfer thread", 1)
    log.write_text(head + "RuntimeError: Transfer thread")           # the line is still being written
    offsets = {}
    assert scan_engine_errors({"prefill": log}, offsets) == []
    with open(log, "a") as f:
        f.write(tail)
    (hit,) = scan_engine_errors({"prefill": log}, offsets)
    assert hit["role"] == "prefill" and hit["signature"] == "mooncake_transfer_worker_died"
    assert hit["cause"] == "3590758574076394589" and hit["port"] == "31556"
    assert "KeyError: 3590758574076394589" in hit["traceback"] and "check_status" in hit["traceback"]
    assert scan_engine_errors({"prefill": log}, offsets) == []      # not reported twice
    log.write_text("fresh log after a restart\n")                    # replaced: read from the start
    assert scan_engine_errors({"prefill": log}, offsets) == []
    clean = tmp_path / "decode.log"
    clean.write_text("Decode transfer failed for request ... Aborted by AbortReq.\n" * 3)
    assert scan_engine_errors({"decode": clean}, {}) == []          # ordinary request failures are not it


def test_heal_restarts_the_role_once_and_records_it(tmp_path, monkeypatch):
    c = Cluster(ClusterSpec.load("cpu"), tmp_path)

    class P:
        def __init__(self, path):
            self.log_path = path

    log = tmp_path / "prefill.log"
    log.write_text(REAL)
    c.procs = {"prefill": P(log), "decode": P(tmp_path / "decode.log"), "router": P(tmp_path / "router.log")}
    restarts = []
    monkeypatch.setattr(c, "restart", lambda role: restarts.append(role) or {"role": role, "rejoined_s": 1.0})
    (f,) = c.heal_engine_errors()
    assert restarts == ["prefill"] and f["healed"] == {"role": "prefill", "rejoined_s": 1.0}
    assert c.heal_engine_errors() == [] and restarts == ["prefill"]   # healed once


def test_a_prefill_restart_waits_for_decode_to_drop_the_old_instance(tmp_path):
    """Decode keeps a prefill that came back on the same bootstrap address within its heartbeat window
    and never handshakes with the new one; a restart starts prefill only once decode's log says it
    dropped the old (bounded)."""
    import threading

    c = Cluster(ClusterSpec.load("cpu"), tmp_path)
    log = tmp_path / "decode.log"
    log.write_text("[2026-12-02 01:15:25] Lost connection with prefill instance (earlier, before the mark)\n")
    c.procs = {"decode": type("P", (), {"log_path": log})()}
    mark = c._log_size("decode")
    assert c._wait_decode_dropped_prefill(mark, timeout_s=0.6) is None  # an old line does not count

    def heartbeat():
        with open(log, "a") as f:
            f.write("[2026-12-02 01:16:40] Attempting to reconnect to 127.0.0.1:29982...\n"
                    "[2026-12-02 01:16:40] Lost connection with prefill instance (bootstrap_addr: 127.0.0.1:29982), "
                    "0 requests affected\n")

    threading.Timer(0.7, heartbeat).start()
    waited = c._wait_decode_dropped_prefill(mark, timeout_s=10)
    assert waited is not None and 0.5 <= waited < 5
    # prefill was killed before the restart and decode already let go: no wait at all
    assert c._wait_decode_dropped_prefill(mark, timeout_s=10) < 3.0  # not its 10 s, on a loaded machine too


def V(oracle, status, witnesses=()):
    return Verdict(oracle, status, f"{oracle} {status}", list(witnesses))


FOUND = [{"role": "prefill", "signature": "mooncake_transfer_worker_died", "line": "RuntimeError: ...", "cause": "1"}]
HUNG = [{"rid": "r1", "problem": "no answer within 60 s", "outcome": "timeout"}]


def _judge(verdicts, found):
    from kvchaos.policy import Context, Policy

    ctx = Context([{"ev": "experiment", "engine": {"name": "sglang", "version": "0.5.23"}}], "sglang", "0.5.23", found)
    return Policy(accept_known=True).judge(verdicts, ctx, {"liveness": oracles.PASS})


def test_known_only_when_liveness_caught_it_and_nothing_else_is_wrong():
    j = _judge([V("isolation", oracles.PASS), V("liveness", oracles.FAIL, HUNG)], FOUND)
    assert j.status == "known" and j.known[0].finding.id == "sglang-mooncake-transfer-worker-dies"
    # a leak, leak evidence or a blind isolation is never excused by it (CI: a liveness finding used to
    # turn those into an xfail), nor is a liveness FAIL without the engine's witness
    for other in (V("isolation", oracles.FAIL), V("isolation", oracles.UNKNOWN), V("kv_lifecycle", oracles.FAIL),
                  V("differential", oracles.FAIL)):
        rest = [V("isolation", oracles.PASS)] if other.oracle != "isolation" else []
        j = _judge(rest + [other, V("liveness", oracles.FAIL, HUNG)], FOUND)
        assert j.status in ("fail", "unknown") and j.red, (other, j.status)
        assert any(i.verdict.oracle == other.oracle and i.outcome == "red" for i in j.items)
    assert _judge([V("isolation", oracles.PASS), V("liveness", oracles.FAIL, HUNG)], []).status == "fail"
    assert _judge([V("isolation", oracles.PASS), V("liveness", oracles.PASS)], FOUND).status == "pass"


def test_every_finding_names_an_engine_error_the_registry_declares():
    """Engine-error signatures sit beside the findings (kvchaos/findings.toml [[engine_error]]): a
    finding whose signature names an undeclared one could never match."""
    doc = tomllib.loads(FINDINGS_FILE.read_text())
    named = {m["signature"]["engine_error"] for f in doc["finding"] for m in f["match"]
             if "engine_error" in m.get("signature", {})}
    assert named and named <= set(ENGINE_ERRORS), named - set(ENGINE_ERRORS)


def test_a_malformed_engine_error_table_is_named(tmp_path):
    bad = tmp_path / "f.toml"
    bad.write_text('[[engine_error]]\nname = "x"\n')
    with pytest.raises(ValueError, match="engine_error #0 needs a name and a pattern"):
        load_engine_errors(bad)
    bad.write_text('[[engine_error]]\nname = "x"\npattern = "a"\n[[engine_error]]\nname = "x"\npattern = "b"\n')
    with pytest.raises(ValueError, match="'x' listed twice"):
        load_engine_errors(bad)
