"""Live, through the real cluster: a stream the load balancer cuts after it delivered another
tenant's canary makes the run red (the client's partial bytes are logged and scanned).

The victim's prompt carries the donor tenant's canary (``plant_leak``: what a KV cross-wiring would
make decode attend to); canaries are chosen so the donor's is recited first. A calibration request
measures where in the stream the donor's canary ends; the client-side proxy then cuts every
connection between that point and the end of the stream. The donor's canary reached the client,
the stream did not complete — and the verdict must be FAIL, the run red."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from faults.request import plant_leak
from kvchaos import canary
from kvchaos.experiment import PASS, VerdictsNotMet
from kvchaos.oracles import FAIL, Isolation
from kvchaos.probe import max_new_tokens, prompt
from kvchaos.workload.plan import RequestPlan

pytestmark = pytest.mark.cluster
HEADERS_MARGIN = 400  # response headers + chunked framing the proxy counts and httpx does not


def _plan(rng, rid, tenant, c, registry):
    registry.add(c, rid, tenant, "test_cut_stream_live")
    return RequestPlan(rid=rid, tenant=tenant, kind="stream", endpoint="completions", prompt=prompt(rng, 300, [c]),
                       canaries=[c], n_tokens=300, max_new_tokens=max_new_tokens(1))


def test_cut_stream_that_delivered_a_foreign_canary_is_red(experiment, faults, cluster):
    net = faults.need("net")
    rng = random.Random(4711)
    donor = _plan(rng, "cut-donor-t000", "t000", "[AQ7KD3MZXP]", cluster.canaries)  # recited first (A < Z)
    victim = _plan(rng, "cut-victim-t001", "t001", "[ZJ4WB2NTRH]", cluster.canaries)
    plant_leak(victim, donor)
    model = cluster.server_info("decode")["served_model_name"]
    # calibration: the same request whole, through the same path; where does the donor's canary end?
    body = {"model": model, "prompt": victim.prompt, "max_tokens": victim.max_new_tokens, "temperature": 0.0,
            "stream": True}
    raw = b""
    with httpx.stream("POST", cluster.endpoints.router + "/v1/completions", json=body, timeout=60) as r:
        for chunk in r.iter_bytes():
            raw += chunk
    text = raw.decode()
    # deltas arrive a token at a time: the donor's payload is complete at the chunk holding its last char
    seen, donor_at = "", None
    for line in text.splitlines():
        if line.startswith("data:") and "[DONE]" not in line:
            seen += json.loads(line[5:])["choices"][0]["text"]
            if canary.payload(donor.canaries[0]) in seen and donor_at is None:
                donor_at = text.find(line) + len(line)
    assert donor_at is not None, f"calibration: the model did not recite the donor's canary: {seen!r}"
    assert canary.payload(victim.canaries[0]) in seen, f"calibration: own canary missing: {seen!r}"
    cut = HEADERS_MARGIN + (donor_at + len(raw)) // 2
    assert cut < len(raw), (donor_at, len(raw))
    with experiment("cut_stream_foreign_canary", [victim], [Isolation()], concurrency=1, timeout_s=60,
                    settle_s=0, model_name=model) as ex:
        t = net.toxic("client", "limit_data", stream="downstream", toxicity=1.0, bytes=cut)
    t.verify()
    b = ex.run.bodies[victim.rid]
    assert b["complete"] is False, b  # the stream really was cut
    iso = ex.by["isolation"]
    assert iso.status == FAIL, iso
    w = iso.witnesses[0]
    assert (w["victim_rid"], w["owner_rid"], w["complete"]) == (victim.rid, donor.rid, False), w
    # what a user's run sees: red
    with pytest.raises(VerdictsNotMet, match="isolation: FAIL"):
        ex.require(isolation=PASS)
    assert ex.judgement.status == FAIL and ex.judgement.red
    # the leak was planted by this test: its record for the run report says so (the last judgement of
    # an experiment stands), so the harness's own check does not redden a green session's report
    j = ex.require(planted="plant_leak: the donor's canary in the victim's prompt; the stream cut by "
                           "limit_data after the donor's canary", isolation=FAIL)
    assert j.status == PASS and j.planted
