"""The abort choreography (``kvchaos.suite.abort_in_flight``) against a stand-in fault kit: it takes
the victims in the order their writes were parked, not the plans' order. A soak run at ce2c3d0 went red
when the second victim's write was parked first and held up the first one's: the choreography waited
for the first until the other's hold expired (30 s), then aborted a request that had already finished."""

import itertools
from types import SimpleNamespace

from kvchaos import suite

_walls = itertools.count(100)


class Hold:
    def __init__(self, agent, rid):
        self.agent, self.rid, self.id = agent, rid, f"hold-{rid}"

    def release(self):
        self.agent.released.append(self.rid)
        self.agent.log.append({"ev": "fault_fired", "fault": self.id, "phase": "late_write", "wall": next(_walls)})


class Agent:
    """Parks the writes of ``park_order`` in that order, the next one only after the previous is released."""

    def __init__(self, park_order):
        self.park_order, self.log, self.released, self.holds = list(park_order), [], [], {}

    def arm(self, role, kind, target, params):
        assert (role, kind) == ("prefill", "hold")
        h = self.holds[target["rid"]] = Hold(self, target["rid"])
        return h

    def events(self, role):
        parked = {e["fault"] for e in self.log if e.get("phase") == "held"}
        nxt = next((r for r in self.park_order if self.holds[r].id not in parked), None)
        if nxt is not None and len(parked) == len(self.released):  # one write parked at a time
            self.log.append({"ev": "fault_fired", "fault": self.holds[nxt].id, "phase": "held", "room": nxt,
                             "wall": next(_walls)})
        return list(self.log)

    def wait_event(self, role, ev, timeout, **match):
        return next(e for e in self.log if e["ev"] == ev and all(e.get(k) == v for k, v in match.items()))


def test_victims_are_aborted_in_the_order_their_writes_park(monkeypatch):
    aborted = []
    monkeypatch.setattr(suite, "abort_on_both", lambda cluster, rid: aborted.append(rid) or {"prefill": 200})
    agent = Agent(park_order=["v2", "v1"])
    chor = suite.abort_in_flight(None, SimpleNamespace(agent=agent), [SimpleNamespace(rid="v1"), SimpleNamespace(rid="v2")],
                                 hold_s=0, wait_s=2)
    out = chor()
    assert aborted == ["v2", "v1"] and agent.released == ["v2", "v1"]
    assert [(o["rid"], o["room"]) for o in out] == [("v2", "v2"), ("v1", "v1")] and all("error" not in o for o in out)


def test_a_write_never_parked_is_an_error_named_not_a_hang(monkeypatch):
    monkeypatch.setattr(suite, "abort_on_both", lambda cluster, rid: {"prefill": 200})
    agent = Agent(park_order=["v1"])  # v9's write is never parked
    chor = suite.abort_in_flight(None, SimpleNamespace(agent=agent), [SimpleNamespace(rid="v1"), SimpleNamespace(rid="v9")],
                                 hold_s=0, wait_s=0.2)
    out = chor()
    assert out[0]["rid"] == "v1" and "error" not in out[0]
    assert out[1]["rid"] == "v9" and "no fault_fired held for hold-v9" in out[1]["error"]
