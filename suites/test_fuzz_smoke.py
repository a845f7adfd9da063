"""The search's smoke: ``kvchaos fuzz`` for half a minute on the session's cluster (no restart: the
deployment's restart knobs stay the session's, its live knobs, traffic and fault schedules vary). The
30-minute runs are ``make fuzz``; this one shows that the search still works end to end
on the real engines: it runs scenarios, hears the engines' own states, sees with power where nothing is
broken (its first run, the steady state: ordinary traffic, no fault), writes a scenario that loads back
for every run, and confirms no NEW leak; and that the PD cluster's caches flush (what its confirmations
stand on)."""

from __future__ import annotations

import json
import time

import pytest

from kvchaos.fuzz.corpus import Corpus
from kvchaos.fuzz.grammar import Base
from kvchaos.fuzz.loop import Clusters, Fuzzer, answers
from kvchaos.policy import Registry
from kvchaos.workload.scenario import Scenario
from kvchaos.workload.snapshots import flush_caches, wait_quiet

# disruptive: a scenario may leave hung requests the router keeps retrying; such tests run last on a cluster
pytestmark = [pytest.mark.cluster, pytest.mark.disruptive]
# half a minute: the steady state and the first fault scenario drawn after it (seed 1: 2 of the first minute's 4 on
# this machine, 2026-12-08) show the search works end to end; each further one is ~20 s of both engines on make
# test's critical path. The searches are make fuzz's
BUDGET_S = 30.0
SEED = 1


def test_fuzz_smoke_runs_sees_and_finds_no_new_leak(cluster, faults, kvchaos_policy, kvchaos_run_dir, seeds):
    # what confirmations and shrink steps stand on (kvchaos.fuzz.loop.as_on_a_fresh_cluster): both roles
    # of a PD cluster flush their caches once idle. Checked first, while the session's cluster is idle:
    # a search may leave requests hung in the engine (the hang band), which no flush waits out
    quiet = wait_quiet(cluster, timeout_s=60, stable_s=2)
    assert quiet["quiet"], f"the session's cluster is still busy before the search: {quiet}"
    assert flush_caches(cluster) == {"prefill": True, "decode": True}
    starts = []

    def start(_dep):  # the session's cluster; after a run that left it not answering, its known engine
        if starts:     # failures healed, then up to a minute for it to answer (a router circuit reopens)
            if hasattr(cluster, "heal_engine_errors"):
                cluster.heal_engine_errors()
            t_end = time.monotonic() + 60
            while not answers(cluster):
                assert time.monotonic() < t_end, "the session's cluster stopped answering during the fuzz smoke"
                time.sleep(2)
        starts.append(1)
        return cluster, faults, kvchaos_policy

    out = kvchaos_run_dir / "fuzz-smoke"
    fz = Fuzzer(clusters=Clusters(start, lambda cur: cur[1].heal_all()), base=Base.of_cluster(cluster),
                registry=Registry.load(), out=out, corpus=Corpus(out / "corpus"), seed=seeds(SEED),
                budget_s=BUDGET_S, deployments=False, confirm_all=False, say=lambda m: print(m, flush=True))
    s = fz.run()

    # a scenario whose requests hang into their timeouts takes ~95 s here: one minute may hold only one
    assert s["execs"] >= 1 and s["errors"] == 0, f"{s['execs']} scenarios run, {s['errors']} refused (see {out})"
    assert s["features"] >= 3, f"only {s['features']} engine states heard: is the in-engine agent reporting?"
    runs = [json.loads(line) for line in (out / "execs" / "experiments.jsonl").read_text().splitlines()]
    powered = [r["name"] for r in runs if r.get("verdicts", {}).get("isolation") in ("pass", "fail")]
    # the search starts from its steady state (ordinary traffic, nothing broken): blind there, blind everywhere.
    # Whether a scenario with faults is powered depends on what the seed drew (a hang-band probe can push every
    # request into its timeout): printed, not required (with CI's seed, 2026-12-05, both of two were blind)
    assert runs[0]["name"] == "fz00000" and "fz00000" in powered, (
        f"the search's steady state (no fault, no live knob) was blind: {runs[0].get('verdicts')}; the oracles "
        "cannot see a leak on this cluster")
    print(f"fuzz smoke: {len(runs)} scenarios, {len(powered)} powered ({', '.join(powered)}), "
          f"{s['features']} engine states, {s['stuck']} left requests in the engines")
    for r in runs:  # every run's scenario loads back as the same scenario
        assert r.get("scenario"), f"{r['name']} wrote no scenario.json: {r.get('scenario_error')}"
        sc = Scenario.load(out / "execs" / r["scenario"])
        assert Scenario.from_dict(sc.to_dict()).digest() == sc.digest()
    # a confirmed NEW leak is red; a NEW find that is no leak (an availability or protocol failure the
    # triage did not explain) is printed with its BUG.md for a person to read
    for sig, n in s["new"].items():
        print(f"fuzz smoke: NEW {sig} ({n['oracle']}, reproduced {n.get('reproduced')}): {out / 'finds' / ('new-' + sig)}")
    leaks = {sig: n for sig, n in s["new"].items() if n.get("confirmed") and n.get("leak")}
    assert not leaks, f"a NEW leak, confirmed by reruns: {sorted(leaks)}: see {out / 'finds'}"

