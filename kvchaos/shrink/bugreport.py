"""BUG.md (an upstream-style report) and repro.py of a shrunk scenario."""

from __future__ import annotations

import json

EXPECTED = {
    "isolation": "Every reply holds only its own request's data (no other tenant's canary in any HTTP 200 reply).",
    "cache_isolation": "No request reuses a cached prefix computed for another cache_salt.",
    "kv_lifecycle": "No KV write lands in decode pages after decode released them.",
    "differential": "Each reply is token-identical to the same prompt served alone by a single (non-disaggregated) "
                    "server of the same model and settings, greedy.",
    "http_semantics": "A prompt the engine cannot serve is rejected with a 4xx and an error, never answered HTTP 200.",
}


def bug_report(res: dict) -> str:
    eng = res.get("engine") or {}
    spec = (res.get("layout") or {}).get("spec") or {}
    w = (res.get("witnesses") or [None])[0]
    m, o = res["minimal"], res["original"]
    faults = "\n".join(f"   - {json.dumps(f)}" for f in res["scenario"]["faults"]) or "   - (none)"
    return f"""# {res['target']['oracle']} FAIL in {eng.get('name', 'sglang')} {eng.get('version')}: {res['experiment']}

Found by kvchaos (`{res['test']}`, run seed {res['run_seed']}) and shrunk in {res['steps']} attempts:

| scenario | requests | tenants | faults | concurrency | prompt characters |
|---|---|---|---|---|---|
| original | {o['requests']} | {o['tenants']} | {o['faults']} | {o['concurrency']} | {o.get('prompt_chars', '-')} |
| **minimal** | **{m['requests']}** | **{m['tenants']}** | **{m['faults']}** | **{m['concurrency']}** | **{m.get('prompt_chars', '-')}** |

The minimal scenario failed again in {res.get('confirmed')} of {res.get('confirm_runs')} re-runs on the same cluster{
    f" ({res['backed_off']} shrink step(s) back from the smallest, which failed again less often)"
    if res.get('backed_off') else ''}.
{'' if res['reproduced'] else chr(10) + '**The original scenario did not fail again when re-run from data: nothing was shrunk.**' + chr(10)}
## Environment
- engine: {eng.get('name')} {eng.get('version')} (per role: {json.dumps(eng.get('roles'))})
- deployment: prefill/decode disaggregation, KV transfer `{spec.get('transfer_backend')}`, layout
  `{(res.get('layout') or {}).get('kv_layout')}`, page size {spec.get('page_size')}, dtype {spec.get('dtype')},
  pool {spec.get('pool_tokens')} tokens, context {spec.get('context_length')}, device {spec.get('device')}
- server flags: see `cluster` in `minimal.json`

## Steps
1. Start the deployment above (`python repro.py` does it on this machine and runs the rest).
2. Arm these faults (the kvchaos in-engine agent / network proxy):
{faults}
3. Send the {m['requests']} requests of `minimal.json` (`scenario.plans`: prompt, endpoint, max tokens) through
   the {res['scenario']['via']} with {m['concurrency']} in flight.

## Expected
{EXPECTED.get(res['target']['oracle'], "the checker passes")}

## Observed
`{res['target']['oracle']}` FAIL, witness kinds {res['target']['witness_kinds']}.
{('First witness:' + chr(10) + '```json' + chr(10) + json.dumps(w, indent=2, default=str) + chr(10) + '```') if w else ''}
"""


REPRO = '''"""Repro written by ``kvchaos shrink``: starts the cluster recorded in minimal.json beside this file,
arms the recorded faults, sends the minimal plans and prints the verdicts (kvchaos.shrink.reproduce).
Needs kvchaos and the engine: ``python repro.py [--times N]``, each run on a fresh cluster (the shrink ran
every attempt as on one: caches flushed, canaries of its own, so the minimal keeps the traffic its
pages need); exit 0 when every run failed the same way."""

import argparse
import sys
from pathlib import Path

from kvchaos.shrink import reproduce

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--times", type=int, default=1)
    n = ap.parse_args().times
    sys.exit(0 if reproduce(Path(__file__).resolve().parent, n) == n else 1)
'''
