"""Smoke: the real prefill/decode cluster serves exactly what a single server serves, and the
decode server really generated from KV it received over the transfer engine.

How we know decode used the transferred KV (three independent pieces of evidence):

1. *Counters.* Per request, decode's ``decode_transferred`` stage count rises by one (plus one per
   router health probe, as below) and decode computes exactly ``max_new_tokens - 1`` tokens in
   decode mode (the first token comes from prefill) and no prompt tokens at all, while prefill
   computes every prompt token (plus one per router health probe: SGLang's ``/health`` generates a
   token) and its ``kv_transfer_total_mb`` grows by exactly the KV bytes of those prompts' pages (±1 %;
   KV moves in whole pages, and an MLA layer's page holds one latent plus the shared rope key per
   token).
2. *Context dependence.* The probe model recites the canaries of its context, so for each prompt
   the single server's output changes when only the early part of the prompt (where the canaries
   are) is changed, the last 16 characters kept. Decode never saw the early part of the prompt
   except through the transferred KV pages — and its replies contain those canaries.
3. *Equality.* Yet the PD output is token-identical to the single server's for every prompt.
   Decode attending over anything but the right pages would have to reproduce an output that
   (by 2) depends on exactly those pages.
"""

from __future__ import annotations

import random
import time

import pytest

from kvchaos import canary
from kvchaos.cluster.metrics import Metrics
from kvchaos.probe import prompt
from kvchaos.workload.snapshots import wait_quiet

N_PROMPTS = 12
HEALTH_INTERVAL_S = 60.0  # sglang-router 0.3.2 RouterArgs.health_check_interval_secs
MAX_NEW = 40  # up to 3 canaries (12 tokens each) + closing "[" + EOS
pytestmark = [pytest.mark.cluster, pytest.mark.every_layout]  # CI runs it on every layout of the profile


def _prompts(seed: int) -> list[tuple[str, list[str]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(N_PROMPTS):
        cs = canary.mint(rng, rng.randint(1, 3))
        out.append((prompt(rng, rng.randrange(80, 700), cs), cs))
    return out


def _health_interval_s(cluster) -> float:
    """The router's health-probe interval: its flag if the profile sets one, else sglang-router's default."""
    args = list(getattr(cluster.spec, "router_args", None) or [])
    for i, a in enumerate(args):
        if a == "--health-check-interval-secs" and i + 1 < len(args):
            return float(args[i + 1])
        if a.startswith("--health-check-interval-secs="):
            return float(a.split("=", 1)[1])
    return HEALTH_INTERVAL_S


def _gen(server, text):
    r = server.generate(text=text, max_new_tokens=MAX_NEW)
    assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:400]}"
    body = r.json()
    return body["output_ids"], body["meta_info"]["prompt_tokens"], body["meta_info"]["completion_tokens"], body["text"]


def test_pd_output_token_identical_to_single_server(seeds, cluster, reference_server):
    prompts = [p for p, _ in _prompts(seeds(1234))]
    pd = [_gen(cluster, p)[0] for p in prompts]
    ref = [_gen(reference_server, p)[0] for p in prompts]
    mismatches = [(i, a, b) for i, (a, b) in enumerate(zip(pd, ref)) if a != b]
    assert not mismatches, f"PD output differs from single server for prompts {[m[0] for m in mismatches]}: {mismatches[:2]}"
    # The comparison is only meaningful if outputs are prompt-specific.
    assert len({tuple(x) for x in ref}) == len(prompts), "model output does not depend on the prompt"


