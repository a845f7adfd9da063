"""Green must never lie: properties of ``kvchaos judge`` and of the suites' policy over generated logs.

1. ``test_leak_never_green[<class>]`` (here): a log in which the CLIENT received a foreign canary (owned
   by another request of the log, of another judged log, or of nobody) is never green — ``kvchaos judge``
   exits 1 or 3 (2 too where the shape is malformed input), also with ``--accept-known`` and with
   ``--checkers liveness``, and the suites' policy (:func:`suite_judgement`) is red. One test per
   shape class; inside a class Hypothesis draws its variants, and the test checks it ran every one.
2. ``test_clean_logs_with_power_are_green`` (``tests/test_properties_clean.py``): logs where every
   request recites exactly its own canaries (>= 60 complete HTTP-200 probe requests, every shape of
   reply, < 20 % clean noise) are green.
3. ``test_power_never_faked`` (here): the power floor gamed (requests with no canaries, two with many,
   most replies 503) is not green.
4. ``test_generators_produce_every_shape`` (``tests/test_properties_shapes.py``): what the generators
   write really has each shape (read back from the files, not from the generator's own labels), and
   every leak log's leak-free twin is green — so a leak property cannot pass because a shape never
   occurs or the log was red anyway.
5. ``test_generated_records_are_the_drivers`` (``tests/test_properties_driver.py``): the records the
   generators write for a reply are the ones ``kvchaos.workload.driver.Driver`` writes when a local
   server sends it the same bytes.

Logs are written by ``tests/strategies`` with ``EventLog`` as the driver writes them; what the
properties share (the adapter to the suites' API, settings, budgets) is ``tests/property_harness.py``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import event, given, settings

from tests import strategies as S
from tests.property_harness import (
    LEAK_EXAMPLES,
    POWER_EXAMPLES,
    PROPERTY,
    _tail,
    _where,
    every_variant,
    judge,
    suite,
)


# ------------------------------------------------------------------------------ 1. leak never green
def check_leak(sc: S.Scenario, tmp_path: Path) -> None:
    allowed = {1, 2, 3} if sc.malformed else {1, 3}
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        logs = sc.write(Path(d))
        where = _where(sc, logs)
        rc, out = judge(logs["judged"])
        assert rc in allowed, f"kvchaos judge exit {rc} on a log with a leak: {where}\n{_tail(out)}"
        rc, out = judge(logs["judged"], "--accept-known")
        assert rc in allowed, f"kvchaos judge --accept-known exit {rc} on a log with a leak: {where}\n{_tail(out)}"
        green, detail = suite(logs, sc)
        assert not green, f"suite_judgement green on a log with a leak: {where}\n{_tail(detail)}"
        rc, out = judge(logs["judged"], "--checkers", "liveness")
        assert rc in allowed, (f"kvchaos judge --checkers liveness exit {rc} on a log with a leak: {where}\n"
                               f"{_tail(out)}")


@pytest.mark.parametrize("cls", list(S.LEAK_CLASSES))
def test_leak_never_green(cls, tmp_path):
    def prop(passed: set):
        @settings(max_examples=LEAK_EXAMPLES, **PROPERTY)
        @given(sc=S.leak_scenarios(cls))
        def leak_never_green(sc):
            event(f"variant={sc.variant}")
            check_leak(sc, tmp_path)
            passed.add(sc.variant)

        leak_never_green()

    every_variant(cls, prop, lambda sc: check_leak(sc, tmp_path))


# ------------------------------------------------------------------------------ 3. power is never faked
def test_power_never_faked(tmp_path):
    @settings(max_examples=POWER_EXAMPLES, **PROPERTY)
    @given(sc=S.gamed_power())
    def gamed_is_not_green(sc):
        with tempfile.TemporaryDirectory(dir=tmp_path) as d:
            logs = sc.write(Path(d))
            rc, out = judge(logs["judged"])
            assert rc in (1, 3), (f"kvchaos judge exit {rc} on a log whose power floor is gamed (requests without "
                                  f"canaries, most replies 503)\n{_tail(out)}")
            rc, out = judge(logs["judged"], "--accept-known")
            assert rc in (1, 3), f"kvchaos judge --accept-known exit {rc} on a gamed power floor\n{_tail(out)}"
            green, detail = suite(logs, sc)
            assert not green, f"suite_judgement green on a gamed power floor\n{_tail(detail)}"

    gamed_is_not_green()
