"""``kvchaos judge LOG [LOG ...]``: judge event logs on disk with the default checkers.

Each log is read by the one loader (``kvchaos.history``) and judged on its own by the policy
(``kvchaos.policy``): the default checkers (``--checkers`` names the ones to run, each then required to
PASS) plus every leak checker that always runs (isolation, integrity, kv_lifecycle, page_ownership,
retraction: no flag switches one off; one not named is "not claimed" — its FAIL is red, its UNKNOWN
shown). Every FAIL is red; isolation must PASS unless not claimed. The canaries minted in any of the
given logs are known to all of them: another log's canary in a reply is a leak with origin
``session (<file>)``; a recital of a canary minted in none is of unknown origin. Known findings apply only when the log's ``experiment``
header names the engine version. A log that cannot be read, a line that is not a JSON object
(``file:line``), a key given twice in one record, a record without ``ev``, a second plan / send /
body / end or final status for one rid, a plan without a rid or with a malformed canary, a log
without plans, or one of a history schema newer than this kvchaos reads is bad input (exit 2, nothing
judged). A log that cannot show it is whole — a cut LAST line (a crash mid-write), a request sent and never
ended, a missing or contradicted closing record (``experiment_end``, schema 3) — is incomplete: it is
judged, but nothing in it can PASS (a lost record could have been the leak). A file holding several
experiments (one appended to another) is judged as several logs, each under its own header.

Exit status (:data:`kvchaos.policy.EXIT`): 0 every log PASS (or KNOWN accepted), 1 any log FAIL,
3 otherwise (UNKNOWN, or KNOWN not accepted), 2 bad input.
"""

from __future__ import annotations

import json
import os
import sys

from kvchaos import canary, oracles
from kvchaos.commands._common import UsageError, subparser, usage_errors
from kvchaos.history import History, HistoryError, read_records, render_witness, split_experiments
from kvchaos.policy import KNOWN, Context, Policy, PolicyError, exit_code, merge

NAME = "judge"
HELP = "judge event logs on disk with the default checkers and print the verdicts"
DESCRIPTION = " ".join("""
Judge each event log (JSONL) on its own with the default checkers; the canaries minted in any of the
logs are known to all of them. Exit 0 every log PASS (or KNOWN accepted), 1 any FAIL, 3 UNKNOWN or
KNOWN not accepted, 2 bad input. A log that cannot show it is whole (a cut last line, no closing record) is
judged, but nothing in it can PASS; a file holding several experiments is judged under each one's header.
""".split())
JUDGE_WITNESSES = 3  # witnesses printed per verdict (--json has them all)


def add_parser(sub, cfg: dict):
    sp = subparser(sub, NAME, help=HELP, description=DESCRIPTION)
    sp.add_argument("logs", nargs="+", metavar="LOG", help="event log(s), e.g. reports/<run-id>/events/<test>.jsonl")
    sp.add_argument("--bound-s", type=float, default=60.0, metavar="SECONDS",
                    help="liveness bound: a request must end within it (default 60)")
    sp.add_argument("--accept-known", action="store_true",
                    help="accept known findings (kvchaos/findings.toml) for the engine version the log's header names")
    sp.add_argument("--checkers", metavar="A,B",
                    help="judge only these checkers, each required to PASS (default: all of isolation, sensitivity, "
                         "http_semantics, liveness, kv_lifecycle; each held to not-FAIL, isolation also to "
                         "not-UNKNOWN, other UNKNOWNs informational)")
    sp.add_argument("--json", action="store_true", help="print per log the verdicts and the policy status as JSON")
    return sp


def _load_histories(path: str) -> list[tuple[str, History, list[str]]]:
    """One event log, read and validated by the one loader (kvchaos.history): bad input is exit 2. A file
    holding several experiments (one appended to another) is several histories, each under its own header
    (named ``PATH [experiment K of N: ID]``)."""
    with usage_errors("judge", HistoryError):
        parts = split_experiments(read_records(path))
        out = []
        for k, part in enumerate(parts, 1):
            head = next((e for e in part if e.get("ev") == "experiment"), {})
            name = path if len(parts) == 1 else f"{path} [experiment {k} of {len(parts)}: {head.get('id')}]"
            out.append((name, History(part, source=name)))
    results = []
    for name, h in out:
        if not h.plans:
            raise UsageError(f"judge: {name}: no requests to judge (no \"plan\" events among {len(h.records)} records)")
        warnings = list(h.warnings)
        if not h.header:
            warnings.append(f"{name}: no \"experiment\" header: engine version unknown, known findings not applied")
        results.append((name, h, warnings))
    return results


# kvchaos.oracles and kvchaos.policy are imported inside the functions below, not at the top: the
# checkers take ~80 ms to import, and ``kvchaos --help`` imports every command module
def _judge_checkers(names: list[str] | None, bound_s: float):
    """The default checkers (or those named), and the names they claim."""
    checks = oracles.default_checkers(bound_s=bound_s).checkers
    if names is None:
        return oracles.compose(*checks)
    by = {c.name: c for c in checks}
    return oracles.compose(*(by[n] for n in names))


