"""What the property tests share (``tests/test_properties*.py``): the adapter to the suites' API,
the Hypothesis settings and example budgets, ``kvchaos judge`` in-process, the suites' policy over a
scenario's logs, and :func:`every_variant` (a class's property run, then the simplest example of
every variant no drawn example passed)."""

from __future__ import annotations

import functools
import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from hypothesis import HealthCheck, Phase, find, settings

from kvchaos import canary
from kvchaos.cli import main as kvchaos_main

from tests import strategies as S


# ============================================================================== ADAPTER
# The only code in this file that knows the suites' API: what an Experiment does with its records —
# the checkers it was given plus the leak checkers that always run, the history indexed once, the
# canary registry handed to the checkers, the policy's gate and judgement (isolation and liveness
# required; known findings accepted, as CI's CPU profile does: a KNOWN accepted counts as green).
from kvchaos.history import History, read_records  # noqa: E402
from kvchaos.oracles import Isolation, Liveness, Sensitivity  # noqa: E402
from kvchaos.policy import Context, Policy  # noqa: E402


def load_history(path) -> list[dict]:
    """How a suite reads an event log back from disk: the one loader."""
    return read_records(path)


def suite_judgement(events: list[dict], registry, corrupted=None) -> tuple[bool, str]:
    """(green, detail) of one experiment's events; ``registry``: every canary minted in the session.
    ``corrupted``: requests whose replies are known not to be what their prompts must give (a leak-free
    twin's stand-in bytes) — an integrity FAIL naming only those is the one red tolerated."""
    p = Policy(accept_known=True)
    checks, claimed = p.checks([Isolation(), Sensitivity(), Liveness(bound_s=60)])
    try:
        h = History(events)
    except ValueError as e:  # a history the loader refuses (a record twice, ...) is never green
        return False, f"history refused: {e}"
    j = p.judge(p.gate(checks.check(h, registry), h), Context.of(h, (), registry),
                required={"isolation": "pass", "liveness": "pass"}, claimed=claimed)
    red = [i for i in j.red if not (corrupted is not None and integrity_names_only(i.to_dict(), corrupted))]
    return not red, f"{j.status}: {j.message()}"


def integrity_names_only(item: dict, rids) -> bool:
    """A serialized verdict item that is an integrity FAIL whose every witness is one of ``rids``."""
    return (item.get("oracle") == "integrity" and item.get("status") == "fail"
            and all(w.get("rid") in set(rids) for w in item.get("witnesses") or ()))
# ============================================================================== end of adapter


# no Phase.explain: its line tracing makes every shrink step of a failing example ~50x slower
PROPERTY = dict(derandomize=True, deadline=None, database=None, print_blob=False,
                phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                       HealthCheck.large_base_example])
LEAK_EXAMPLES = 12       # drawn per class (22 classes), plus the simplest example of every variant not drawn
MIRROR_EXAMPLES = 60
POWER_EXAMPLES = 8
SHAPE_EXAMPLES = 6       # drawn per class in the coverage test, plus every variant not drawn


def judge(paths, *flags) -> tuple[int, str]:
    """``kvchaos judge PATHS FLAGS`` in-process: (exit code, stdout + stderr)."""
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        try:
            rc = kvchaos_main(["judge", *map(str, paths), *flags])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return rc, out.getvalue()


def judge_doc(paths, *flags) -> tuple[int, dict | None, str]:
    """``kvchaos judge --json PATHS FLAGS`` in-process: (exit code, the JSON document or None, output)."""
    import json

    rc, out = judge(paths, "--json", *flags)
    try:
        return rc, json.loads(out[out.index("{"):]), out
    except ValueError:
        return rc, None, out


def suite(logs: dict, sc: S.Scenario, corrupted=None) -> tuple[bool, str]:
    """The suites' policy over every judged log (the session: the judged logs' canaries): green only
    if every one is green."""
    reg = canary.Registry()
    histories = []
    for path in logs["judged"]:
        try:
            evs = load_history(path)
        except ValueError as e:  # a loader that rejects malformed input: not green (only allowed for those)
            if not sc.malformed:
                raise
            return False, f"load_history rejected {path}: {e}"
        histories.append((path, evs))
        reg.add_plans({e["rid"]: e for e in evs if e.get("ev") == "plan" and e.get("rid")}, str(path))
    details = []
    for path, evs in histories:
        green, detail = suite_judgement(evs, reg, corrupted)
        details.append(f"{Path(path).name}: {detail}")
        if not green:
            return False, "\n".join(details)
    return True, "\n".join(details)


def _tail(out: str, n: int = 2400) -> str:
    """The head of a judge's output (the first log's verdicts) and its last line."""
    return out if len(out) <= n else out[:n - 300] + "\n...\n" + out[-300:]


def _where(sc: S.Scenario, logs: dict) -> str:
    m = logs["meta"]
    return f"foreign canary {m.get('foreign')} (owner: {m.get('owner')}) in the reply of {m.get('victims')}"


@functools.cache
def canonical(cls: str, variant: str) -> S.Scenario:
    """The simplest scenario of ``variant`` (run when the drawn examples missed it)."""
    return find(S.leak_scenarios(cls, variant), lambda _sc: True,
                settings=settings(database=None, derandomize=True, phases=[Phase.generate], max_examples=1))


def _kind(e: BaseException) -> str:
    """Which assertion failed (its message up to the exit code / verdict)."""
    return str(e).split(" on a log", 1)[0].split(" exit ", 1)[0] if isinstance(e, AssertionError) else type(e).__name__


def every_variant(cls: str, prop, check) -> None:
    """Run the Hypothesis property ``prop`` (which calls ``check`` and returns the variants it passed),
    then ``check`` on the canonical example of every variant of ``cls`` that no drawn example passed
    (so each variant is checked through every assertion even when the drawn ones failed early); raise
    every failure together."""
    errors, passed, kinds = [], set(), set()
    try:
        prop(passed)
    except Exception as e:  # noqa: BLE001 - Hypothesis' falsifying example(s), reported with the rest
        errors.append(e)
        kinds |= {_kind(x) for x in (e.exceptions if isinstance(e, BaseExceptionGroup) else [e])}
    for v in sorted(S.VARIANTS[cls] - passed):
        sc = canonical(cls, v)
        try:
            check(sc)
            passed.add(v)
        except AssertionError as e:
            if _kind(e) not in kinds:  # one example per failing assertion, as Hypothesis reports them
                kinds.add(_kind(e))
                errors.append(AssertionError(f"{e}\nFalsifying example (the simplest of variant {v!r}): {sc!r}"))
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ExceptionGroup(f"{cls}: {len(errors)} failures", errors)
    assert passed == S.VARIANTS[cls], f"{cls}: checked variants {sorted(passed)}, want {sorted(S.VARIANTS[cls])}"
