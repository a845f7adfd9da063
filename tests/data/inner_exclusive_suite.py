"""Run by tests/test_machine_lock.py under ``pytest -n 2``: each test writes its own [start, end]
(and whether it is exclusive) to KVCHAOS_INNER_OUT.<worker>; the outer test checks the overlaps."""

import json
import os
import time

import pytest


def _run(name, exclusive=False):
    t0 = time.time()
    time.sleep(float(os.environ.get("KVCHAOS_INNER_SLEEP_S", "1.0")))
    out = f"{os.environ['KVCHAOS_INNER_OUT']}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
    with open(out, "a") as f:
        f.write(json.dumps({"name": name, "start": t0, "end": time.time(), "exclusive": exclusive,
                            "lock_env": os.environ.get("KVCHAOS_MACHINE_LOCK"),
                            "testrunuid": os.environ.get("PYTEST_XDIST_TESTRUNUID")}) + "\n")


@pytest.mark.parametrize("i", range(3))
def test_shared_before(i):
    _run(f"before{i}")


@pytest.mark.exclusive
def test_exclusive():
    _run("exclusive", exclusive=True)


@pytest.mark.parametrize("i", range(3))
def test_shared_after(i):
    _run(f"after{i}")
