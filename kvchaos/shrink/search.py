"""The search: each step re-runs the smaller scenario as an experiment of its own."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

from kvchaos.experiment import Experiment
from kvchaos.workload import load_events

from .bugreport import REPRO, bug_report
from .scenario import ShrinkError, arm, as_on_a_fresh_cluster, fault_records, kept_ops, shorten, shortenable, subset
from .target import still_fails, target_of

CONFIRM = 3  # re-runs of the minimal scenario at the end
BACKOFF = 3  # earlier accepted steps confirmed in turn when the minimal one fails again in under half its re-runs


class Shrinker:
    def __init__(self, ex, out_dir: Path, budget_s: float = 1200.0, max_steps: int = 40, checker: str | None = None,
                 say=print):
        sched = getattr(ex, "schedule", None)
        if ex.drive_fn is not None or (ex._during is not None and sched is None):
            raise ShrinkError(f"experiment {ex.name}: a custom drive or during action cannot be re-run from data; "
                              "only experiments that send their plans (faults armed in the with block, or "
                              "nemesis ops through ex.nemesis) shrink")
        self.ex, self.out = ex, Path(out_dir)
        self.target = target_of(ex.verdicts, checker)
        if self.target is None:
            raise ShrinkError(f"experiment {ex.name}: " + (f"{checker} did not FAIL with a witness" if checker else
                              "no leak checker FAILed with a witness") + " — nothing to shrink")
        # an experiment that ran nemesis ops (ex.nemesis): those ops, and its plans' gates, are its faults as
        # data (each step re-runs the ops kept, kept_ops); else the faults its log shows armed
        self.ops_mode = sched is not None
        self.faults = list(sched.ops) if self.ops_mode else fault_records(ex)
        self.gates = dict(sched.gates) if self.ops_mode else {}
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
        n = len(self.attempts) + 1
        prompts = self.best["prompts"] if prompts is None else prompts
        # every attempt as if on a fresh cluster: caches flushed, free lists back in their start order,
        # canaries of its own (what earlier attempts left in the pages is then an earlier experiment's),
        # so a step that drops the traffic a leak's pages needed fails instead of leaking the last
        # attempt's KV (the GLM-5.3 minimal shrunk on a reused pool reproduced 1 run in 3 fresh)
        plans = subset(self.ex.plans, set(rids), prompts)
        path = self.out / f"attempt-{n:03d}.events.jsonl"
        t = time.monotonic()
        rec = {"n": n, "why": why, "requests": len(plans), "faults": len(faults), "concurrency": concurrency,
               "prompt_chars": sum(len(p.prompt) for p in plans)}
        try:
            plans = as_on_a_fresh_cluster(self.ex.cluster, plans, random.Random(f"{self.ex.seed}/shrink/{n}"))
            sub = Experiment(f"{self.ex.name}-shrink-{n}", plans, self.ex.checks, cluster=self.ex.cluster,
                             faults=self.ex.faults, run_dir=self.ex.run_dir, test_id=self.ex.test_id, seed=self.ex.seed,
                             concurrency=concurrency, timeout_s=self.ex.unpaced_timeout_s, settle_s=self.ex.settle_s,
                             model_name=self.ex.model_name, policy=self.ex.policy, via=self.ex.via, path=path,
                             run_seed=self.ex.run_seed, record=False)
            with sub:
                if self.ops_mode:
                    sub.nemesis(*kept_ops(self.faults, set(faults), {p.rid for p in plans}, self.gates))
                else:
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
            f = self.faults[i]
            what = f.kind if self.ops_mode else f.get("kind") or f.get("type")
            self.attempt(self.best["rids"], rest, self.best["concurrency"], f"drop fault {what}")

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
        ops = {}
        if self.ops_mode:  # the nemesis ops the minimal step ran (what repro.py hands to ex.nemesis)
            kept, gates = kept_ops(self.faults, set(self.best["faults"]), {p.rid for p in plans}, self.gates)
            faults, ops = [o.to_dict() for o in kept], {"nemesis": True, "gates": gates}
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
               "scenario": {"plans": [p.to_dict() for p in plans], "faults": faults, **ops,
                            "concurrency": self.best["concurrency"], "via": self.ex.via,
                            "timeout_s": self.ex.unpaced_timeout_s, "pace": self.ex.pace, "checkers": [repr(c) for c in self.ex.checks.checkers]},
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


def shrink_after(ex, budget_s: float = 1200.0, max_steps: int = 40, checker: str | None = None) -> dict:
    """Shrink ``ex`` once it is judged (what the plugin's ``--kvchaos-shrink`` calls once the test body
    has run): ``<run dir>/shrink/<name>/``; a scenario that cannot shrink says why there."""
    out = ex.run_dir / "shrink" / ex.name
    try:
        return Shrinker(ex, out, budget_s=budget_s, max_steps=max_steps, checker=checker).run()
    except ShrinkError as e:  # said in minimal.json (kvchaos shrink prints it); the test goes on
        return refused(ex, out, str(e))
