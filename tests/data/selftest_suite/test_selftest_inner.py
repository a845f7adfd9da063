"""Run by tests/test_selftest.py in a child pytest: the session's self-test, as the cluster fixture runs
it, against an engine that leaks on a request nothing was planted in (tests/test_selftest.py's
LeaksOnOne). The test itself passes; the run must not."""

from kvchaos.policy import Policy
from kvchaos.selftest import run_selftest
from tests.fake_engine import FakeEngine  # noqa: F401 - the stand-ins below import it
from tests.test_selftest import LeaksOnOne, StandIn


def test_every_test_passes_while_the_selftest_saw_the_engine_leak(kvchaos_run_dir):
    with LeaksOnOne() as eng:
        out, _ex = run_selftest(StandIn(eng.url), kvchaos_run_dir, Policy())
    assert out["status"] == "engine_leak"
