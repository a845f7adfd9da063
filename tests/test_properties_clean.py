"""Green must never lie, its mirror: clean logs with power are green (property 2 of
``tests/test_properties.py``) — 1-2 logs where every request recites exactly its own canaries (>= 60
complete HTTP-200 probe requests, every endpoint and delivery, router or pd_direct, < 20 % clean noise)
pass ``kvchaos judge`` and the suites' policy."""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import given, settings

from tests import strategies as S
from tests.property_harness import MIRROR_EXAMPLES, PROPERTY, _tail, judge, suite


# ------------------------------------------------------------------------------ 2. clean logs with power are green
def test_clean_logs_with_power_are_green(tmp_path):
    seen = Counter()

    @settings(max_examples=MIRROR_EXAMPLES, **PROPERTY)
    @given(sc=S.mirror())
    def clean_is_green(sc):
        for lg in sc.params["logs"]:
            seen.update(f"{'generate' if lg['pd'] else S.EP[k[0]]}/{k.split('/')[1]}" for k in lg["base"])
            seen.update(f"noise:{w}" for w in lg["noise"] if w != "leg_error" or lg["pd"])
            seen.update(["pd" if lg["pd"] else "router", f"logs:{len(sc.params['logs'])}"])
        with tempfile.TemporaryDirectory(dir=tmp_path) as d:
            logs = sc.write(Path(d))
            rc, out = judge(logs["judged"])
            assert rc == 0, f"kvchaos judge exit {rc} on clean logs with power\n{_tail(out)}"
            green, detail = suite(logs, sc)
            assert green, f"suite_judgement red on clean logs with power\n{_tail(detail)}"

    clean_is_green()
    want = {f"{e}/{d}" for e in S.EP.values() for d in S.DELIVERIES} | {f"noise:{w}" for w in S.NOISE} \
        | {"pd", "router", "logs:1", "logs:2"}
    assert not want - set(seen), f"the mirror property never ran {sorted(want - set(seen))}"
