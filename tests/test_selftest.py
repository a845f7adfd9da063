"""The planted-leak self-test (``kvchaos.selftest``) through the real runner and policy against
tests/fake_engine.py: a clean catch; an engine that leaks on a request nothing was planted in — an
engine leak during self-test, its experiment red (FAIL, the witness named, recorded so), the planted
leaks' catch reported beside it; and what the session does with each."""

from __future__ import annotations

import json
import types

import pytest

from kvchaos import canary, httpclient
from kvchaos.policy import Policy
from kvchaos.selftest import ENGINE_LEAK, run_selftest
from kvchaos.workload import Workload
from tests.fake_engine import FakeEngine


class StandIn:
    def __init__(self, url):
        self.endpoints = type("E", (), {"router": url, "prefill": url, "decode": url,
                                        "as_dict": lambda s: {"router": url}})()
        self.spec = types.SimpleNamespace(request_timeout_s=10.0)

    def server_info(self, role="decode"):
        return {"version": "0.5.23"}

    def generate(self, text=None, max_new_tokens=1, timeout=30, **kw):
        return httpclient.post(self.endpoints.router + "/generate", json={"text": text}, timeout=timeout)


def _selftest_plans():
    """The self-test's own plans (its seed and workload: kvchaos.selftest)."""
    wl = Workload(4242, n_tenants=8, prefix="selftest-")
    return [wl.request(wl.tenants[i % 8], n_tokens=160 + 5 * i) for i in range(80)]


class LeaksOnOne(FakeEngine):
    """Answers one request nothing is planted in (the self-test's 11th) with another's canary as well."""

    def __init__(self, **kw):
        super().__init__(**kw)
        ps = _selftest_plans()
        self.victim_canary, self.foreign = ps[10].canaries[0], ps[20].canaries[0]

    def leak_for(self, text):
        return canary.payload(self.foreign) + "][" if self.victim_canary in text else ""


def _run(tmp_path, engine_cls):
    with engine_cls() as eng:
        c = StandIn(eng.url)
        out, ex = run_selftest(c, tmp_path, Policy())
    recs = [json.loads(x) for x in (tmp_path / "experiments.jsonl").read_text().splitlines()]
    return out, ex, c, recs


def test_a_clean_engine_is_a_clean_catch(tmp_path):
    out, ex, c, recs = _run(tmp_path, FakeEngine)
    assert out["status"] == "caught" and out["planted_caught"] and out["engine_leaks"] == []
    assert recs[-1]["status"] == "pass" and recs[-1]["planted"]  # a planted experiment, caught as required
    assert c.selftest_experiment is ex


def test_an_engine_leak_during_the_selftest_is_red_and_says_so(tmp_path):
    out, ex, _c, recs = _run(tmp_path, LeaksOnOne)
    ps = _selftest_plans()
    assert out["status"] == "engine_leak" and out["planted_caught"] is True, out["why"]
    oracles_red = {e["oracle"] for e in out["engine_leaks"]}
    assert oracles_red == {"isolation", "integrity"}, out["engine_leaks"]
    iso = next(e for e in out["engine_leaks"] if e["oracle"] == "isolation")
    assert {w["victim_rid"] for w in iso["witnesses"]} == {ps[10].rid}
    assert iso["witnesses"][0]["owner_rid"] == ps[20].rid and iso["summary"].startswith(ENGINE_LEAK)
    # the experiment is judged as the run's own on what the engine did: red, recorded so (the last record
    # of its id wins: kvchaos.report.collect), its verdicts file too
    assert recs[-1]["id"] == ex.id and recs[-1]["status"] == "fail" and not recs[-1]["planted"]
    vs = {v["oracle"]: v for v in json.loads((tmp_path / "selftest.verdicts.json").read_text())}
    assert vs["isolation"]["status"] == "fail" and vs["isolation"]["outcome"] == "red"
    assert ENGINE_LEAK in vs["isolation"]["summary"]
    assert any(ENGINE_LEAK in w for w in out["why"]) and json.loads((tmp_path / "selftest.json").read_text())[
        "status"] == "engine_leak"
    # with the planted leaks caught the harness is not blind: the session's isolation verdicts may still pass
    assert Policy(selftest=out).selftest_blind() is None
    assert Policy(selftest={**out, "planted_caught": False}).selftest_blind()


@pytest.mark.parametrize("caught", [True, False])
def test_the_policy_trusts_a_selftest_only_where_it_caught_what_it_planted(caught):
    st = {"status": "engine_leak", "planted_caught": caught}
    assert (Policy(selftest=st).selftest_blind() is None) is caught


def test_a_run_whose_selftest_saw_an_engine_leak_exits_red_though_every_test_passed(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from tests.util import child_env

    repo = Path(__file__).resolve().parents[1]
    inner = repo / "tests" / "data" / "selftest_suite" / "test_selftest_inner.py"
    r = subprocess.run([sys.executable, "-m", "pytest", str(inner), "-p", "no:cacheprovider", "-o", "testpaths=", "-q",
                        "--kvchaos-reports", str(tmp_path / "reports")], cwd=repo, env=child_env(),
                       capture_output=True, text=True, timeout=300)
    assert "1 passed" in r.stdout, r.stdout[-2000:]
    assert r.returncode == 1, r.stdout[-2000:]
    assert "every test passed, but the run is FAIL" in r.stdout and ENGINE_LEAK in r.stdout, r.stdout[-2000:]


def test_fuzz_writes_up_a_selftests_engine_leak_as_a_find_and_goes_on(tmp_path):
    """kvchaos fuzz's clusters run the self-test; one that saw the engine leak is triaged like a run (the real
    registry: nothing known explains this one) and written up, not re-run; no traceback, the search goes on."""
    from kvchaos.fuzz.corpus import Corpus
    from kvchaos.fuzz.grammar import Base
    from kvchaos.fuzz.loop import Clusters, Fuzzer
    from kvchaos.policy import Registry

    (tmp_path / "run").mkdir()
    out, _ex, c, _recs = _run(tmp_path / "run", LeaksOnOne)
    said = []
    fz = Fuzzer(clusters=Clusters(None, None), base=Base(pool=2048, context=4096, reservation=512, input_limit=2042),
                registry=Registry.load(), out=tmp_path / "fz", corpus=Corpus(tmp_path / "c"), seed=1, budget_s=1,
                say=said.append)
    fz.t0 = fz.clock()  # as run() starts it
    fz._selftest_finds(c, None, types.SimpleNamespace(selftest=out))
    new = fz.stats.new
    assert {n["oracle"] for n in new.values()} == {"isolation", "integrity"} and all(n["leak"] for n in new.values())
    assert all(n["during"] == "planted-leak self-test" and n["confirmed"] is None for n in new.values())
    finds = sorted(p.name for p in (tmp_path / "fz" / "finds").iterdir())
    assert finds == sorted(f"new-{s}" for s in new)
    assert any("self-test: NEW" in m for m in said)
    bug = (tmp_path / "fz" / "finds" / finds[0] / "BUG.md").read_text()
    assert ENGINE_LEAK in bug and "Seen during the cluster's planted-leak self-test" in bug
    # a clean self-test is no find
    fz2 = Fuzzer(clusters=Clusters(None, None), base=Base(pool=2048, context=4096, reservation=512, input_limit=2042),
                 registry=Registry.load(), out=tmp_path / "fz2", corpus=Corpus(tmp_path / "c2"), seed=1, budget_s=1)
    fz2.t0 = fz2.clock()
    fz2._selftest_finds(c, None, types.SimpleNamespace(selftest={**out, "status": "caught"}))
    assert fz2.stats.new == {}
