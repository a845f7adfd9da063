"""Shrink a failing experiment to a minimal scenario that still fails the same way.

Runs inside the test's own session, right after the experiment it shrinks was judged (pytest
``--kvchaos-shrink NAME``, what ``kvchaos shrink RUN_DIR NAME`` starts): the cluster is up, so each
attempt costs one experiment, not a cluster start. A *scenario* is data — the plans, the faults as
armed (injector, role, kind, target, params with their seed, count), the concurrency and the path
(router / pd) — and an attempt re-runs it as an experiment of its own (same checkers, policy,
timeouts; its log under ``shrink/<name>/``), arming the recorded faults on entry.

The failure kept is the original's: the first leak checker that FAILed (isolation before
kv_lifecycle, cache_isolation, differential, http_semantics) with a witness of the same kind (a foreign canary
served with the same HTTP status; a late write after release; ...). Steps, each kept only when the
attempt still fails that way:

1. plans — delta debugging (ddmin: drop chunks, then complements, halving the chunk size);
2. faults — drop each one;
3. concurrency — halve down to 1;
4. tenants — drop every plan of a tenant that is not the witness's victim or owner;
5. prompts — halve the filler between a prompt's canaries (all prompts at once while that still
   fails twice in a row, then one prompt at a time), keeping its canaries, the probe's head and
   tail and its trigger, and any prefix it shares by design with a plan still in the scenario
   (:func:`shorten`).

The minimal scenario is then re-run ``CONFIRM`` times; when under half of those fail (it failed by
chance: a stale page that happened to hold other data), the step kept before it is confirmed
instead, up to ``BACKOFF`` steps back, and the one that failed most often is written.

Bounded by ``budget_s`` and ``max_steps``; an attempt that cannot run (a fault that cannot be armed)
counts as not failing. Writes ``minimal.json`` (the scenario, sizes before / after, every attempt),
the minimal attempt's log, ``repro.py`` (a script that needs only kvchaos and the engine: it starts
the recorded cluster, arms the faults, sends the plans and prints the verdicts) and ``BUG.md`` (an
upstream-style report: engine version and flags, steps, expected vs observed, witness).
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from pathlib import Path

from kvchaos import canary
from kvchaos.probe import MIN_HEAD, MIN_TAIL, TRIGGER

CONFIRM = 3  # re-runs of the minimal scenario at the end
BACKOFF = 3  # earlier accepted steps confirmed in turn when the minimal one fails again in under half its re-runs


class ShrinkError(RuntimeError):
    pass


# --------------------------------------------------------------------------- scenario as data
def fault_records(ex) -> list[dict]:
    """The faults this experiment armed, as data (what an attempt re-arms), from its own log's
    ``fault``/``armed`` records (the injectors have forgotten healed faults by now)."""
    out, other = [], []
    for e in ex.events:
        if e.get("ev") == "fault" and e.get("injector") == "process":  # kills and freezes: not data to re-arm
            other.append(f"{e.get('kind')} of {e.get('role')}")
            continue
        if e.get("ev") != "fault" or e.get("action") != "armed":
            continue
        if e.get("injector") == "agent":
            out.append({"injector": "agent", "role": e["role"], "kind": e["kind"], "target": dict(e.get("target") or {}),
                        "params": dict(e.get("params") or {}), "count": e.get("count")})
        elif e.get("injector") == "proxy":
            out.append({"injector": "proxy", "proxy": e["proxy"], "type": e["kind"], "stream": e["stream"],
                        "attributes": dict(e.get("attributes") or {}), "toxicity": e["toxicity"]})
        else:
            other.append(e.get("fault") or e.get("kind"))
    if other:
        raise ShrinkError(f"experiment {ex.name}: faults {sorted(set(other))} are not agent or network faults "
                          "(process kills and freezes are actions, not data to re-arm): not shrinkable")
    return out


def arm(kit, rec: dict):
    if rec["injector"] == "agent":
        return kit.agent.arm(rec["role"], rec["kind"], target=rec["target"], params=rec["params"], count=rec.get("count"))
    if rec["injector"] == "proxy":
        return kit.net.toxic(rec["proxy"], rec["type"], stream=rec["stream"], toxicity=rec["toxicity"], **rec["attributes"])
    raise ShrinkError(f"cannot arm fault record {rec!r}")


def subset(plans, keep_rids: set, prompts: dict | None = None) -> list:
    """The plans whose rid is kept, in order; a kept plan waiting for a dropped one waits for nothing;
    ``prompts`` (rid -> text) replaces the prompts of a shrink's shortened plans."""
    out = []
    for p in plans:
        if p.rid in keep_rids:
            q = copy.copy(p)
            if q.after is not None and q.after not in keep_rids:
                q.after = None
            if prompts and p.rid in prompts:
                q.prompt = prompts[p.rid]
                q.n_tokens = len(q.prompt)
            out.append(q)
    return out


