"""The probe model: shipped, reproducible, recites canaries — and the sensitivity check can fail."""

import hashlib
import json
import random

import pytest

from kvchaos import canary, cpucompat
from kvchaos.probe import max_new_tokens, prompt
from kvchaos.probe.build import COMMITTED, build
from kvchaos.probe.measure import Rate, measure_contamination, measure_echo, sensitive_enough

cpucompat.install()  # transformers imports torchvision, which needs the CPU patch here


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_committed_probe_is_small_and_rebuilds_bit_identical(tmp_path):
    meta = json.loads((COMMITTED / "kvchaos-model.json").read_text())
    assert _sha(COMMITTED / "model.safetensors") == meta["weights_sha256"]
    assert sum(f.stat().st_size for f in COMMITTED.iterdir()) < 5 * 2**20
    rebuilt = build(tmp_path / "probe")
    assert _sha(rebuilt / "model.safetensors") == meta["weights_sha256"]
    assert (rebuilt / "tokenizer.json").read_text() == (COMMITTED / "tokenizer.json").read_text()
    cfg = json.loads((COMMITTED / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["rope_theta"] == 1e36


def _hf_rates(model_dir, n=16, seed=0):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(model_dir)
    m = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    rng = random.Random(seed)
    echo, cont = Rate("echo"), Rate("contamination")
    for i in range(n):
        own = canary.mint(rng, rng.randint(1, 3))
        text = prompt(rng, [80, 400, 3686][i % 3], own)
        foreign = canary.mint(rng, 1, avoid_first=[c[1] for c in own])[0]
        f_text = prompt(rng, 80, [foreign])[:-1]
        for r, t, want in ((echo, text, own), (cont, f_text + " " + text, [foreign])):
            ids = tok(t, return_tensors="pt").input_ids
            out = m.generate(ids, max_new_tokens=max_new_tokens(len(own) + 1), do_sample=False)
            reply = tok.decode(out[0, ids.shape[1]:])
            r.add(all(canary.payload(c) in reply for c in want), reply)
    return echo, cont


def test_probe_recites_own_and_foreign_canaries_in_transformers():
    echo, cont = _hf_rates(COMMITTED)
    assert echo.rate == 1.0, echo.failures
    assert cont.rate == 1.0, cont.failures
    assert sensitive_enough(echo, cont) == (True, "sensitive")


def test_sensitivity_check_fails_for_the_random_tiny_model():
    from kvchaos.model import ensure_tiny_model

    echo, cont = _hf_rates(ensure_tiny_model(0), n=6)
    ok, why = sensitive_enough(echo, cont)
    assert not ok and "own-canary echo" in why and "foreign-canary sensitivity" in why


@pytest.mark.cluster
def test_probe_through_the_pd_cluster(cluster):
    url = cluster.endpoints.router
    echo = measure_echo(url, 40, [32, 64, 256, 700, 1200], seed=10)
    cont = measure_contamination(url, 40, [128, 512, 1200], seed=11)
    assert echo.rate >= 0.99, echo.failures
    # every miss must be the documented first-character collision, and the rate above target
    assert all(f["first_char_collision"] for f in cont.failures), cont.failures
    assert cont.rate >= 0.95, cont.failures


@pytest.mark.cluster
def test_sensitivity_check_fails_for_the_tiny_model_through_sglang(kvchaos_spec, kvchaos_run_dir, kvchaos_reaper):
    from kvchaos.cluster import SingleServer

    tiny = SingleServer(kvchaos_spec.__class__.load("cpu", model="tiny:0"), kvchaos_run_dir / "tiny",
                        reaper=kvchaos_reaper).start()
    try:
        echo = measure_echo(tiny.url, 16, [64, 400], seed=12)
        cont = measure_contamination(tiny.url, 16, [128, 400], seed=13)
    finally:
        tiny.stop()
    ok, why = sensitive_enough(echo, cont)
    assert not ok, why
    assert echo.rate < 0.5 and cont.rate < 0.5
