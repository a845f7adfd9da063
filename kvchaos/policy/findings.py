"""The findings registry: known engine findings as version-scoped data (``kvchaos/findings.toml``,
:data:`FINDINGS_FILE`), loaded and validated here, and matched against a verdict — for the engine
and version that ran, with the power to see a leak, and with every witness showing the entry's
mechanism (:mod:`kvchaos.policy.signatures`)."""

from __future__ import annotations

import fnmatch
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from kvchaos import FINDINGS_FILE

from kvchaos.oracles import FAIL, PASS, UNKNOWN, Verdict

from .context import Context
from .core import PolicyError, is_leak_checker
from .signatures import SIGNATURES, power_met


def engine_version(v) -> Version | None:
    """An engine's version as PEP 440 reads it (``0.5.23``, ``0.5.23+cu128``, ``0.5.24rc1``,
    ``0.5.23.dev4``); None for what is not one (``nightly``, a commit hash): no finding can be scoped to
    it, so none applies — a leak under such an engine stays NEW."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        return Version(str(v).strip())
    except InvalidVersion:
        return None


def version_spec(spec: str) -> SpecifierSet:
    """A findings entry's version spec: an exact version ("0.5.23") or PEP 440 specifiers joined by commas
    (">=0.5.20,<0.5.24")."""
    text = spec.strip()
    if text and text[0].isdigit():
        text = "==" + text
    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        raise PolicyError(f"bad version spec {spec!r} (a version, or PEP 440 specifiers such as >=0.5.20,<0.5.24)") \
            from None


def version_matches(version, specs: list[str]) -> bool:
    """Does the engine's ``version`` fall in one of ``specs`` (:func:`version_spec`)? A local label
    (``+cu128``: the same release built for a platform) matches its release; pre-releases compare as PEP
    440 orders them; a version that is not PEP 440 matches nothing."""
    v = engine_version(version)
    sets = [version_spec(s) for s in specs]  # a bad spec is named whatever the version
    return v is not None and any(ss.contains(v, prereleases=True) for ss in sets)


@dataclass
class Match:
    checker: str
    statuses: list
    signature: dict


@dataclass
class Finding:
    id: str
    title: str
    engine: str
    versions: list
    matches: list
    upstream: list = field(default_factory=list)
    tests: list = field(default_factory=list)
    explanation: str = ""
    conditions: str = ""       # what it was measured under: deployment shape, injected timing
    reproduction: str = ""     # how to see it without the agent, where that exists

    def applies_to(self, engine: str, version: str | None) -> bool:
        return engine == self.engine and version_matches(version, self.versions)

    def exercised_by(self, nodeid: str) -> bool:
        return any(fnmatch.fnmatch(nodeid, pat) for pat in self.tests)

    def match(self, v: Verdict, ctx: Context, require_power: bool = True) -> tuple[bool, str]:
        """Does verdict ``v`` (with its witnesses) match this finding on this engine? ``require_power``
        False asks only whether the mechanism matches (a search's triage: is this leak one we know?); the
        policy never passes it, so an underpowered run's leak is never accepted as KNOWN."""
        if not self.applies_to(ctx.engine, ctx.version):
            return False, f"not for {ctx.engine} {ctx.version} (listed: {self.versions})"
        why = "no entry for this checker/status"
        for m in self.matches:
            if m.checker != v.oracle or v.status not in m.statuses:
                continue
            if is_leak_checker(v.oracle) and require_power:
                ok, reason = power_met(v)
                if not ok:  # a leak seen by a run that could not have seen one reliably is never KNOWN
                    return False, f"KNOWN needs the power to see the leak: {reason}"
            fails = []
            for name, arg in m.signature.items():
                try:
                    ok, reason = SIGNATURES[name](v, ctx, arg)
                except PolicyError:
                    raise
                except Exception as e:  # noqa: BLE001 - a signature that cannot be checked does not match
                    ok, reason = False, f"cannot be checked: {type(e).__name__}: {e}"
                if not ok:
                    fails.append(f"{name}: {reason}")
            if not fails:
                return True, "signature matched"
            why = "; ".join(fails)
        return False, why

    def brief(self) -> dict:
        return {"id": self.id, "title": self.title, "upstream": self.upstream, "versions": self.versions,
                "conditions": self.conditions}


class Registry:
    def __init__(self, findings: list[Finding], source: str = "<list>"):
        ids = [f.id for f in findings]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise PolicyError(f"{source}: finding id(s) {dup} listed twice")
        self.findings, self.source = findings, source

    @classmethod
    def load(cls, path: str | Path = FINDINGS_FILE) -> "Registry":
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise PolicyError(f"findings registry {path}: {e}") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> "Registry":
        out = []
        allowed = {"id", "title", "engine", "versions", "match", "upstream", "tests", "explanation", "conditions",
                   "reproduction"}
        for i, f in enumerate(data.get("finding", [])):
            where = f"{source}: finding {f.get('id', i)!r}"
            unknown = sorted(set(f) - allowed)
            if unknown:
                raise PolicyError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
            for k in ("id", "title", "engine", "versions", "match"):
                if not f.get(k):
                    raise PolicyError(f"{where}: missing {k!r}")
            for spec in f["versions"]:
                version_spec(spec)  # a bad spec is named here, not at match time
            matches = []
            for m in f["match"]:
                bad = sorted(set(m.get("signature", {})) - set(SIGNATURES))
                if bad:
                    raise PolicyError(f"{where}: unknown signature predicate(s) {bad}; known: {sorted(SIGNATURES)}")
                if not m.get("signature"):
                    raise PolicyError(f"{where}: a match needs a witness signature")
                sts = m.get("statuses") or [FAIL]
                if set(sts) - {FAIL, UNKNOWN}:
                    raise PolicyError(f"{where}: statuses {sts}: only 'fail' and 'unknown' can be known")
                matches.append(Match(m["checker"], list(sts), dict(m["signature"])))
            out.append(Finding(f["id"], f["title"], f["engine"], list(f["versions"]), matches,
                               list(f.get("upstream", [])), list(f.get("tests", [])), f.get("explanation", ""),
                               f.get("conditions", ""), f.get("reproduction", "")))
        return cls(out, source)

    def get(self, fid: str) -> Finding:
        for f in self.findings:
            if f.id == fid:
                return f
        raise PolicyError(f"unknown finding id {fid!r}; known: {[f.id for f in self.findings]}")

    def classify(self, v: Verdict, ctx: Context, require_power: bool = True) -> tuple[Finding | None, str]:
        """The finding ``v`` matches (None if none), and why the closest one did not
        (``require_power``: :meth:`Finding.match`)."""
        if v.status == PASS:
            return None, ""
        why = []
        for f in self.findings:
            ok, reason = f.match(v, ctx, require_power)
            if ok:
                return f, reason
            if f.applies_to(ctx.engine, ctx.version) and any(m.checker == v.oracle and v.status in m.statuses
                                                             for m in f.matches):
                why.append(f"{f.id}: {reason}")
        return None, "; ".join(why)



def not_reproduced(registry: Registry, ran: list[dict]) -> list[dict]:
    """Findings for the engine versions that ran whose exercising tests ran without showing them.
    ``ran``: per experiment {"test": nodeid, "engine": name, "version": v, "known": [finding ids]}."""
    out = []
    for f in registry.findings:
        runs = [r for r in ran if r.get("test") and f.exercised_by(r["test"]) and f.applies_to(r.get("engine"), r.get("version"))]
        if not runs:
            continue
        tests = sorted({r["test"] for r in runs})
        seen = {r["test"] for r in runs if f.id in (r.get("known") or [])}
        for t in tests:
            if t not in seen:
                ver = next(r["version"] for r in runs if r["test"] == t)
                out.append({"id": f.id, "title": f.title, "test": t, "version": ver,
                            "message": f"{f.id} did not reproduce on {f.engine} {ver} — fixed? ({t})"})
    return out
