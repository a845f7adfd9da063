"""Run by tests/test_plugin_known.py in a child pytest: experiments through the real runner, policy
and plugin against tests/fake_engine.py (a stand-in cluster reporting sglang 0.5.23)."""

import os

import httpx
import pytest

from faults.request import plant_leak
from kvchaos.experiment import PASS
from kvchaos.oracles import Isolation, Sensitivity
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
        return httpx.post(self.endpoints.router + "/generate", json={"text": text}, timeout=timeout)


@pytest.fixture
def fake():
    with FakeEngine() as eng:
        yield StandIn(eng.url)


def _run(experiment, fake, name, shorted: bool):
    wl = Workload(int(os.environ.get("INNER_SEED", "5")), n_tenants=4, prefix=name[:3])
    plans = [wl.request(wl.tenants[i % 4], n_canaries=2) for i in range(30)]
    victim, donor = plans[7], plans[2]
    plant_leak(victim, donor)

    def drive(ex):
        ex.send(ex.plans)
        if shorted:  # what the in-engine agent records when its short-transfer fault acts on a request
            ex.log.emit("agent", agent_ev="fault_fired", kind="short", rid=victim.rid, source="agent")

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
