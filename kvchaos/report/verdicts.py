"""The run-level ``verdicts.json`` (:func:`run_verdicts`): the run's status and why (:func:`run_status`:
the policy's merge over what each experiment means for the run), every leak witness, every known
finding, tests split chaos / harness, and per scenario what the report shows of it."""

from __future__ import annotations

from kvchaos import policy

from .model import FAILED_TESTS, RunModel


# --------------------------------------------------------------------------- findings
def leaks(m: RunModel) -> list[dict]:
    """Every leak witness of every experiment that was not planted: every leak checker's FAIL (isolation,
    integrity, page_ownership, kv_lifecycle, differential, ...), whatever their test required and whether
    or not a known finding matched."""
    out = []
    for i, s in enumerate(m.scenarios):
        if s.planted:
            continue
        for v in s.verdicts:
            if not policy.leak_verdict(v):
                continue
            k = v.get("known") or {}
            for n, w in enumerate(v.get("witnesses") or []):
                out.append({"scenario": i, "experiment": s.name, "experiment_id": s.id, "test": s.test,
                            "oracle": v["oracle"], "outcome": v.get("outcome") or "red",
                            "known": k.get("id"), "accepted": bool(k.get("accepted")), "witness_index": n,
                            "witness": w if isinstance(w, dict) else {"value": w}})
    return out


def known_findings(m: RunModel) -> list[dict]:
    """Each verdict a known finding matched ({id, title, engine, version, test, experiment, oracle,
    status, accepted, upstream, witnesses, summary, scenario}); findings.json fills in what the
    verdict files lack."""
    out, seen = [], set()
    for i, s in enumerate(m.scenarios):
        for v in s.verdicts:
            k = v.get("known")
            if v.get("outcome") != "known" or not isinstance(k, dict):
                continue
            seen.add((k.get("id"), s.test, s.name, v.get("oracle")))
            out.append({"id": k.get("id"), "title": k.get("title"), "engine": s.engine, "version": s.version,
                        "test": s.test, "experiment": s.name, "oracle": v.get("oracle"), "status": v.get("status"),
                        "accepted": bool(k.get("accepted")), "upstream": list(k.get("upstream") or []),
                        "conditions": k.get("conditions"),
                        "versions": k.get("versions"), "witnesses": v.get("witnesses") or [],
                        "summary": v.get("summary"), "scenario": i})
    for k in (m.findings or {}).get("known") or []:
        if (k.get("id"), k.get("test"), k.get("experiment"), k.get("oracle")) not in seen:
            out.append({**k, "scenario": next((i for i, s in enumerate(m.scenarios)
                                                if s.name == k.get("experiment") and s.test == k.get("test")), None)})
    return out


