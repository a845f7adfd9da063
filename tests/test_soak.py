"""Flake accounting over run directories: outcome counts per test, flaky = red in some runs only
(with each red run's seed), engine failures per run and per 1,000 requests."""

import json

import pytest

from kvchaos.soak import SoakError, account, render


def _run(d, seed, outcomes, n_requests, engine_errors=()):
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"seed": seed}))
    lines = [{"ev": "collected", "n": len(outcomes)}]
    lines += [{"ev": "end", "nodeid": k, "outcome": v} for k, v in outcomes.items()]
    lines.append({"ev": "finished", "exitstatus": 1 if "failed" in outcomes.values() else 0})
    (d / "progress.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    # one experiment recorded twice (at its end, then judged): counted once
    rec = {"id": f"e-{seed}", "name": "x", "n": n_requests}
    (d / "experiments.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps(rec) + "\n")
    if engine_errors:
        (d / "engine_errors.jsonl").write_text("\n".join(json.dumps({"signature": s, "role": "prefill", "test": "t"})
                                                          for s in engine_errors) + "\n")
    return d


def test_a_test_red_in_one_run_only_is_flaky_and_names_its_seed(tmp_path):
    a = _run(tmp_path / "a", 11, {"t::ok": "passed", "t::flap": "passed", "t::known": "known"}, 500)
    b = _run(tmp_path / "b", 12, {"t::ok": "passed", "t::flap": "failed", "t::known": "known"}, 1500,
             engine_errors=["mooncake_transfer_worker_died"])
    nested = b / "replays" / "b-replay-1"  # a replay's run beneath the run: not this run's requests
    nested.mkdir(parents=True)
    (nested / "experiments.jsonl").write_text(json.dumps({"id": "r1", "name": "x", "n": 999}) + "\n")
    res = account([a, b])
    assert res["flaky"] == ["t::flap"] and res["red"] == ["t::flap"]
    assert res["tests"]["t::flap"]["red_seeds"] == [{"seed": 12, "run_dir": str(b)}]
    assert res["tests"]["t::known"]["counts"] == {"known": 2} and not res["tests"]["t::known"]["flaky"]
    assert res["requests"] == 2000
    e = res["engine_errors"]["mooncake_transfer_worker_died"]
    assert (e["occurrences"], e["runs_with"], e["per_run"], e["per_1000_requests"]) == (1, 1, 0.5, 0.5)
    text = render(res)
    assert "FLAKY t::flap: failed 1 passed 1" in text and f"kvchaos replay {b} 't::flap'" in text
    assert "0.50 per run, 0.500 per 1,000 requests" in text
    assert "t::ok" not in text  # passed everywhere: not listed


def test_every_run_green_is_neither_red_nor_flaky(tmp_path):
    runs = [_run(tmp_path / str(i), i, {"t::a": "passed", "t::b": "passed"}, 100) for i in range(3)]
    res = account(runs)
    assert res["red"] == [] and res["flaky"] == [] and res["engine_errors"] == {}
    assert "every test passed" in render(res) and "engine failures: none" in render(res)


def test_not_a_run_directory_is_named(tmp_path):
    with pytest.raises(SoakError, match="no progress.jsonl"):
        account([tmp_path])
    with pytest.raises(SoakError, match="no run directories"):
        account([])
