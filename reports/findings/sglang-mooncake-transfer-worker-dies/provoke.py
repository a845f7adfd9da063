"""Reproduce sglang-mooncake-transfer-worker-dies: prefill's Mooncake transfer thread dies on a KeyError
and every later KV transfer stalls, while prefill stays up and answers /health.

    python reports/findings/sglang-mooncake-transfer-worker-dies/provoke.py [--trials 10] [--control 3]
        [--layout LAYOUT] [--ms 300] [--out DIR] [--plain N] [--switch-interval S] [--status-hook armed|always]

Starts its own PD cluster (the CPU profile, with the kvchaos agent; --layout as in `kvchaos up`), then
per trial: arms ``stall_status_read`` (ms) on the first of 6 requests, sends the 6 at once through the
router (20 s client timeout), and looks in prefill's log for the engine's own traceback
("Transfer thread failed because of <room>") naming the stalled request's bootstrap room. A trial
whose worker died restarts prefill before the next. ``--control N`` runs N trials with nothing armed
first: the race's natural rate at this load (the window is a few bytecodes wide).

The race (mooncake/conn.py, end of ``transfer_worker``): ``room not in self.request_status or
self.check_status(room) == KVPoll.Success`` reads ``request_status`` twice; prefill's scheduler thread
``clear()``s the room (prefill.py, once it polled Success) in between. The fault stalls the second
read — SGLang's own read, made late; nothing else changes.

The natural rate (no fault): ``--trials 0 --control K --plain 200`` sends 200 requests of 8 tenants per
control trial at concurrency 64 (the clean control's shape), and ``--switch-interval 0.000001`` sets every
engine's GIL switch interval (``KVCHAOS_SWITCH_INTERVAL``; the default is 0.005) so forced thread switches,
which open the window, come far more often: the amplifier of the before/after measurement, the same in
both arms (at 0.0001 no trial of 20 died; at 0.000001 about one in five did: README.md, "Measured before
and after").
``--status-hook always`` wraps ``check_status`` at import as kvchaos did before 2026-12-04 (the
"before" arm); ``armed`` (default) is today's: only while a ``stall_status_read`` is armed.

Each trial is a scenario (``DIR/trial-NN.scenario.json``: the requests and the stall as data; it replays
with ``kvchaos fuzz --replay``; the amplifiers below are the cluster's environment, not the scenario's),
run by kvchaos' experiment runner.

Writes DIR/provoke.json (per trial: armed, fired, cleared during the stall, died, the witness, request
outcomes) and the cluster's logs under DIR/cluster/; prints a line per trial and "reproduced K/N".
"""
from __future__ import annotations

import argparse
import os
import time
from collections import Counter

from faults.client import AgentClient
from kvchaos.cluster import Cluster
from kvchaos.provoke import Summary, deployment, run_trials, scenario_trial, session
from kvchaos.workload import Workload
from kvchaos.workload.scenario import Op, Scenario, Traffic, plan_dict

SIGNATURE = "mooncake_transfer_worker_died"


def scenario(c: Cluster, i: int, ms: float | None, plain: int = 0) -> tuple[Scenario, str]:
    """Trial ``i`` as data: 6 requests of 3 tenants sent at once, the first's status read stalled ``ms``
    when armed; with ``plain`` (a control trial only) ``plain`` requests of 8 tenants at concurrency 64
    instead, nothing armed."""
    n, tenants = (plain, 8) if plain else (6, 3)
    wl = Workload(1000 + i, n_tenants=tenants, prefix=f"x{i:02d}")
    plans = wl.mix(n, lengths=(100, 300))
    victim = plans[0]
    ops = [Op(at_s=0.0, injector="agent", role="prefill", kind="stall_status_read", target={"rid": victim.rid},
              params={"ms": ms})] if ms else []
    sc = Scenario(name=f"trial-{i:02d}", seed=wl.seed, deployment=deployment(c),
                  traffic=Traffic([plan_dict(p) for p in plans], concurrency=min(len(plans), 64), timeout_s=20.0),
                  nemesis=ops, checks=[{"name": "liveness", "bound_s": 25.0}, {"name": "isolation"}],
                  origin={"by": "provoke sglang-mooncake-transfer-worker-dies", "trial": i})
    return sc.validate(), victim.rid


