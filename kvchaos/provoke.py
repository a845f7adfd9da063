"""What every finding's ``reports/findings/<id>/provoke.py`` shares: its command line (trials, control
trials, layout, output folder, one positive knob), its own PD cluster (the CPU profile, with the kvchaos
agent and the network fault proxy) and its summary (``provoke.json`` and the reproduced / control
line). A provoke script reproduces a finding on a cluster of its own, outside pytest:

    python reports/findings/<id>/provoke.py --trials 10 --control 3

A trial that can be said as data is a :class:`~kvchaos.workload.scenario.Scenario` (:func:`scenario_trial`):
it runs through the experiment runner, writes its ``scenario.json`` beside its event log, and replays with
``kvchaos fuzz --replay DIR/trial-NN.scenario.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from contextlib import contextmanager
from typing import Callable, NamedTuple

from faults import AGENT_MODULE, FaultKit, open_network_proxy
from kvchaos.cluster import Cluster, ClusterSpec
from kvchaos.cluster.layouts import apply, parse
from kvchaos.experiment import Experiment, kv_layout, run_scenario
from kvchaos.workload import EventLog
from kvchaos.workload.scenario import Deployment, Scenario
from kvchaos.workload.snapshots import server_field


def parser(doc: str, out: str, control_help: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--control", type=int, default=3, help=control_help)
    ap.add_argument("--layout", default=None, help="a KV layout name (default: the CPU profile's own)")
    ap.add_argument("--out", default=out)
    return ap


def check(ap: argparse.ArgumentParser, a) -> None:
    if a.trials < 0 or a.control < 0 or a.trials + a.control < 1:
        ap.error("--trials >= 0, --control >= 0, and at least one trial in all")


def spec_for(layout: str | None, source: str, **overrides) -> ClusterSpec:
    """The CPU profile with ``layout`` applied (None: the profile's own) and ``overrides`` on top."""
    base = ClusterSpec.load("cpu")
    data = apply(base.to_dict(), parse(layout)) if layout else base.to_dict()
    return ClusterSpec.from_dict({**data, **overrides}, source=source)


def start_cluster(a, source: str, spec: ClusterSpec | None = None, proxy: bool = True, label: str = "") -> Cluster:
    """A fresh ``a.out`` and a cluster of ``spec`` (default: the CPU profile, ``a.layout`` applied)
    with its logs under ``a.out/cluster``; prints how long it took to come up."""
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    spec = spec or spec_for(a.layout, source)
    t0 = time.monotonic()
    c = Cluster(spec, os.path.join(a.out, "cluster"), proxy_factory=open_network_proxy if proxy else None,
                agent_module=AGENT_MODULE).start()
    print(f"{label}cluster up in {time.monotonic() - t0:.0f} s; router {c.endpoints.router}", flush=True)
    return c


class Summary(NamedTuple):
    """How a provoke script counts: an armed trial that ``reproduced``, a control trial that went bad
    (``control_bad``, counted under ``control_key``), and how the line says it."""
    reproduced: Callable[[dict], bool]
    control_bad: Callable[[dict], bool]
    control_key: str
    control_what: str
    bad_word: str


def begin(doc: str, out: str, control_help: str, source: str, knob: tuple[str, float] | None = None,
          options: Callable | None = None, env: Callable | None = None):
    """The command line parsed and checked (``knob``: one more positive float option, name and default,
    recorded in the results; ``options(ap)`` adds a script's own), the cluster started with
    ``env(args)`` on top of the profile's engine environment: ``(args, cluster, results)``."""
    ap = parser(doc, out, control_help)
    if knob:
        ap.add_argument(f"--{knob[0]}", type=float, default=knob[1])
    if options:
        options(ap)
    a = ap.parse_args()
    check(ap, a)
    results = {"layout": a.layout or "profile", "trials": []}
    if knob:
        value = getattr(a, knob[0].replace("-", "_"))
        if value <= 0:
            ap.error(f"--{knob[0]} > 0")
        results[knob[0].replace("-", "_")] = value
    spec = None
    if env:
        spec = spec_for(a.layout, source)
        spec = dataclasses.replace(spec, env={**spec.env, **env(a)})
    return a, start_cluster(a, source, spec=spec), results


def finish(results: dict, out: str, summary: Summary) -> None:
    """Count the armed trials that reproduced and the control trials that went bad, write
    ``out/provoke.json`` and say both in one line."""
    armed = [r for r in results["trials"] if r["armed"]]
    ctrl = [r for r in results["trials"] if not r["armed"]]
    results["reproduced"] = sum(bool(summary.reproduced(r)) for r in armed)
    results[summary.control_key] = sum(bool(summary.control_bad(r)) for r in ctrl)
    with open(os.path.join(out, "provoke.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"reproduced {results['reproduced']}/{len(armed)} (control, {summary.control_what}: "
          f"{results[summary.control_key]}/{len(ctrl)} {summary.bad_word}); {out}/provoke.json", flush=True)


@contextmanager
def session(doc: str, out: str, control_help: str, source: str, summary: Summary,
            knob: tuple[str, float] | None = None, options: Callable | None = None, env: Callable | None = None):
    """``begin``, then (on any exit) stop the cluster and ``finish``: yields ``(args, cluster, results)``."""
    a, c, results = begin(doc, out, control_help, source, knob, options, env)
    try:
        yield a, c, results
    finally:
        c.stop()
        finish(results, a.out, summary)


def run_trials(a, results: dict, one: Callable[[int, bool], dict], line: Callable[[dict], str]) -> None:
    """``a.control`` control trials, then ``a.trials`` armed ones: each ``one(i, armed)`` recorded with
    ``armed`` and said in one line (``trial  i armed|control`` + ``line(record)``)."""
    for i in range(a.control + a.trials):
        armed = i >= a.control
        r = one(i, armed)
        r["armed"] = armed
        results["trials"].append(r)
        print(f"trial {i:2d} {'armed  ' if armed else 'control'}{line(r)}", flush=True)


def deployment(c: Cluster, **live) -> Deployment:
    """The deployment ``c`` runs (its spec's restart knobs, layout and the engines' own version), with
    ``live`` knobs on top: what a trial's scenario says it needs to replay."""
    version = server_field(c.server_info("prefill"), "version")
    return Deployment(Deployment.from_spec(c.spec, kv_layout(c), version).restart, dict(live))


def scenario_trial(c: Cluster, out: str, sc: Scenario) -> Experiment:
    """Run ``sc`` on the script's cluster through the experiment runner: its live knobs and nemesis ops
    armed on time and healed in a ``finally`` (:func:`kvchaos.experiment.run_scenario`), its checkers
    judging the log. Writes ``out/<name>.events.jsonl``, ``.verdicts.json`` and ``.scenario.json`` (which
    replays: ``kvchaos fuzz --replay``). The experiment is returned unjudged: the script counts what it
    reproduces from the verdicts' witnesses; nothing here raises on a FAIL."""
    with EventLog(os.path.join(out, f"{sc.name}.faults.jsonl")) as flog:
        kit = FaultKit(c, flog)
        try:
            return run_scenario(lambda name, plans, checks, **kw: Experiment(
                name, plans, checks, cluster=c, run_dir=out, faults=kit, test_id=f"provoke::{sc.name}",
                path=os.path.join(out, f"{sc.name}.events.jsonl"), **kw), sc, kit, c)
        finally:
            kit.heal_all(wait_s=0.0)
