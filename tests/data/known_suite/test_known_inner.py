"""Run by tests/test_plugin_known.py in a child pytest: experiments through the real runner, policy
and plugin against tests/fake_engine.py (a stand-in cluster reporting sglang 0.5.23)."""

import os

import pytest

from faults.request import plant_leak
from kvchaos import httpclient
from kvchaos.experiment import PASS
from kvchaos.oracles import Isolation, Liveness, Sensitivity
from kvchaos.workload import Workload
from tests.fake_engine import FakeEngine


class StandIn:
    """Router, prefill and decode all on the fake engine; /server_info says sglang 0.5.23."""

    def __init__(self, url):
        self.endpoints = type("E", (), {"router": url, "prefill": url, "decode": url,
                                        "as_dict": lambda self: {"router": url}})()

    def server_info(self, role="decode"):
        return {"version": "0.5.23"}

    def generate(self, text=None, max_new_tokens=1, timeout=30, **kw):
        return httpclient.post(self.endpoints.router + "/generate", json={"text": text}, timeout=timeout)


@pytest.fixture
def fake():
    with FakeEngine() as eng:
        yield StandIn(eng.url)


def _run(experiment, fake, name, shorted: bool):
    wl = Workload(int(os.environ.get("INNER_SEED", "5")), n_tenants=4, prefix=name[:3])
    plans = [wl.request(wl.tenants[i % 4], n_canaries=2) for i in range(40)]
    victim, donor = plans[7], plans[2]
    plant_leak(victim, donor)

    def drive(ex):
        ex.send(ex.plans)
        if shorted:  # what the in-engine agents record when the short-transfer fault acts on a request:
            # the donor's transfer wrote decode pages 100..109, decode gave them to the victim next, and
            # the victim's transfer wrote one of them
            pg, ag = list(range(100, 110)), {"source": "agent"}
            ex.log.emit("agent", agent_ev="write_end", rid=donor.rid, room=1, pages=10, dst_pages=pg,
                        dst_pages_total=10, dst_page_offset=0, ret=0, **ag)
            ex.log.emit("agent", agent_ev="kv_prealloc", rid=victim.rid, room=2, dst_pages=pg, dst_pages_total=10,
                        prev_holders=[[0, 10, donor.rid]], **ag)
            ex.log.emit("agent", agent_ev="fault_fired", kind="short", rid=victim.rid, pages_sent=1,
                        pages_reserved=10, **ag)
            ex.log.emit("agent", agent_ev="write_end", rid=victim.rid, room=2, pages=1, dst_pages=pg[:1],
                        dst_pages_total=1, dst_page_offset=0, ret=0, **ag)

    with experiment(name, plans, [Isolation(), Sensitivity()], cluster=fake, faults=None, drive=drive,
                    settle_s=0, timeout_s=10) as ex:
        pass
    return ex


def test_shorted_leak(experiment, fake):
    _run(experiment, fake, "shorted", True).require(isolation=PASS)


def test_unexplained_leak(experiment, fake):
    _run(experiment, fake, "unexplained", False).require(isolation=PASS)


def test_clean(experiment, fake):
    with experiment("clean", Workload(9, n_tenants=4, prefix="cl").mix(30), [Isolation(), Sensitivity()],
                    cluster=fake, faults=None, settle_s=0, timeout_s=10) as ex:
        pass
    ex.require(isolation=PASS, sensitivity=PASS)


def test_never_judged(experiment, fake):
    with experiment("unjudged", Workload(10, n_tenants=4, prefix="un").mix(30), [Isolation()],
                    cluster=fake, faults=None, settle_s=0, timeout_s=10):
        pass


class Broken(StandIn):
    """A stand-in whose prefill transfer thread died during the experiment: what Cluster.engine_errors
    returns then (the first call, at the experiment's start, finds nothing new)."""

    calls = 0

    def engine_errors(self):
        self.calls += 1
        if self.calls == 1:
            return []
        return [{"role": "prefill", "signature": "mooncake_transfer_worker_died", "cause": "4737251198678054549",
                 "line": "RuntimeError: Transfer thread failed because of 4737251198678054549. Prefill instance "
                         "with bootstrap_port=25705 is dead."}]


