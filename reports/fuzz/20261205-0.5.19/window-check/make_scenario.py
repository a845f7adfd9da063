"""Builds scenario.json: can the search's own live knob open the GLM-5.3 window on 0.5.19?

The steady-state traffic the grammar draws (seed 7) for a base deployment whose input limit is 512,
prefill's input limit lowered to 512 at run time (the ``prefill_input_limit`` live knob, the agent's
``input_limit``), and one tenant's three prompts of 700, 1000 and 1300 tokens (over prefill's limit,
under decode's 1536-token admission edge) put in after half the traffic. Built by hand to check the
mechanism is reachable by the search's own knobs; never used to seed a search.

Run: python reports/fuzz/20261205-0.5.19/window-check/make_scenario.py OUT.json
     kvchaos fuzz --engine-version 0.5.19 --replay OUT.json --times 1
"""
import random
import sys

from kvchaos.fuzz.grammar import Base, baseline, default_checks
from kvchaos.workload import Workload
from kvchaos.workload.scenario import Deployment, plan_dict

base = Base(pool=2048, context=4096, reservation=512, input_limit=512, restart={"engine_version": "0.5.19"})
sc = baseline(random.Random(7), base, "w519")
sc.deployment = Deployment({"engine_version": "0.5.19"}, {"prefill_input_limit": 512})
tenants = sorted({p["tenant"] for p in sc.traffic.plans})
wl = Workload(99, n_tenants=int(max(tenants)[1:]) + 1, prefix="w519-", page_size=1)
n = len(sc.traffic.plans)
for i, size in enumerate((700, 1000, 1300)):
    p = wl.request(wl.tenant(tenants[0]), "oversized", n_tokens=size, n_canaries=3)
    p.extra["probe"] = "reject"
    sc.traffic.plans.insert(int(n * (0.5 + 0.15 * i)), plan_dict(p))
sc.checks = default_checks(sc.traffic)
sc.validate().save(sys.argv[1] if len(sys.argv) > 1 else "scenario.json")
