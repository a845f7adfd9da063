"""Leak sensitivity of the probe model, measured through the real SGLang prefill/decode cluster.

Prints:
  * own-canary echo rate over >= 500 prompts, 32 tokens .. 90 % of the context (target >= 99 %);
  * foreign-canary sensitivity over concatenated contexts (target >= 95 %);
  * stale-KV sensitivity: another request's KV, computed at its own positions, spliced into the
    victim's cache at other positions (transformers; the in-engine planted-leak fault does the
    same inside SGLang);
  * determinism across runs and batch compositions;
  * the same echo/sensitivity for the random tiny model, as the blind baseline.

Usage: python bench/probe_model.py [--echo 500] [--contamination 300] [--splice 200] [--quick]
The cluster runs with pool 8192 tokens so 90 %-of-context prompts are admitted.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvchaos import canary  # noqa: E402
from faults import open_network_proxy  # noqa: E402 - the fault layer's network proxy
from kvchaos.cluster import Cluster, ClusterSpec, SingleServer  # noqa: E402
from kvchaos.probe import MIN_HEAD, MIN_TAIL, max_new_tokens, prompt  # noqa: E402
from kvchaos.probe.measure import Rate, measure_contamination, measure_determinism, measure_echo  # noqa: E402


def splice_sensitivity(model_dir: str, n: int, context: int, seed: int = 3) -> Rate:
    """Victim cache = own prefix KV + foreign KV (computed at positions 0..f) + own suffix."""
    import torch
    from transformers import AutoTokenizer, DynamicCache, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(model_dir)
    m = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    rng = random.Random(seed)
    rate = Rate("stale-KV sensitivity (foreign KV at new positions)")

    def kv(ids, past=None, start=0):
        pos = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
        with torch.no_grad():
            return m(ids, past_key_values=past, position_ids=pos, use_cache=True).past_key_values

    for i in range(n):
        total = rng.choice([256, 1024, context * 9 // 10])
        f_len = max(total // 4, canary.LENGTH + MIN_HEAD + MIN_TAIL + 4)
        foreign = canary.mint(rng, 1)[0]
        own = canary.mint(rng, rng.randint(1, 2))
        rate.collisions += any(o[1] == foreign[1] for o in own)
        f_ids = tok(prompt(rng, f_len, [foreign])[:-1], return_tensors="pt").input_ids
        own_text = prompt(rng, max(total - f_len, 2 * (canary.LENGTH + 2) + MIN_HEAD + MIN_TAIL + 1), own)
        cut = rng.randrange(MIN_HEAD, len(own_text) - MIN_TAIL - 1)
        while any(s <= cut < s + canary.LENGTH for s, _ in canary.find(own_text)):
            cut -= 1
        a_ids = tok(own_text[:cut], return_tensors="pt").input_ids
        b_ids = tok(own_text[cut:], return_tensors="pt").input_ids
        f_cache = kv(f_ids)  # written at positions 0..len(f)-1, as for the other tenant
        cache = kv(a_ids)
        pre = DynamicCache()
        for layer in range(len(cache.layers)):
            k = torch.cat([cache.layers[layer].keys, f_cache.layers[layer].keys], dim=2)
            v = torch.cat([cache.layers[layer].values, f_cache.layers[layer].values], dim=2)
            pre.update(k, v, layer)
        start = a_ids.shape[1] + f_ids.shape[1]
        with torch.no_grad():
            out = m(b_ids, past_key_values=pre, position_ids=torch.arange(start, start + b_ids.shape[1]).unsqueeze(0),
                    use_cache=True)
        past, nxt, gen = out.past_key_values, out.logits[0, -1].argmax().item(), []
        pos = start + b_ids.shape[1]
        for _ in range(max_new_tokens(len(own) + 1)):
            gen.append(nxt)
            if nxt == tok.eos_token_id:
                break
            with torch.no_grad():
                o = m(torch.tensor([[nxt]]), past_key_values=past, position_ids=torch.tensor([[pos]]), use_cache=True)
            past, nxt, pos = o.past_key_values, o.logits[0, -1].argmax().item(), pos + 1
        text = tok.decode(gen)
        rate.add(canary.payload(foreign) in text, {"total": total, "foreign": foreign, "reply": text[:100]})
    return rate


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--echo", type=int, default=500)
    ap.add_argument("--contamination", type=int, default=300)
    ap.add_argument("--splice", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="50/50/30 trials")
    args = ap.parse_args()
    if args.quick:
        args.echo, args.contamination, args.splice = 50, 50, 30
    spec = ClusterSpec.load("cpu", model="probe", pool_tokens=8192)
    ctx = spec.context_length
    lengths = [32, 48, 64, 128, 256, 512, 1024, 2048, 3072, ctx * 9 // 10]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        c = Cluster(spec, d, proxy_factory=open_network_proxy).start()
        try:
            url = c.endpoints.router
            for fn, arg in ((measure_echo, (url, args.echo, lengths)),
                            (measure_contamination, (url, args.contamination, lengths[3:])),
                            (measure_determinism, (url, 24))):
                t0 = time.monotonic()
                r = fn(*arg)
                rows.append((r, time.monotonic() - t0))
        finally:
            c.stop()
        t0 = time.monotonic()
        rows.append((splice_sensitivity(spec.resolve_model(), args.splice, ctx), time.monotonic() - t0))
        tiny = SingleServer(ClusterSpec.load("cpu", model="tiny:0", pool_tokens=8192), d).start()
        try:
            base = [measure_echo(tiny.url, 50, lengths[:8]), measure_contamination(tiny.url, 50, lengths[3:8])]
        finally:
            tiny.stop()
    print(f"probe model through SGLang PD (prefill+decode+router, mooncake_tcp, pool 8192, context {ctx}):")
    for r, dt in rows:
        print(f"  {r}   ({dt:.0f} s)" + (f"   first failures: {r.failures[:2]}" if r.failures else ""))
    print("random tiny model (single server), the blind baseline:")
    for r in base:
        print(f"  {r}")
    echo, cont = rows[0][0], rows[1][0]

    def ratio(a, b):
        return f"{a.rate / b.rate:.1f}x" if b.hits else f"inf (tiny {b.hits}/{b.trials})"

    print(f"ratio probe/tiny: echo {ratio(echo, base[0])}, foreign-canary sensitivity {ratio(cont, base[1])}")


if __name__ == "__main__":
    main()