def trial(c: Cluster, ctl: AgentClient, out: str, i: int, ms: float | None, plain: int = 0) -> dict:
    sc, victim = scenario(c, i, ms, plain)
    t0 = time.monotonic()
    ex = scenario_trial(c, out, sc)
    wall = time.monotonic() - t0
    ends = {e["rid"]: e for e in ex.events if e.get("ev") == "end"}
    fired = [e for e in ex.events if e.get("ev") == "agent" and e.get("agent_ev") == "fault_fired"
             and e.get("kind") == "stall_status_read"]
    time.sleep(2)  # the traceback is written as the thread dies; give the log a moment
    errors = [e for e in list(ex.engine_errors) + c.engine_errors() if e["signature"] == SIGNATURE]
    rooms = {str(e["room"]) for e in fired}
    rec = {"trial": i, "armed": bool(ms), "ms": ms, "requests": len(sc.traffic.plans), "wall_s": round(wall, 1),
           "victim": victim, "fired": len(fired), "scenario": str(ex.scenario_path),
           "cleared_during_stall": [e.get("cleared_during_stall") for e in fired],
           "died": bool(errors), "witness_is_the_stalled_room": bool(rooms & {str(e.get("cause")) for e in errors}),
           "witness": errors[0]["line"] if errors else None,
           "outcomes": dict(Counter(str(e.get("outcome")) for e in ends.values()))}
    if any(e.get("healed") is None for e in errors):  # the run's engine watch may have restarted it already
        rec["restart"] = c.heal_engine_errors()[0]["healed"]
        ctl.wait_agents("prefill", ("MooncakeKVManager.send_kvcache",), timeout=60)
    return rec


SUMMARY = Summary(lambda r: r["died"] and r["witness_is_the_stalled_room"], lambda r: r["died"], "control_died",
                  "nothing armed", "died")


def line(r: dict) -> str:
    return (f": {r['requests']} requests {r['wall_s']} s, fired {r['fired']} cleared-in-stall {r['cleared_during_stall']} died {r['died']} (witness names the "
            f"stalled room: {r['witness_is_the_stalled_room']}) outcomes {r['outcomes']}")


def _number(kind, least: float, what: str):
    """An argparse type: ``kind`` of the string, refused (named) under ``least``."""
    def parse(v: str):
        x = kind(v)
        if x < least:
            raise argparse.ArgumentTypeError(f"{what}, got {v!r}")
        return x
    parse.__name__ = kind.__name__  # argparse names a non-number "invalid float value"
    return parse


def options(ap):
    ap.add_argument("--plain", type=_number(int, 0, ">= 0"), default=0,
                    help="control trials send this many requests at concurrency 64 (default: 6 at once)")
    ap.add_argument("--switch-interval", type=_number(float, 1e-9, "> 0 seconds"), default=None,
                    help="every engine's sys.setswitchinterval (seconds): the measurement's amplifier")
    ap.add_argument("--status-hook", choices=("armed", "always"), default="armed",
                    help="when the agent wraps check_status: only while armed (today), or always (before 2026-12-04)")


def env(a) -> dict:
    """What the engines get on top of the profile's environment."""
    out = {"KVCHAOS_AGENT_STATUS_HOOK": a.status_hook}
    if a.switch_interval is not None:
        out["KVCHAOS_SWITCH_INTERVAL"] = repr(a.switch_interval)
    return out


def main():
    with session(__doc__, "/tmp/kvchaos-transfer-worker-dies", "trials with nothing armed, first",
                 "provoke sglang-mooncake-transfer-worker-dies", SUMMARY, knob=("ms", 300.0),
                 options=options, env=env) as (a, c, results):
        results.update(plain=a.plain, switch_interval=a.switch_interval, status_hook=a.status_hook)
        ctl = AgentClient(c.agent_dir)
        c.engine_errors()  # what boot wrote is not a trial's
        run_trials(a, results, lambda i, armed: trial(c, ctl, a.out, i, a.ms if armed else None,
                                                      0 if armed else a.plain), line)


if __name__ == "__main__":
    main()
