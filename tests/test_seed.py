"""One seed per run: derivation, plan digests, seeded network faults, and a dry run's digests
(same seed twice: identical for every scenario; another seed: different)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from faults.proxy import Toxic
from kvchaos.workload import Workload, plans_digest
from kvchaos.workload.seed import REFERENCE, SeedError, Seeds, derive, parse
from tests.util import child_env

REPO = Path(__file__).resolve().parents[1]


def test_reference_seed_keeps_each_suites_own_seeds_and_others_mix():
    assert derive(REFERENCE, 101) == 101  # the reviewed plans
    a, b = derive(7, 101), derive(7, 102)
    assert a != 101 and a != b and derive(7, 101) == a and derive(8, 101) != a
    assert 1 <= a <= 2**31 - 1
    # stable across processes whatever their hash seed (a replay is another process)
    code = "from kvchaos.workload.seed import derive; print(derive(7, 101), derive(7, 'x', 'fault', 1))"
    outs = {subprocess.run([sys.executable, "-c", code], env=child_env(PYTHONHASHSEED=h), capture_output=True,
                           text=True, check=True, cwd=REPO).stdout for h in ("1", "2")}
    assert outs == {f"{a} {derive(7, 'x', 'fault', 1)}\n"}


def test_seeds_of_a_test_and_bad_input():
    s = Seeds(7, "suites/x.py::test_a")
    assert s(101) == derive(7, 101) and s.used == {101: derive(7, 101)}
    f1, f2 = s.fault(), s.fault()
    again = Seeds(7, "suites/x.py::test_a")
    assert f1 != f2 and [again.fault(), again.fault()] == [f1, f2]
    assert Seeds(7, "suites/x.py::test_b").fault() != f1
    for bad in (-1, "101", 1.5, True):
        with pytest.raises(SeedError, match="workload stream label"):
            s(bad)
    assert parse("42") == 42 and parse("0x10") == 16 and parse(0) == 0
    assert parse(None) >= 1 and parse("random") != parse("random")
    for bad, why in (("seven", "an integer"), ("-3", "out of range"), (str(2**31), "out of range")):
        with pytest.raises(SeedError, match=why):
            parse(bad)


def test_same_seed_same_plans_digest_other_seed_or_plan_differs():
    def plans(seed, **kw):
        wl = Workload(seed, n_tenants=6, prefix="dg", salts="tenant", **kw)
        return wl.mix(60, weights={"plain": 3, "abort_after": 1, "stream": 1})

    a, b = plans(5), plans(5)
    assert {p.cache_salt for p in a}.isdisjoint({p.cache_salt for p in b})  # fresh salt nonces per workload
    assert plans_digest(a) == plans_digest(b)  # ... which the digest sees through
    assert plans_digest(plans(6)) != plans_digest(a)
    assert plans_digest(plans(5, page_size=16)) != plans_digest(a)  # diverging pairs follow the page size
    c = plans(5)
    nxt = next(p for p in c if p.abort_after_ms is not None)
    nxt.abort_after_ms += 1  # one abort point moved
    assert plans_digest(c) != plans_digest(a)


def test_network_toxics_draw_from_their_seed():
    def draws(seed):
        t = Toxic.from_body({"type": "latency", "attributes": {"latency": 10, "jitter": 5, "seed": seed},
                             "toxicity": 0.5})
        return [t.rng.random() for _ in range(5)]

    assert draws(3) == draws(3) != draws(4)
    unseeded = Toxic.from_body({"type": "latency", "attributes": {"latency": 10}})
    assert "seed" not in unseeded.attributes and unseeded.rng is not None


def _dry(tmp_path, name, seed):
    run = tmp_path / "reports" / name
    r = subprocess.run([sys.executable, "-m", "pytest", "suites", "--kvchaos-dry", "--kvchaos-seed", str(seed),
                        "-p", "no:cacheprovider", "-q", "-m", "not gpu", "--kvchaos-reports", str(tmp_path / "reports")],
                       cwd=REPO, env=child_env(KVCHAOS_RUN_ID=name), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert f"kvchaos seed: {seed}" in r.stdout
    assert json.loads((run / "run.json").read_text())["seed"] == seed
    return run


def test_dry_runs_of_one_seed_have_identical_digests_for_every_scenario(tmp_path):
    a, b, c = _dry(tmp_path, "s7a", 7), _dry(tmp_path, "s7b", 7), _dry(tmp_path, "s8", 8)
    recs = [json.loads(x) for x in (a / "plans.jsonl").read_text().splitlines()]
    assert len(recs) >= 30 and all(r["run_seed"] == 7 for r in recs)
    names = {r["name"] for r in recs}
    assert {"transfer_delay", "glm53-replay", "clean_control", "matrix_reject_admitted_mut_0", "prefix_cache"} <= names
    cli = [sys.executable, "-m", "kvchaos", "digests"]
    same = subprocess.run(cli + [str(a), str(b)], cwd=REPO, env=child_env(), capture_output=True, text=True)
    assert same.returncode == 0 and f"{len(recs)} scenarios, 0 differ, 0 not in every run" in same.stdout, same.stdout
    other = subprocess.run(cli + [str(a), str(c)], cwd=REPO, env=child_env(), capture_output=True, text=True)
    assert other.returncode == 1 and f"{len(recs)} scenarios, {len(recs)} differ" in other.stdout, other.stdout[-500:]
