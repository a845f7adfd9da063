"""Logs without a leak: clean logs with power (the mirror: every request recites exactly its own
canaries, 1-2 logs, every endpoint and delivery, clean noise) and the power floor gamed."""

from __future__ import annotations

from hypothesis import strategies as st

from .clean import NOISE, Mint, clean_request, noise_request, reply_wire
from .logs import LogSpec, Req
from .replay import Wire
from .replies import ERROR_SHAPES, PATHS, error_body, recite
from .scenario import COMBOS, EP, Scenario, builder

# ----------------------------------------------------------------- the power floor, gamed
@st.composite
def gamed_power(draw):
    params = {"seed": draw(st.integers(0, 2**16)), "n_empty": draw(st.integers(18, 20)),
              "n_many": draw(st.integers(2, 3)), "per_many": draw(st.integers(30, 32)),
              "n_503": draw(st.integers(150, 200)), "shape": draw(st.sampled_from(ERROR_SHAPES))}
    return Scenario("power-floor-gamed", "no-leak", params, twin_green=False)


@builder("power-floor-gamed")
def _b_gamed(sc, leak):
    m = Mint("main", sc.params["seed"])
    reqs = []
    for _ in range(sc.params["n_empty"]):  # no canaries: "echoed" by saying nothing
        p = m.plan("generate", "plain", canaries=[])
        reqs.append(Req(p, reply_wire(m, p, "", "complete")))
    for _ in range(sc.params["n_many"]):
        p = m.plan("generate", "plain", ncan=sc.params["per_many"], n_tokens=600)
        reqs.append(Req(p, reply_wire(m, p, recite(p.canaries), "complete")))
    for _ in range(sc.params["n_503"]):
        p = m.plan("generate", "plain")
        reqs.append(Req(p, Wire(503, error_body(sc.params["shape"], 503, "Service Unavailable"), "eof", m.lat())))
    m.rng.shuffle(reqs)
    return [LogSpec("main", reqs)]


# ----------------------------------------------------------------- mirror: clean logs with power
MIRROR_MIN = 60  # complete HTTP-200 probe requests per log


@st.composite
def mirror(draw):
    """1-2 logs; per log how many clean requests of each (endpoint, delivery) — at least 60 in all,
    each with 1-3 canaries — and how many of each kind of clean noise (< 20 % of the log's requests)."""
    n_logs = draw(st.integers(1, 2))
    logs = []
    for i in range(n_logs):
        pd = draw(st.booleans())
        counts = [draw(st.integers(0, 14)) for _ in COMBOS]
        counts[0] += max(0, MIRROR_MIN - sum(counts))
        noise = [draw(st.integers(0, 2)) for _ in NOISE]
        cap = (sum(counts) * 20 - 1) // 80  # noise / (clean + noise) < 20 %
        while sum(noise) > cap:
            noise[noise.index(max(noise))] -= 1
        logs.append({"base": {f"{a}/{b}": c for (a, b), c in zip(COMBOS, counts) if c},
                     "noise": {w: c for w, c in zip(NOISE, noise) if c}, "pd": pd,
                     "version": draw(st.sampled_from(("0.5.23", "0.5.22", None))), "seed": draw(st.integers(0, 2**16))})
    return Scenario("mirror", f"{n_logs}-log", {"logs": tuple(logs)}, twin_green=True)


@builder("mirror")
def _b_mirror(sc, leak):
    out = []
    for i, lg in enumerate(sc.params["logs"]):
        m = Mint(f"mir{i}", lg["seed"])
        shapes = [tuple(k.split("/")) for k, c in lg["base"].items() for _ in range(c)]
        m.rng.shuffle(shapes)
        reqs = [clean_request(m, "generate" if lg["pd"] else EP[ep], d, m.rng.randint(1, 3)) for ep, d in shapes]
        for what, c in lg["noise"].items():
            for _ in range(c):
                if what == "leg_error" and not lg["pd"]:
                    what = "http_error"
                reqs.insert(m.rng.randrange(len(reqs) + 1), noise_request(m, what, m.rng.choice(list(PATHS)), lg["pd"]))
        if lg["pd"]:
            for r in reqs:
                if r.wire.leg is None:
                    r.wire.leg = (200, None, m.rng.choice(("early", "late")))
        out.append(LogSpec(f"mir{i}", reqs, version=lg["version"], pd=lg["pd"]))
    return out