@pytest.fixture
def broken():
    with FakeEngine() as eng:
        yield Broken(eng.url)


def _fault_starved(experiment, cluster, name, leak: bool):
    """A fault that acted 4 times where 8 were required, in an experiment whose requests ran late."""
    from faults.base import FaultDidNotFire

    wl = Workload(11, n_tenants=4, prefix=name[:3])
    plans = [wl.request(wl.tenants[i % 4], n_canaries=2) for i in range(30)]
    if leak:
        plant_leak(plans[7], plans[2])
    with experiment(name, plans, [Isolation(), Sensitivity(), Liveness(bound_s=1e-6)], cluster=cluster,
                    faults=None, settle_s=0, timeout_s=10):
        pass
    raise FaultDidNotFire("fault delay delay-0 on prefill target={'tenant': 't001'}: 4 firing(s) reported, "
                          "expected >= 8")


def test_fault_starved_by_broken_engine(experiment, broken):
    _fault_starved(experiment, broken, "starved", leak=False)


def test_fault_starved_healthy_engine(experiment, fake):
    _fault_starved(experiment, fake, "blind", leak=False)


def test_fault_starved_broken_engine_leak(experiment, broken):
    _fault_starved(experiment, broken, "leaky", leak=True)


def test_fault_starved_broken_engine_leak_elsewhere(experiment, broken, fake):
    """The engine broke in one experiment; another experiment of the same test leaked (never judged,
    the test stopped at the fault check): red."""
    wl = Workload(12, n_tenants=4, prefix="lk")
    plans = [wl.request(wl.tenants[i % 4], n_canaries=2) for i in range(30)]
    plant_leak(plans[7], plans[2])
    with experiment("leak_elsewhere", plans, [Isolation(), Sensitivity()], cluster=fake, faults=None,
                    settle_s=0, timeout_s=10):
        pass
    _fault_starved(experiment, broken, "starved2", leak=False)


# --------------------------------------------------------------------------- blinded by an engine failure
ATTEMPTS: dict = {}


@pytest.fixture
def flaky(request):
    """Attempt n (1, 2, ...) of a test, on a stand-in cluster: the test's ``broken_attempts`` names the
    attempts that find the engine broken (every reply a 400, the transfer thread's death in the logs)."""
    n = ATTEMPTS[request.node.nodeid] = ATTEMPTS.get(request.node.nodeid, 0) + 1
    broken = n in getattr(request.function, "broken_attempts", ())
    blind = broken and not getattr(request.function, "still_answers", False)
    with FakeEngine("reject" if blind else "echo") as eng:
        yield (Broken if broken else StandIn)(eng.url)


def _powered(experiment, cluster, name, leak=False):
    wl = Workload(13, n_tenants=4, prefix=name[:3])
    plans = [wl.request(wl.tenants[i % 4], n_canaries=2) for i in range(40)]
    if leak:
        plant_leak(plans[7], plans[2])
    with experiment(name, plans, [Isolation(), Sensitivity()], cluster=cluster, faults=None, settle_s=0,
                    timeout_s=10) as ex:
        pass
    ex.require(isolation=PASS)


def test_blinded_once(experiment, flaky):
    _powered(experiment, flaky, "blinded")


def test_blinded_twice(experiment, flaky):
    _powered(experiment, flaky, "twice")


def test_blind_without_engine_failure(experiment):
    with FakeEngine("reject") as eng:
        _powered(experiment, StandIn(eng.url), "noexcuse")


def test_leak_with_engine_failure(experiment, flaky):
    _powered(experiment, flaky, "leakbroken", leak=True)


test_blinded_once.broken_attempts = (1,)
test_blinded_twice.broken_attempts = (1, 2)
test_leak_with_engine_failure.broken_attempts = (1,)
test_leak_with_engine_failure.still_answers = True  # the engine broke, and a reply showed a leak
