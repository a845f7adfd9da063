"""Run by tests/test_replay.py in a child pytest (and again by ``kvchaos replay``): one experiment
through the real runner and policy against tests/fake_engine.py, its plans drawn from the run seed.
``INNER_LEAK=1`` makes the engine leak one request's canary into every reply (isolation FAIL, the
plans unchanged); ``INNER_N`` changes how many plans there are (a replay whose plans differ)."""

import os
import time

import pytest

from kvchaos import canary
from kvchaos.experiment import PASS
from kvchaos.oracles import Isolation, Sensitivity
from kvchaos.workload import Workload
from tests.data.known_suite.test_known_inner import StandIn
from tests.fake_engine import FakeEngine


@pytest.fixture
def fake():
    with FakeEngine() as eng:
        yield StandIn(eng.url), eng


def test_scenario(experiment, seeds, fake):
    fake, eng = fake
    wl = Workload(seeds(5), n_tenants=4, prefix="rp")
    plans = [wl.request(wl.tenants[i % 4], n_canaries=2) for i in range(int(os.environ.get("INNER_N", "30")))]
    if os.environ.get("INNER_LEAK") == "1":  # the engine serves plans[2]'s canary to everyone
        eng.leak_text = canary.payload(plans[2].canaries[0])
    with experiment("replayable", plans, [Isolation(), Sensitivity()], cluster=fake, faults=None, seed=wl.seed,
                    settle_s=0, timeout_s=10) as ex:
        pass
    ex.require(isolation=PASS)


class LeakFirst(FakeEngine):
    """Leaks, into its first ``n`` replies only (then answers cleanly), the first canary of the latest
    prompt it was sent that holds ``marker`` (a piece of one plan's text that is no canary): a stale
    page of that prompt, whichever run sent it. An engine whose leak does not come back when the
    scenario is re-run (small ``n``), and whose leak names an earlier run's canary when the owner's
    request is not in this one."""

    # a reply waits, at most this long, for the owner's request of its own run (since the last flush): an
    # overlap decided by the client's send skew flaked under load (a victim sent with the owner, its reply
    # made before the owner's request had arrived); at concurrency 1 a victim sent first waits it out
    wait_owner_s = 1.0

    def __init__(self, marker, n):
        super().__init__()
        self._marker, self._left = marker, n

    def _prompts(self, since: int = 0) -> list[str]:
        """The prompts it was sent, from request ``since`` on."""
        return [b.get("text") or b.get("prompt") or "" for _path, b in self.requests[since:]]

    def _owner_sent_since_flush(self) -> bool:
        return any(self._marker in t for t in self._prompts(self.flushed_at))

    def leak_for(self, text):
        if self._left <= 0:
            return ""
        if self._marker not in text:  # the owner's own reply does not wait for itself
            deadline = time.monotonic() + self.wait_owner_s
            while not self._owner_sent_since_flush() and time.monotonic() < deadline:
                time.sleep(0.01)
        src = next((t for t in reversed(self._prompts()) if self._marker in t and t != text), None)
        found = canary.find(src) if src else []
        if not found:
            return ""
        self._left -= 1
        return canary.payload(found[0][1])


@pytest.fixture
def engines():
    """Engines a test starts, stopped at teardown: the plugin shrinks once the test body has run, so the
    engine must outlive it (as a session cluster does)."""
    started = []
    yield started
    for eng in started:
        eng.__exit__(None, None, None)


def test_shrinkable(experiment, seeds, engines):
    """Every reply after plans[2] was sent holds its first canary (``INNER_LEAK_FIRST=n``: only the first n replies;
    ``INNER_LEAK_MIN_CHARS=k``: only replies to prompts of at least k characters)."""
    wl = Workload(seeds(6), n_tenants=4, prefix="sh")
    plans = [wl.request(wl.tenants[i % 4], n_canaries=2) for i in range(24)]
    marker = plans[2].prompt[:12]  # the owner's opening words: no canary, and no shortening cuts them
    assert sum(marker in p.prompt for p in plans) == 1
    eng = LeakFirst(marker, int(os.environ.get("INNER_LEAK_FIRST", "1000000")))
    eng.leak_min_chars = int(os.environ.get("INNER_LEAK_MIN_CHARS", "0"))  # a leak that needs a long prompt
    eng.delay_s = 0.05  # a reply is made up a little after its request (the owner it waits for: wait_owner_s)
    engines.append(eng.__enter__())
    with experiment("shrinkable", plans, [Isolation(), Sensitivity()], cluster=StandIn(eng.url), faults=None,
                    seed=wl.seed, settle_s=0, timeout_s=10, concurrency=4) as ex:
        pass
    ex.require(isolation=PASS)


class _Handle:
    def __init__(self, log, fid):
        self.log, self.id = log, fid

    def heal(self):
        self.log.emit("fault", action="healed", fault=self.id, injector="agent")


class _Agent:
    """Arms and heals (logged as the agent client logs them); no engine agent reports events."""

    def __init__(self, log):
        self.log, self.n = log, 0

    def arm(self, role, kind, target=None, params=None, count=None):
        self.n += 1
        fid = f"{kind}-{self.n}"
        self.log.emit("fault", action="armed", fault=fid, kind=kind, injector="agent", role=role, target=target,
                      params=params or {}, count=count)
        return _Handle(self.log, fid)

    def events(self, role):
        return []


class _Kit:
    """The faults kit the runner needs for nemesis ops, against the fake engine."""

    def __init__(self):
        from kvchaos.workload import EventLog

        self.log = EventLog()
        self.agent, self.net, self.proc = _Agent(self.log), None, None

    def heal_all(self, wait_s=60.0):
        return []

    def copy_agent_events(self, log, since=0.0):
        return []


def test_shrinkable_ops(experiment, seeds, engines):
    """test_shrinkable's leak, with nemesis ops the leak does not need (ex.nemesis): the shrink re-runs
    the ops it keeps and drops both."""
    from kvchaos.workload.scenario import Op

    wl = Workload(seeds(6), n_tenants=4, prefix="so")
    plans = [wl.request(wl.tenants[i % 4], n_canaries=2) for i in range(24)]
    eng = LeakFirst(plans[2].prompt[:12], 1000000)
    eng.delay_s = 0.05
    engines.append(eng.__enter__())
    with experiment("shrinkable_ops", plans, [Isolation(), Sensitivity()], cluster=StandIn(eng.url), faults=_Kit(),
                    seed=wl.seed, settle_s=0, timeout_s=10, concurrency=4) as ex:
        ex.nemesis([Op(at_s=0, injector="agent", role="prefill", kind="delay", target={"tenant": "t001"},
                       params={"ms": 5}),
                    Op(at_s=0, injector="action", kind="abort", rids=[plans[5].rid],
                       on={"role": "prefill", "ev": "transfer_start", "rid": plans[5].rid})],
                   {plans[7].rid: 0})
    ex.require(isolation=PASS)