# --------------------------------------------------------------------------- the run's status
def run_status(m: RunModel) -> dict:
    """The run's status and why.

    ``chaos``: from the experiments — fail > unknown > known > pass over what each means for the run
    (``Scenario.run_status``: the policy's status; planted experiments count only when they missed
    what was planted, as unknown; a leak checker's FAIL is never hidden); "none" when no experiment
    that was not planted ran (a run of harness tests only has no chaos verdict).
    ``overall``: ``chaos``, but "fail" when any test failed or errored, or when ``--kvchaos-strict``
    was set and a listed finding did not reproduce."""
    real = [s for s in m.scenarios if not s.planted and not s.rerun]
    planted = [s for s in m.scenarios if s.planted]
    counted = real + [s for s in planted if not s.caught]
    chaos = policy.merge(s.run_status for s in counted) if real else (
        "unknown" if any(not s.caught for s in planted) else "none")
    red, known = [], []
    for s in sorted(counted, key=lambda s: -policy.RANK.get(s.run_status, 2)):
        if s.run_status == "pass":
            continue
        vs = s.red_verdicts()
        what = "; ".join(f"{v.get('oracle')} {str(v.get('status')).upper()}"
                         + (f" (required {str(v['required']).upper()})" if v.get("required") and s.planted else "")
                         for v in vs[:3]) or s.run_status.upper()
        if s.planted:
            red.append(f"{s.name}: planted bug MISSED — {what}")
        elif s.run_status == "known":
            known.append(f"{s.name}: KNOWN {', '.join(s.known) or '?'}")
        else:
            red.append(f"{s.name}: {what}" + (f" — {_first_summary(vs)}" if _first_summary(vs) else ""))
    failed = [t for t in m.tests if t.outcome in FAILED_TESTS]
    nr = (m.findings or {}).get("not_reproduced") or []
    strict = bool((m.findings or {}).get("strict"))
    overall, other = chaos, []
    if failed:
        overall = "fail"
        other.append(f"{len(failed)} test(s) failed: " + ", ".join(t.nodeid for t in failed[:5])
                     + (" …" if len(failed) > 5 else ""))
    if strict and nr:
        overall = "fail"
        other.append(f"--kvchaos-strict: {len(nr)} listed finding(s) did not reproduce")
    n_real, n_planted = len(real), len(planted)
    exps = f"{n_real} experiment(s)" + (f" + {n_planted} planted" if n_planted else "")
    if chaos == "none":
        head = ("no chaos verdict: " + (f"only planted experiments ran ({n_planted}, caught as required)"
                                         if n_planted else "no experiment ran")
                + (f" ({len(m.tests)} test(s), none judged an engine)" if m.tests and not n_planted else ""))
    elif chaos == "pass":
        head = f"{exps}: every verdict as required, no leak" + ("; planted bugs caught" if n_planted else "")
    elif chaos == "known":
        ids = sorted({k for s in real for k in s.known}
                     | {(v.get("known") or {}).get("id") for s in real for v in s.verdicts if v.get("known")})
        head = f"{exps}: nothing red but accepted known engine finding(s) {', '.join(ids)} — never PASS"
    else:
        head = f"{exps}: " + "; ".join(red[:3]) + (f" (+{len(red) - 3} more)" if len(red) > 3 else "")
        if known:
            head += f"; also {len(known)} known finding(s)"
    if other:
        head += (" — but " if chaos in ("pass", "known", "none") else "; ") + "; ".join(other)
    reasons = red + known + other
    return {"overall": overall, "chaos": chaos, "reason": head, "reasons": reasons}


def _first_summary(vs: list[dict]) -> str:
    for v in vs:
        if v.get("summary"):
            s = str(v["summary"])
            return s if len(s) <= 200 else s[:200] + "…"
    return ""


def overall(m: RunModel) -> str:
    return run_status(m)["overall"]


def test_counts(tests: list) -> dict:
    counts: dict = {}
    for t in tests:
        counts[t.outcome] = counts.get(t.outcome, 0) + 1
    return counts


def run_verdicts(m: RunModel) -> dict:
    """The run-level ``verdicts.json``: the run's status and why, leaks, known findings, findings
    that did not reproduce, tests (all, and split chaos / harness), per-oracle counts (experiments
    that were not planted), and per scenario its status, verdicts (with witnesses), faults, requests."""
    by_oracle: dict = {}
    for s in m.scenarios:
        if s.planted:
            continue
        for v in s.verdicts:
            by_oracle.setdefault(v.get("oracle"), {"pass": 0, "fail": 0, "unknown": 0})
            by_oracle[v["oracle"]][v.get("status", "unknown")] = by_oracle[v["oracle"]].get(v.get("status"), 0) + 1
    j = run_status(m)
    return {
        "run_id": m.run_id,
        "seed": ((m.extras or {}).get("run.json") or {}).get("seed"),
        "overall": j["overall"],
        "chaos": j["chaos"],
        "reason": j["reason"],
        "reasons": j["reasons"],
        "leaks": [{k: v for k, v in x.items()} for x in leaks(m)],
        "known": known_findings(m),
        "not_reproduced": (m.findings or {}).get("not_reproduced") or [],
        "strict": bool((m.findings or {}).get("strict")),
        "tests": {"counts": test_counts(m.tests), "chaos": test_counts(m.chaos_tests),
                  "harness": test_counts(m.harness_tests), "cases": [t.__dict__ for t in m.tests]},
        "by_oracle": by_oracle,
        "scenarios": [{"name": s.name, "id": s.id, "source": s.source, "events": s.events_file,
                       "status": s.status, "run_status": s.run_status, "verdict_status": s.verdict_status,
                       "planted": s.planted, "caught": s.caught, "known": s.known, "accepted": s.accepted,
                       "engine": s.engine, "version": s.version, "test": s.test, "test_outcome": s.test_outcome,
                       "context": s.context, "note": s.note, "verdicts": s.verdicts,
                       "faults": [w.__dict__ for w in s.faults],
                       "requests": {rid: r.to_dict() for rid, r in s.requests.items()}} for s in m.scenarios],
    }
