"""The abort choreography as ops (``kvchaos.suite.abort_in_flight_ops``, carried out by
``kvchaos.schedule.Schedule``) against a stand-in fault kit: the victims are aborted in the order their
writes were parked, not the plans' order. A soak run at ce2c3d0 went red when the second victim's write
was parked first and held up the first one's: the choreography waited for the first until the other's
hold expired (30 s), then aborted a request that had already finished."""

import itertools
import threading
import time
from types import SimpleNamespace

import pytest

from kvchaos import suite
from kvchaos.schedule import NemesisError, Schedule

_walls = itertools.count(100)


class Hold:
    def __init__(self, agent, rid):
        self.agent, self.rid, self.id = agent, rid, f"hold-{rid}"
        self.healed = False

    def release(self):
        self.agent.released.append(self.rid)
        self.agent.log.append({"ev": "fault_fired", "fault": self.id, "kind": "hold", "rid": self.rid,
                               "phase": "late_write", "wall": next(_walls)})

    def heal(self):
        self.healed = True


class Agent:
    """Parks the writes of ``park_order`` in that order, the next one only after the previous is released."""

    def __init__(self, park_order):
        self.park_order, self.log, self.released, self.holds = list(park_order), [], [], {}
        self.lock = threading.Lock()

    def arm(self, role, kind, target=None, params=None, count=None):
        assert (role, kind) == ("prefill", "hold")
        h = self.holds[target["rid"]] = Hold(self, target["rid"])
        return h

    def events(self, role):
        with self.lock:
            parked = {e["fault"] for e in self.log if e.get("phase") == "held"}
            nxt = next((r for r in self.park_order if r in self.holds and self.holds[r].id not in parked), None)
            if nxt is not None and len(parked) == len(self.released):  # one write parked at a time
                self.log.append({"ev": "fault_fired", "fault": self.holds[nxt].id, "kind": "hold", "rid": nxt,
                                 "phase": "held", "room": nxt, "wall": next(_walls)})
            return list(self.log)

    def wait_event(self, role, ev, timeout=30.0, **match):
        deadline = time.monotonic() + timeout
        while True:
            got = [e for e in self.events(role) if e["ev"] == ev and all(e.get(k) == v for k, v in match.items())]
            if got:
                return got[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {ev} {match}")
            time.sleep(0.01)


def _run(agent, rids, wait_s):
    aborted = []
    ops = suite.abort_in_flight_ops([SimpleNamespace(rid=r) for r in rids], hold_s=0)
    def abort(cluster, rid):  # decode's scheduler acts on it: what each release waits for
        aborted.append(rid)
        with agent.lock:
            agent.log.append({"ev": "abort_ingested", "rid": rid, "wall": next(_walls)})
        return {"prefill": 200}

    s = Schedule(ops, SimpleNamespace(agent=agent, log=None), cluster="c", wait_s=wait_s, abort=abort)
    return s, aborted


def test_victims_are_aborted_in_the_order_their_writes_park():
    agent = Agent(park_order=["v2", "v1"])
    s, aborted = _run(agent, ["v1", "v2"], wait_s=2)
    s.run()
    assert aborted == ["v2", "v1"] and agent.released == ["v2", "v1"]
    assert s.heal() == [] and all(h.healed for h in agent.holds.values())


def test_a_write_never_parked_is_an_error_named_not_a_hang():
    agent = Agent(park_order=["v1"])  # v9's write is never parked
    s, aborted = _run(agent, ["v1", "v9"], wait_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(NemesisError, match=r"op [45] waits for op 3 \(hold on prefill\) to park a request"):
        s.run()
    assert time.monotonic() - t0 < 3 and aborted == ["v1"] and agent.released == ["v1"]
    assert s.heal() == []


def test_a_held_write_is_let_go_only_once_decode_acted_on_the_abort():
    """/abort_request answering only queues the abort: the write lands late only if decode has acted on it
    (its ``abort_ingested``), so the release waits for that, not a fixed time after the park."""
    agent = Agent(park_order=["v1"])
    aborted = []
    ops = suite.abort_in_flight_ops([SimpleNamespace(rid="v1")], hold_s=0)
    s = Schedule(ops, SimpleNamespace(agent=agent, log=None), cluster="c", wait_s=5,
                 abort=lambda cluster, rid: aborted.append(rid) or {"prefill": 200})
    th = threading.Thread(target=s.run)
    th.start()
    time.sleep(0.6)
    assert aborted == ["v1"] and agent.released == []  # aborted, but decode has not read it yet
    with agent.lock:
        agent.log.append({"ev": "abort_ingested", "rid": "v1", "wall": next(_walls)})
    th.join(5)
    assert agent.released == ["v1"] and s.heal() == []