def _parse_checkers(spec: str | None) -> list[str] | None:
    if spec is None:
        return None
    allowed = [c.name for c in oracles.default_checkers().checkers]
    names = [x.strip() for x in spec.split(",") if x.strip()]
    if not names:
        raise UsageError(f"judge: --checkers: name at least one of {', '.join(allowed)}")
    bad = [n for n in names if n not in allowed]
    if bad:
        raise UsageError(f"judge: --checkers: unknown checker(s) {', '.join(bad)}; allowed: {', '.join(allowed)}")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"judge: --checkers: {', '.join(dup)} given twice")
    return names


def _read_logs(paths: list[str]) -> tuple[dict, dict]:
    """Every log read and checked before any is judged: {path: History}, {path: [warning]}."""
    seen = {}
    for path in paths:
        key = os.path.realpath(path)
        if key in seen:
            raise UsageError(f"judge: {path}: given twice (as {seen[key]})")
        seen[key] = path
    logs, warnings = {}, {}
    for path in paths:
        for name, h, w in _load_histories(path):
            logs[name], warnings[name] = h, w
    return logs, warnings


def _judge(args, names: list[str] | None, logs: dict, warnings: dict) -> list[tuple]:
    """(path, History, Judgement) per log, each judged on its own by the policy."""
    # every canary minted in any given log: a canary of another log in a reply is a leak naming that log
    reg = canary.Registry()
    for path, h in logs.items():
        reg.add_plans(h.plans, path)
        reg.add_page_evidence(h.records)  # what its requests left in decode's pages, for the logs after it
    with usage_errors("judge", PolicyError):
        policy = Policy(accept_known=bool(args.accept_known))
    results = []
    for path, h in logs.items():
        for w in warnings[path]:
            print(f"kvchaos: warning: {w}", file=sys.stderr)
        for w in h.problems:
            print(f"kvchaos: history incomplete: {w}", file=sys.stderr)
        # what was asked for, plus every leak checker that always runs (no flag switches one off)
        checks, claimed = policy.checks(_judge_checkers(names, args.bound_s))
        required = {n: oracles.PASS for n in names} if names else {}
        engine_errors = h.by_ev.get("engine_error", [])
        verdicts = policy.gate(checks.check(h, reg), h)
        try:
            j = policy.judge(verdicts, Context.of(h, engine_errors, reg), required=required, claimed=claimed,
                             every_fail_counts=True)
        except PolicyError as e:
            raise UsageError(f"judge: {path}: {e}")
        results.append((path, h, j))
    return results


def _print_json(args, names, results, warnings, status: str, rc: int) -> None:
    out = {"logs": [], "exit_code": rc, "status": status, "accept_known": bool(args.accept_known),
           "checkers": [c.name for c in _judge_checkers(names, args.bound_s).checkers], "bound_s": args.bound_s}
    for path, h, j in results:
        out["logs"].append({"file": path, "engine": j.ctx.engine, "version": j.ctx.version, "schema": h.schema,
                            "requests": len(h.plans), "warnings": warnings[path], **j.to_dict()})
    print(json.dumps(out, indent=2, default=str))


def _print_log(path, h, j) -> None:
    eng = f"{j.ctx.engine} {j.ctx.version}" if j.ctx.version else f"{j.ctx.engine}, version unknown"
    print(f"== {path} ({len(h.plans)} requests; {eng})")
    for p in j.problems:
        print(f"  history incomplete: {p}")
    for i in j.items:
        v = i.verdict
        print(f"  {v}")
        if i.finding:
            print(f"    KNOWN {i.finding.id}: {i.finding.title} "
                  f"({'accepted' if i.accepted else 'not accepted: --accept-known'})")
        elif i.note:
            print(f"    ({i.note})")
        elif i.outcome == "ok" and v.status != oracles.PASS:
            print("    (informational: does not decide this log's status)")
        if i.not_known:
            print(f"    not a known finding: {i.not_known[:300]}")
        for w in v.witnesses[:JUDGE_WITNESSES]:
            print(f"    witness: {render_witness(w)}")
        if len(v.witnesses) > JUDGE_WITNESSES:
            print(f"    ... and {len(v.witnesses) - JUDGE_WITNESSES} more (--json has every witness)")
    st = j.status.upper()
    if j.status == KNOWN:
        st += " " + ", ".join(f"{i.finding.id} ({'accepted' if i.accepted else 'not accepted: --accept-known'})"
                              for i in j.known)
    print(f"  status: {st}")


def run(args) -> int:
    if not args.bound_s > 0:
        raise UsageError(f"judge: --bound-s must be > 0, got {args.bound_s}")
    names = _parse_checkers(args.checkers)
    logs, warnings = _read_logs(args.logs)
    results = _judge(args, names, logs, warnings)
    status = merge(j.status for _p, _h, j in results)
    rc = exit_code(status)
    if args.json:
        _print_json(args, names, results, warnings, status, rc)
        return rc
    for path, h, j in results:
        _print_log(path, h, j)
    counts = {}
    for _p, _h, j in results:
        counts[j.status] = counts.get(j.status, 0) + 1
    print(f"kvchaos judge: {len(results)} log{'s' if len(results) != 1 else ''}: "
          + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())) + f" (exit {rc})")
    return rc
