"""The failure a shrink keeps: which checker failed, with which kinds of witness."""

from __future__ import annotations

from kvchaos.policy import is_leak_checker


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