def test_decode_generated_from_transferred_kv(seeds, cluster, reference_server):
    items = _prompts(seeds(99))
    prompts = [p for p, _ in items]
    # an earlier test's stragglers (a request the router still retries) must not land in the counters' window
    wait_quiet(cluster, timeout_s=90, stable_s=5)
    t0 = time.monotonic()  # the counters' window: from the first snapshot to the last
    pre_p, pre_d = _settled(cluster.endpoints.prefill), _settled(cluster.endpoints.decode)
    pd, prompt_tokens, completion, texts = zip(*[_gen(cluster, p) for p in prompts])
    post_p, post_d = _settled(cluster.endpoints.prefill), _settled(cluster.endpoints.decode)
    window_s = time.monotonic() - t0
    n, total_prompt = len(prompts), sum(prompt_tokens)
    # the replies recite the canaries that were only in the (transferred) prompt KV
    for (_, cs), text in zip(items, texts):
        assert all(canary.payload(c) in text for c in cs), (cs, text)

    # 1. counters. SGLang's /health runs a one-token request through the server it is sent to, and the
    # router sends one to each worker every HEALTH_INTERVAL_S. Measured (3 probes per worker): prefill
    # +3 prefill tokens, no KV sent; decode +3 ``decode_transferred``, no decode or prefill tokens. CI at
    # 5f878f9 counted one prefill token more than the prompts hold, `-n 2` one decode_transferred more
    # than the requests. Allow exactly the probes that fit in the window; a request transferred twice or
    # a prompt prefilled twice is still outside it (hundreds of tokens, or more than the probes).
    probes = int(window_s // _health_interval_s(cluster)) + 1
    transferred = post_d.delta(pre_d, "sglang:per_stage_req_latency_seconds_count", stage="decode_transferred")
    assert n <= transferred <= n + probes, (
        f"decode counted {transferred:.0f} transferred requests for {n}; at most {probes} router health probe(s) "
        f"fit in the {window_s:.0f} s window")
    assert post_d.delta(pre_d, "sglang:realtime_tokens_total", mode="decode") == sum(completion) - n
    assert post_d.delta(pre_d, "sglang:prefill_effective_tokens_total") == 0, "decode ran a prefill itself"
    extra = post_p.delta(pre_p, "sglang:prefill_effective_tokens_total") - total_prompt  # one per probe
    assert 0 <= extra <= probes, (
        f"prefill computed {total_prompt + extra:.0f} tokens for {total_prompt} prompt tokens; at most "
        f"{probes} router health probe(s) of one token each fit in the {window_s:.0f} s window")
    assert post_p.delta(pre_p, "sglang:kv_transfer_total_mb_count") >= n
    info = cluster.server_info("prefill")
    kv_bytes_per_token = _kv_bytes_per_token(info)
    sent_bytes = post_p.delta(pre_p, "sglang:kv_transfer_total_mb_sum") * 2**20  # SGLang's "MB" is MiB
    ps = cluster.spec.page_size  # KV moves in whole pages: a prompt's last page goes whole, partly filled
    slots = sum(-(-t // ps) * ps for t in prompt_tokens)
    expected = slots * kv_bytes_per_token
    assert abs(sent_bytes - expected) <= 0.01 * expected, (
        f"prefill sent {sent_bytes:.0f} KV bytes for {total_prompt} prompt tokens in {slots // ps} pages of "
        f"{ps}; expected {expected}")

    # 2. context dependence on the single server: same last 16 chars, different beginning
    changed = 0
    rng = random.Random(7)
    for p, out in zip(prompts, pd):
        head = prompt(rng, len(p), canary.mint(rng, 2))[:-16]
        alt = _gen(reference_server, head + p[-16:])[0]
        changed += alt != list(out)
    assert changed >= n - 1, f"only {changed}/{n} outputs depend on the early prompt; evidence too weak"

    # 3. equality with the single server
    ref = [_gen(reference_server, p)[0] for p in prompts]
    assert [list(x) for x in pd] == ref


def _settled(url: str, timeout_s: float = 15.0) -> Metrics:
    """The server's counters once they stop moving: a request's stage counters can be recorded just
    after its reply was sent (seen under load: an earlier test's last request counted inside this
    test's window). Two reads 0.5 s apart with equal stage and token counters, bounded."""
    import time

    keys = ("sglang:per_stage_req_latency_seconds_count", "sglang:realtime_tokens_total",
            "sglang:prefill_effective_tokens_total", "sglang:kv_transfer_total_mb_count")
    last = Metrics.fetch(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = Metrics.fetch(url)
        if all(now.value(k) == last.value(k) for k in keys):
            return now
        last = now
    raise AssertionError(f"{url}/metrics still moving after {timeout_s} s with no request of this test in flight")


def _kv_bytes_per_token(info: dict) -> int:
    import json
    from pathlib import Path

    cfg = json.loads((Path(info["model_path"]) / "config.json").read_text())
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[info.get("dtype") if info.get("dtype") != "auto" else "bfloat16"]
    if cfg.get("kv_lora_rank"):  # MLA: one compressed latent plus the shared rope key per token and layer
        return cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * dtype_bytes
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * heads * head_dim * dtype_bytes
