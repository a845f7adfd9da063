"""The attack logs of ``bench/attack_logs.py`` (classes a judge used to misread: what the client received
read partly, logs that are not whole, engine versions), each judged in-process by ``kvchaos judge``: a leak
or a blind run never exits 0, a clean log exits 0, bad input 2. ``python bench/attack_logs.py --repo DIR``
judges the same logs with another checkout (how they were shown wrong on main)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.property_harness import judge

SPEC = importlib.util.spec_from_file_location("attack_logs", Path(__file__).resolve().parents[1] / "bench" / "attack_logs.py")
attack = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(attack)


def test_every_attack_log_is_judged_as_it_must_be(tmp_path):
    wrong = []
    for cls, name, files, flags, want in attack.cases(tmp_path):
        rc, out = judge(files, *flags)
        if not attack.ok(want, rc):
            wrong.append(f"{cls}/{name}: want exit {want}, got {rc}: {out.strip().splitlines()[-1][:200]}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("want,rc,right", [("0", 0, True), ("0", 3, False), ("not 0", 1, True), ("not 0", 3, True),
                                           ("not 0", 0, False), ("not 0", 2, False), ("2", 2, True), ("2", 0, False)])
def test_what_counts_as_judged_right(want, rc, right):
    assert attack.ok(want, rc) is right