def shortenable(p) -> bool:
    """A probe prompt whose length is not what the plan is about: not oversized, not a timing arm, not
    one a later turn resends (conversation) or another tenant sends verbatim (identical)."""
    return (not p.oversized and p.timing is None and p.expect_echo and p.sharing not in ("conversation", "identical")
            and p.prompt.endswith(TRIGGER))


def shorten(text: str, keep: int = 0) -> str | None:
    """``text`` with each run of filler after its first ``keep`` characters cut to half (the first
    half kept), never below the probe's head before the first canary or its tail before the
    trigger; every canary, the space on either side of it, and the trigger stay. ``None`` when
    nothing is left to cut. The canaries come out the same, in the same order."""
    if not text.endswith(TRIGGER):
        return None
    body_end = len(text) - len(TRIGGER)
    found = canary.find(text)
    for o, c in found:  # a shared prefix that ends inside a canary (a diverging pair) keeps that canary whole
        if o < keep < o + len(c):
            keep = o + len(c)
    guard = [(0, keep)] + [(max(0, o - 1), min(body_end, o + len(c) + 1)) for o, c in found] + [(body_end, len(text))]
    guard.sort()
    merged = [list(guard[0])]
    for a, b in guard[1:]:
        if a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    first_canary = found[0][0] if found else body_end
    out = [text[merged[0][0]:merged[0][1]]]
    for (_, a), (b, e) in zip(merged, merged[1:]):
        gap = text[a:b]
        floor = 1
        if b == body_end:
            floor = MIN_TAIL
        if a < first_canary:
            floor = max(floor, MIN_HEAD - a)
        out.append(gap[:max(floor, len(gap) // 2)])  # a gap at or under its floor stays whole
        out.append(text[b:e])
    new = "".join(out)
    if len(new) >= len(text):
        return None
    assert [c for _, c in canary.find(new)] == [c for _, c in found], "shorten lost or split a canary"
    return new


# --------------------------------------------------------------------------- the failure kept
def witness_kind(oracle: str, w: dict) -> tuple:
    if oracle in ("isolation", "cache_isolation"):
        # whose data: a request of this very attempt, or data an earlier run left in the pool — a
        # scenario that leaks only what earlier attempts wrote is not a repro of its own
        origin = "this log" if w.get("origin", "this log") == "this log" else "elsewhere"
        return (oracle, "foreign" if w.get("owner_tenant") else w.get("kind") or "unknown", origin, w.get("status"))
    if oracle == "kv_lifecycle":
        return (oracle, w.get("kind") or w.get("problem") or w.get("release_outcome"))
    return (oracle, w.get("kind") or w.get("problem") or w.get("status"))


def target_of(verdicts, checker: str | None = None) -> tuple[str, set] | None:
    """The failure to keep: ``checker``'s FAIL, or the first leak checker (the policy's definition,
    in the experiment's order) that FAILed with witnesses, else an HTTP-semantics FAIL."""
    from kvchaos.policy import is_leak_checker

    by = {v.oracle: v for v in verdicts}
    order = [v.oracle for v in verdicts if is_leak_checker(v.oracle)] + ["http_semantics"]
    for o in ((checker,) if checker else order):
        v = by.get(o)
        if v is not None and v.status == "fail" and v.witnesses:
            kinds = {witness_kind(o, w) for w in v.witnesses}
            # a leak of the scenario's own requests is what it reproduces; another run's data left in
            # the pool (also seen in a session's later experiments) counts only when there is nothing else
            own = {k for k in kinds if "this log" in k}
            return o, own or kinds
    return None


def still_fails(verdicts, target: tuple[str, set]) -> bool:
    oracle, kinds = target
    v = {x.oracle: x for x in verdicts}.get(oracle)
    return v is not None and v.status == "fail" and bool({witness_kind(oracle, w) for w in v.witnesses} & kinds)


# --------------------------------------------------------------------------- the search
class Shrinker:
    def __init__(self, ex, out_dir: Path, budget_s: float = 1200.0, max_steps: int = 40, checker: str | None = None,
                 say=print):
        from kvchaos.experiment import Experiment  # noqa: F401 - the attempts are experiments

        if ex.drive_fn is not None or ex._during is not None:
            raise ShrinkError(f"experiment {ex.name}: a custom drive or during action cannot be re-run from data; "
                              "only experiments that send their plans (with faults armed in the with block) shrink")
        self.ex, self.out = ex, Path(out_dir)
        self.target = target_of(ex.verdicts, checker)
        if self.target is None:
            raise ShrinkError(f"experiment {ex.name}: " + (f"{checker} did not FAIL with a witness" if checker else
                              "no leak checker FAILed with a witness") + " — nothing to shrink")
        self.faults = fault_records(ex)
        self.budget_s, self.max_steps, self.say = budget_s, max_steps, say
        self.t0 = time.monotonic()
        self.attempts: list[dict] = []
        self.accepted: list[dict] = []  # every step kept, in order (the last is the smallest)
        self.backed_off = 0  # steps back from the smallest to the one written (confirm)
        self.best = {"rids": [p.rid for p in ex.plans], "faults": list(range(len(self.faults))),
                     "concurrency": ex.concurrency, "prompts": {}, "log": str(ex.path)}
        if self.out.exists():
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)

    def exhausted(self) -> bool:
        return len(self.attempts) >= self.max_steps or time.monotonic() - self.t0 >= self.budget_s

    def attempt(self, rids: list, faults: list, concurrency: int, why: str, prompts: dict | None = None,
                confirm: bool = False) -> bool:
        from kvchaos.experiment import Experiment

        n = len(self.attempts) + 1
        prompts = self.best["prompts"] if prompts is None else prompts
        plans = subset(self.ex.plans, set(rids), prompts)
        path = self.out / f"attempt-{n:03d}.events.jsonl"
        t = time.monotonic()
        rec = {"n": n, "why": why, "requests": len(plans), "faults": len(faults), "concurrency": concurrency,
               "prompt_chars": sum(len(p.prompt) for p in plans)}
        try:
            sub = Experiment(f"{self.ex.name}-shrink-{n}", plans, self.ex.checks, cluster=self.ex.cluster,
                             faults=self.ex.faults, run_dir=self.ex.run_dir, test_id=self.ex.test_id, seed=self.ex.seed,
                             concurrency=concurrency, timeout_s=self.ex.timeout_s, settle_s=self.ex.settle_s,
                             model_name=self.ex.model_name, policy=self.ex.policy, via=self.ex.via, path=path,
                             run_seed=self.ex.run_seed, record=False)
            with sub:
                for i in faults:
                    arm(self.ex.faults, self.faults[i])
            ok = still_fails(sub.verdicts, self.target)
            rec["verdicts"] = {v.oracle: v.status for v in sub.verdicts}
        except Exception as e:  # noqa: BLE001 - an attempt that cannot run does not fail the same way
            ok = False
            rec["error"] = repr(e)[:500]
        rec.update(fails=ok, wall_s=round(time.monotonic() - t, 1), log=str(path))
        self.attempts.append(rec)
        self.say(f"shrink {n}: {why} — {len(plans)} requests, {len(faults)} faults, concurrency {concurrency}, "
                 f"{rec['prompt_chars']} prompt chars: {'still fails' if ok else 'passes / differs'} ({rec['wall_s']} s)")
        if ok and not confirm:
            self.best = {"rids": list(rids), "faults": list(faults), "concurrency": concurrency,
                         "prompts": dict(prompts), "log": str(path)}
            self.accepted.append(self.best)
        return ok

    def ddmin(self) -> None:
        rids = list(self.best["rids"])
        n = 2
        while len(rids) >= 2 and not self.exhausted():
            size = max(1, len(rids) // n)
            chunks = [rids[i:i + size] for i in range(0, len(rids), size)]
            reduced = False
            for c in chunks:  # a chunk alone
                if self.exhausted():
                    return
                if len(c) < len(rids) and self.attempt(c, self.best["faults"], self.best["concurrency"],
                                                       f"keep {len(c)} of {len(rids)} plans"):
                    rids, n, reduced = c, 2, True
                    break
            if not reduced and len(chunks) > 2:  # of two chunks each is the other's complement: tried
                for c in chunks:  # its complement
                    if self.exhausted():
                        return
                    rest = [r for r in rids if r not in set(c)]
                    if rest and self.attempt(rest, self.best["faults"], self.best["concurrency"],
                                             f"drop {len(c)} of {len(rids)} plans"):
                        rids, n, reduced = rest, max(n - 1, 2), True
                        break
            if not reduced:
                if size == 1:
                    return
                n = min(len(rids), 2 * n)

    def drop_faults(self) -> None:
        for i in list(self.best["faults"]):
            if self.exhausted():
                return
            rest = [j for j in self.best["faults"] if j != i]
            self.attempt(self.best["rids"], rest, self.best["concurrency"],
                         f"drop fault {self.faults[i].get('kind') or self.faults[i].get('type')}")

    def lower_concurrency(self) -> None:
        # more in flight than there are requests is the same run: no attempt needed to say so
        self.best["concurrency"] = min(self.best["concurrency"], max(1, len(self.best["rids"])))
        c = self.best["concurrency"]
        while c > 1 and not self.exhausted():
            c = max(1, c // 2)
            if not self.attempt(self.best["rids"], self.best["faults"], c, f"concurrency {c}"):
                return

    def drop_tenants(self) -> None:
        plans = {p.rid: p for p in self.ex.plans}
        keep = set()
        for w in self._last_witnesses():  # the victim's and the owner's tenants stay
            keep |= {w.get("victim_tenant"), w.get("owner_tenant"), w.get("tenant")}
        tenants = sorted({plans[r].tenant for r in self.best["rids"]} - keep)
        for t in tenants:
            if self.exhausted():
                return
            rest = [r for r in self.best["rids"] if plans[r].tenant != t]
            if rest:
                self.attempt(rest, self.best["faults"], self.best["concurrency"], f"drop tenant {t}")

    def shorten_prompts(self) -> None:
        """All shortenable prompts halved together while that still fails; then each prompt on its own
        (another prompt's length may be what the failure needs)."""
        plans = {p.rid: p for p in self.ex.plans}
        rids = [r for r in self.best["rids"] if shortenable(plans[r])]
        # a prefix shared by design stays only while a plan it is shared with is still in the scenario
        groups = [plans[r].group for r in self.best["rids"]]
        keep = {r: plans[r].shared_chars if plans[r].group is not None and groups.count(plans[r].group) > 1 else 0
                for r in rids}

        def cut(which, prompts):
            out = dict(prompts)
            for r in which:
                s = shorten(out.get(r, plans[r].prompt), keep[r])
                if s is not None:
                    out[r] = s
            return out

        def chars(prompts, which):
            return sum(len(prompts.get(r, plans[r].prompt)) for r in which)

        while len(rids) > 1 and not self.exhausted():
            trial = cut(rids, self.best["prompts"])
            if trial == self.best["prompts"]:
                return
            if not self._cut_holds(trial, f"shorten {len(rids)} prompts, {chars(self.best['prompts'], rids)} -> "
                                          f"{chars(trial, rids)} chars"):
                break
        for r in rids:
            while not self.exhausted():
                trial = cut([r], self.best["prompts"])
                if trial == self.best["prompts"]:
                    break
                if not self._cut_holds(trial, f"shorten prompt of {r}, {chars(self.best['prompts'], [r])} -> "
                                              f"{chars(trial, [r])} chars"):
                    break

    def _cut_holds(self, prompts: dict, why: str) -> bool:
        """A prompt cut is kept only when it fails twice in a row: re-sent unchanged, a prompt's own KV
        from the first run is what a stale page holds the second time, so a cut whose failure needed
        other data there (measured: a short transfer at 84 prompt characters) does not hold."""
        b = self.best
        return (self.attempt(b["rids"], b["faults"], b["concurrency"], why, prompts=prompts, confirm=True)
                and self.attempt(b["rids"], b["faults"], b["concurrency"], why + " (again)", prompts=prompts))

    def _last_witnesses(self) -> list:
        from kvchaos.workload import load_events

        try:
            recs = load_events(self.best["log"])
        except Exception:  # noqa: BLE001
            return []
        oracle = self.target[0]
        for v in self.ex.checks.check(recs):
            if v.oracle == oracle:
                return v.witnesses
        return []

    def run(self) -> dict:
        self.say(f"shrink {self.ex.name}: {len(self.ex.plans)} requests, {len(self.faults)} faults, concurrency "
                 f"{self.ex.concurrency}; keeping {self.target[0]} FAIL with witness kinds {sorted(map(str, self.target[1]))}")
        # the original scenario once more as data: the search starts only from a failure that re-runs
        if not self.attempt(self.best["rids"], self.best["faults"], self.best["concurrency"], "the original, re-run"):
            return self.write(reproduced=False)
        self.ddmin()
        self.drop_faults()
        self.lower_concurrency()
        self.drop_tenants()
        if len(self.best["rids"]) > 1:
            self.ddmin()
        self.shorten_prompts()
        hits = self.confirm()
        return self.write(reproduced=True, confirmed=hits)

    def confirm(self) -> int:
        """The minimal scenario again, CONFIRM times: a repro that failed once by chance says so. A step
        that failed by chance (a stale page that happened to hold other data) is no repro: under half
        its re-runs failing, the step kept before it is confirmed instead (up to BACKOFF steps back).
        Leaves ``self.best`` at the step most re-runs failed (the smallest of those); returns how many."""
        tried, steps = [], list(reversed(self.accepted[-(BACKOFF + 1):]))
        for back, best in enumerate(steps):
            hits = sum(self.attempt(best["rids"], best["faults"], best["concurrency"],
                                    f"confirm {i + 1}/{CONFIRM}" + (f" ({back} step(s) back)" if back else ""),
                                    prompts=best["prompts"], confirm=True) for i in range(CONFIRM))
            tried.append((hits, -back, best))
            if 2 * hits > CONFIRM or back + 1 == len(steps):
                break
            self.say(f"shrink {self.ex.name}: the minimal scenario failed again {hits}/{CONFIRM} only — confirming "
                     "the step kept before it")
        hits, back, self.best = max(tried, key=lambda t: (t[0], t[1]))  # most re-failures; then the smallest
        self.backed_off = -back
        return hits

    # ------------------------------------------------------------------ output
    def write(self, reproduced: bool, confirmed: int | None = None) -> dict:
        plans = subset(self.ex.plans, set(self.best["rids"]), self.best["prompts"])
        faults = [self.faults[i] for i in self.best["faults"]]
        cluster = self.ex.cluster.describe() if hasattr(self.ex.cluster, "describe") else {}
        head = next((e for e in self.ex.events if e.get("ev") == "experiment"), {})
        res = {"experiment": self.ex.name, "test": self.ex.test_id, "run_seed": self.ex.run_seed, "seed": self.ex.seed,
               "engine": head.get("engine"), "layout": head.get("layout"), "cluster": cluster,
               "target": {"oracle": self.target[0], "witness_kinds": sorted(map(list, self.target[1]))},
               "original": {"requests": len(self.ex.plans), "faults": len(self.faults), "concurrency": self.ex.concurrency,
                            "tenants": len({p.tenant for p in self.ex.plans}),
                            "prompt_chars": sum(len(p.prompt) for p in self.ex.plans)},
               "minimal": {"requests": len(plans), "faults": len(faults), "concurrency": self.best["concurrency"],
                           "tenants": len({p.tenant for p in plans}), "prompt_chars": sum(len(p.prompt) for p in plans)},
               "reproduced": reproduced, "confirmed": confirmed, "confirm_runs": CONFIRM if reproduced else 0,
               "backed_off": self.backed_off,
               "steps": len(self.attempts),
               "wall_s": round(time.monotonic() - self.t0, 1),
               "scenario": {"plans": [p.to_dict() for p in plans], "faults": faults,
                            "concurrency": self.best["concurrency"], "via": self.ex.via,
                            "timeout_s": self.ex.timeout_s, "checkers": [repr(c) for c in self.ex.checks.checkers]},
               "attempts": self.attempts}
        if reproduced and Path(self.best["log"]).exists():
            shutil.copy(self.best["log"], self.out / "minimal.events.jsonl")
            res["witnesses"] = self._last_witnesses()[:3]
        (self.out / "minimal.json").write_text(json.dumps(res, indent=2, default=str))
        (self.out / "repro.py").write_text(REPRO)
        (self.out / "BUG.md").write_text(bug_report(res))
        self.say(f"shrink {self.ex.name}: {res['original']['requests']} -> {res['minimal']['requests']} requests, "
                 f"{res['original']['faults']} -> {res['minimal']['faults']} faults, concurrency "
                 f"{res['original']['concurrency']} -> {res['minimal']['concurrency']}, prompt chars "
                 f"{res['original']['prompt_chars']} -> {res['minimal']['prompt_chars']} in {res['steps']} attempts "
                 f"({res['wall_s']} s), minimal failed again {confirmed}/{CONFIRM}: {self.out}")
        return res


def refused(ex, out_dir: Path, why: str) -> dict:
    """``minimal.json`` of a shrink that could not start (nothing failed, a during action, ...)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"experiment": ex.name, "test": ex.test_id, "run_seed": ex.run_seed, "reproduced": False, "refused": why,
           "verdicts": {v.oracle: v.status for v in ex.verdicts}, "steps": 0,
           "original": {"requests": len(ex.plans), "concurrency": ex.concurrency}}
    (out_dir / "minimal.json").write_text(json.dumps(res, indent=2, default=str))
    print(f"shrink {ex.name}: not shrunk — {why}")
    return res


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


def reproduce(minimal_dir, times: int = 1) -> int:
    """What a shrink's ``repro.py`` runs: start the cluster recorded in ``minimal_dir/minimal.json``
    (and a single reference server for a differential target), arm the recorded faults, send the
    minimal plans ``times`` times, print each run's verdicts; returns how many failed the same way."""
    import tempfile

    import httpx

    from faults import FaultKit, install_network_proxy
    from kvchaos import oracles
    from kvchaos.cluster import Cluster, ClusterSpec, SingleServer
    from kvchaos.cluster.reaper import Reaper
    from kvchaos.experiment import Experiment
    from kvchaos.workload import EventLog, RequestPlan

    res = json.loads((Path(minimal_dir) / "minimal.json").read_text())
    sc = res["scenario"]
    spec = ClusterSpec.from_dict(res["cluster"]["spec"])
    plans = [RequestPlan(**{k: v for k, v in p.items() if k != "prompt_chars"}) for p in sc["plans"]]
    checks = [oracles.Isolation(), oracles.Sensitivity(), oracles.HttpSemantics(), oracles.KVLifecycle(),
              oracles.CacheIsolation(), oracles.Liveness(bound_s=sc["timeout_s"])]
    target = (res["target"]["oracle"], {tuple(k) for k in res["target"]["witness_kinds"]})
    work = Path(tempfile.mkdtemp(prefix="kvchaos-repro-"))
    install_network_proxy()  # network faults: the cluster's embedded proxy
    reaper = Reaper("kvc-repro")
    c = Cluster(spec, work, reaper=reaper).start()
    ref = None
    hits = 0
    try:
        if target[0] == "differential":  # the same prompts served alone by a clean single server
            ref = SingleServer(spec, work / "reference", reaper=reaper).start()
            body = lambda p: {"text": p.prompt, "sampling_params": {"max_new_tokens": p.max_new_tokens,  # noqa: E731
                                                                     "temperature": 0}}
            checks.append(oracles.Differential(lambda _ev: {
                p.rid: httpx.post(ref.endpoints.router + "/generate", json=body(p), timeout=120).json() for p in plans}))
        for i in range(1, times + 1):
            with EventLog(work / f"faults-{i}.jsonl") as flog:
                kit = FaultKit(c, flog)
                ex = Experiment(f"repro-{i}", plans, checks, cluster=c, faults=kit, run_dir=work,
                                concurrency=sc["concurrency"], timeout_s=sc["timeout_s"], via=sc["via"])
                with ex:
                    for f in sc["faults"]:
                        arm(kit, f)
            hit = still_fails(ex.verdicts, target)
            hits += hit
            print(f"repro {i}: " + ", ".join(f"{v.oracle} {v.status}" for v in ex.verdicts)
                  + (" — REPRODUCED" if hit else ""))
    finally:
        if ref is not None:
            ref.stop()
        c.stop()
        reaper.close()
    print(f"reproduced {hits}/{times} (logs: {work})")
    return hits


REPRO = '''"""Repro written by ``kvchaos shrink``: starts the cluster recorded in minimal.json beside this file,
arms the recorded faults, sends the minimal plans and prints the verdicts (kvchaos.shrink.reproduce).
Needs kvchaos and the engine: ``python repro.py [--times N]`` (3 by default: on a fresh cluster a leak of
stale pages may need earlier traffic in the pool); exit 0 when any run failed the same way."""

import argparse
import sys
from pathlib import Path

from kvchaos.shrink import reproduce

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--times", type=int, default=3)
    sys.exit(0 if reproduce(Path(__file__).resolve().parent, ap.parse_args().times) else 1)
'''
