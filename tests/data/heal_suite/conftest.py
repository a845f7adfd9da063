"""Inner suite for tests/test_fault_heal.py: the real embedded proxy behind a stand-in cluster."""

import json
import os
import types

import pytest

from faults.netfault import NetworkFaults


class StandInCluster:
    def __init__(self):
        self.proxy = NetworkFaults.open("embedded", "heal")
        self.proxy.add("client", 0, 9)  # upstream never contacted: only the toxic API is exercised

    def generate(self, **kw):
        return types.SimpleNamespace(status_code=200, text="ok")

    def check_alive(self):
        pass


@pytest.fixture(scope="session")
def cluster():
    c = StandInCluster()
    yield c
    with open(os.environ["KVCHAOS_INNER_OUT"], "w") as f:
        json.dump({"armed_at_session_end": c.proxy.armed()}, f)
    c.proxy.close()
