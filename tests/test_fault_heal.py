"""The ``faults`` fixture heals after a failing test and the next test starts clean (real embedded
proxy, inner pytest run in a subprocess)."""

import json
import os
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "heal_suite"


def test_heal_runs_after_a_failing_test(tmp_path):
    out = tmp_path / "inner.json"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(DATA / "inner_heal.py"),
                        "--kvchaos-reports", str(tmp_path / "reports"), "--rootdir", str(DATA)],
                       env={**os.environ, "KVCHAOS_INNER_OUT": str(out)}, capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert "1 failed, 1 passed" in r.stdout, r.stdout[-3000:]
    assert "planted failure with a toxic armed" in r.stdout
    assert json.loads(out.read_text()) == {"armed_at_session_end": []}
    # the event log of the failing test holds the arm and the heal
    logs = list((tmp_path / "reports").rglob("*test_arms_then_fails.jsonl"))
    evs = [json.loads(x) for x in logs[0].read_text().splitlines()]
    actions = [e["action"] for e in evs if e["ev"] == "fault"]
    assert actions[0] == "armed" and "healed" in actions
