"""Which releases leak: the GLM-5.3 incident run *unmodified* on a list of SGLang releases.

The incident's deployment shape — prefill's KV pool (``PREFILL_POOL`` tokens, input limit a few
tokens less) smaller than the declared context (4096) and than decode's pool — and its traffic (one
tenant sends only prompts between prefill's limit and decode's admission edge, among 15 other
tenants' requests) run on each release in its own environment (``scripts/setup-engine.sh VERSION``),
with no mutation and no fault: whatever happens is the release's own behaviour.

Per trial (:func:`trial_record`): **leaked** (isolation FAIL: the oversized prompts' replies carry
other tenants' canaries; ``None`` when isolation could not tell — not enough echo, or the release
cluster's planted-leak self-test did not catch — never counted as "no leak"), **hung** (an oversized
prompt got no answer within the bound), **rejected_4xx** (every oversized prompt got an HTTP 4xx),
the first witness, and the oversized prompts' KV pages as prefill sent them.

Per release (:func:`aggregate`): ``leaks`` when any trial leaked, ``clean`` only when every trial was
measured and none leaked, else ``unknown``. :func:`assess` is what ``kvchaos audit``'s
``engine_version`` check answers from the committed table (``TABLE_FILE``): measured behaviour, not
PR numbers.

    kvchaos bisect --releases 0.5.19,0.5.20,0.5.21,0.5.22,0.5.23 --trials 3
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from kvchaos import canary
from kvchaos.cluster.spec import SGLANG_DECODE_RESERVATION
from kvchaos.experiment import _rel
from kvchaos.oracles import kv_pages_written
from kvchaos.workload import Workload

REPO = Path(__file__).resolve().parents[1]
TABLE_FILE = REPO / "reports" / "releases" / "release_table.json"
CODE_READING_FILE = REPO / "reports" / "releases" / "code-reading.json"
# deployments the matrix can run: the incident's shape, and the same with prefill truncating instead of
# rejecting (--allow-auto-truncate on both roles: a prompt over prefill's limit is cut, not aborted)
DEPLOYMENTS = {"incident": [], "auto-truncate": ["--allow-auto-truncate"]}
GLM53_SEED = 53
PREFILL_POOL = 576  # prefill's --max-total-tokens in the incident's shape (input limit 570 < context 4096)
OVERSIZED = (600, 900, 1200, 1400)  # between prefill's limit and decode's admission edge (2048 − 512 at most)
BOUND_S = 30.0  # an oversized prompt not answered within this is "hung"
MAIN_RELEASE = "0.5.23"  # the main venv's sglang: scripts/setup-engine.sh builds no environment for it
WRITEUP_FIRST_FIXED = "0.5.22"  # the incident write-up: "upgrade to v0.5.22 or later"
CLEAN, LEAKS, UNMEASURED = "clean", "leaks", "unknown"


class ReleaseError(RuntimeError):
    """A release environment could not be built, or a table is malformed (the message says which)."""


def version_key(v: str) -> tuple:
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?", str(v).strip())
    if not m:
        raise ValueError(f"not a release version: {v!r} (expected e.g. 0.5.21)")
    return tuple(int(x or 0) for x in m.groups())


def parse_releases(text: str) -> list[str]:
    """``"0.5.19,0.5.20"`` -> sorted unique releases; a clear error for anything else."""
    out = []
    for raw in str(text or "").split(","):
        v = raw.strip()
        if not v:
            continue
        version_key(v)  # raises with the offending text
        if v not in out:
            out.append(v)
    if not out:
        raise ValueError(f"no releases in {text!r} (expected e.g. 0.5.19,0.5.23)")
    return sorted(out, key=version_key)


# --------------------------------------------------------------------------- the incident's shape
def glm53_plans(seed: int = GLM53_SEED, lead: int | None = None):
    """The incident's traffic: 80 background requests of 15 tenants, then the victim tenant's four
    oversized prompts mixed in after the first 72 (so a hang they cause leaves the run its echo
    evidence). The victim sends only oversized prompts: every leak is cross-tenant.

    ``lead``: a run that expects the leak (a reproduction) sends only ``lead`` background requests,
    then the four oversized prompts each followed by one more, and stops there: the leak is seen
    seconds into the run rather than after 72 requests. Too few requests for isolation's echo floor,
    so a run of these plans that shows no leak is UNKNOWN, never PASS."""
    wl = Workload(seed, n_tenants=16, prefix="g")
    victim, others = wl.tenants[-1], wl.tenants[:-1]
    background = [wl.request(others[i % len(others)], "plain", n_tokens=others[i % len(others)].rng.randrange(200, 480))
                  for i in range(80)]
    big = [wl.request(victim, "oversized", n_tokens=n, n_canaries=3) for n in OVERSIZED]
    if lead is not None and not 0 <= lead <= 76:
        raise ValueError(f"lead={lead}: between 0 and 76 background requests before the oversized prompts")
    n = 72 if lead is None else lead
    plans = background[:n] + [x for pair in zip(big, background[n:n + 4]) for x in pair]
    return plans + (background[n + 4:] if lead is None else []), victim.name


def deployment_spec(base: dict, deployment: str) -> dict:
    """``base`` (a ClusterSpec dict) deployed as ``deployment``: the incident's prefill pool, plus that
    deployment's server args on both roles."""
    if deployment not in DEPLOYMENTS:
        raise ValueError(f"deployment {deployment!r}: one of {', '.join(DEPLOYMENTS)}")
    extra = DEPLOYMENTS[deployment]
    pool = ["--max-total-tokens", str(PREFILL_POOL)]  # the last flag wins over the profile's
    return {**base, "prefill_args": list(base["prefill_args"]) + pool + extra,
            "decode_args": list(base["decode_args"]) + extra}


def table_file(deployment: str = "incident", base: Path | None = None) -> Path:
    """``release_table.json`` for the incident's deployment (what the audit reads), else
    ``release_table-<deployment>.json``."""
    d = base or TABLE_FILE.parent
    return d / ("release_table.json" if deployment == "incident" else f"release_table-{deployment}.json")


def env_python(version: str) -> str:
    """Where scripts/setup-engine.sh puts ``version``'s interpreter (its ``MAIN`` and ``DEST``), built or not."""
    cache = Path.home() / ".cache" / "kvchaos"
    if version == MAIN_RELEASE:
        return str(Path(os.environ.get("KVCHAOS_VENV") or cache / "venv") / "bin" / "python")
    return str(Path(os.environ.get("KVCHAOS_ENGINE_VENV") or cache / f"venv-sglang-{version}") / "bin" / "python")


def engine_python(version: str, timeout_s: float = 900) -> str:
    """The interpreter of ``version``'s environment (built on first use by scripts/setup-engine.sh).
    A dry run (``--kvchaos-dry``: ``KVCHAOS_DRY=1``) starts no engine, so it names the interpreter and
    builds nothing: a fresh machine's dry run of every suite would otherwise install three releases."""
    version_key(version)
    if os.environ.get("KVCHAOS_DRY") == "1":
        return env_python(version)
    try:
        r = subprocess.run(["bash", str(REPO / "scripts" / "setup-engine.sh"), version],
                           capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ReleaseError(f"building the sglang {version} environment took over {timeout_s:.0f} s") from None
    if r.returncode != 0:
        raise ReleaseError(f"building the sglang {version} environment failed (exit {r.returncode}):\n"
                           f"{r.stderr[-3000:]}")
    return r.stdout.strip().splitlines()[-1]


# --------------------------------------------------------------------------- the incident at its own numbers
INCIDENT_PREFILL_POOL = 681_280  # the incident's prefill KV pool (tokens)
INCIDENT_CONTEXT = 1_048_576  # its declared context
# decode's num_reserved_decode_tokens on top of a pre-allocated prompt: SGLang's default, the largest a
# deployment here runs (the CPU profile sets 128), so a scale that admits its prompts with it admits them with any
DECODE_RESERVE = SGLANG_DECODE_RESERVATION


@dataclass(frozen=True)
class Scale:
    """A deployment and traffic of the incident's shape at some size. ``decode_pool`` must admit the
    largest oversized prompt plus decode's reservation; ``background`` requests of other tenants go first
    and must move more tokens through decode than its pool has beyond the victim's prompt: decode's
    allocator (``need_sort`` in PD) hands out never-used pages until its free list runs short, and only
    then merges the freed pages back in ascending order — a victim reserved from untouched pages reads
    zeros, not another tenant's prompt."""

    name: str
    prefill_pool: int
    context: int
    decode_pool: int
    oversized: tuple
    background: int
    background_tokens: tuple  # (lo, hi) prompt tokens of a background request
    bound_s: float  # an oversized prompt's reply within this, or it hung
    max_running: int  # --max-running-requests: req_to_token is max_running x context int32 on each role

    def check(self) -> None:
        lo, hi = min(self.oversized), max(self.oversized)
        problems = []
        if not self.prefill_pool < lo:
            problems.append(f"the oversized prompts ({lo}..{hi}) must be over prefill's pool ({self.prefill_pool})")
        if not hi < self.context:
            problems.append(f"the oversized prompts ({lo}..{hi}) must be under the context ({self.context})")
        if not hi + DECODE_RESERVE <= self.decode_pool:
            problems.append(f"decode's pool ({self.decode_pool}) must admit {hi} + its reservation {DECODE_RESERVE}")
        if self.background * self.background_tokens[0] < self.decode_pool - lo:
            problems.append(f"{self.background} background requests of >= {self.background_tokens[0]} tokens do not "
                            f"cycle decode's free list past {self.decode_pool - lo} tokens: the victim would be "
                            f"reserved untouched pages")
        if problems:
            raise ValueError(f"scale {self.name!r}: " + "; ".join(problems))

    def need_bytes(self, bytes_per_token: int, attention_bytes_per_token: int = 0) -> int:
        """What a run at this scale needs resident at its peak: both pools, the index tables, the
        processes, and decode's attention working set over the largest victim."""
        m = self.memory_model(bytes_per_token)
        return (m["prefill_pool_bytes"] + m["decode_pool_bytes"] + 2 * m["req_to_token_bytes_per_role"]
                + ENGINE_BASE_BYTES + max(self.oversized) * attention_bytes_per_token)

    def memory_model(self, bytes_per_token: int) -> dict:
        """What the KV pools take at ``bytes_per_token`` (layers x per-layer KV bytes of one token), and
        the index table ``req_to_token`` (int32, max_running x context, on each role)."""
        return {"bytes_per_token": bytes_per_token,
                "prefill_pool_bytes": self.prefill_pool * bytes_per_token,
                "decode_pool_bytes": self.decode_pool * bytes_per_token,
                "req_to_token_bytes_per_role": self.max_running * self.context * 4}


SCALES = {
    # the incident's own numbers: prefill's pool 681,280 tokens, context 1,048,576, the victim's prompt
    # in the band between them
    "incident": Scale("incident", INCIDENT_PREFILL_POOL, INCIDENT_CONTEXT, decode_pool=704_000,
                      oversized=(690_000,), background=120, background_tokens=(200, 480),
                      bound_s=1800.0, max_running=16),
    # the same shape at 5/8 of it (pool 425,792, context 655,360): the largest that fits a 24 GiB CPU
    # machine by :meth:`Scale.need_bytes` (measured there on 2026-12-06: the cluster's processes peaked at
    # 21.9 GB over a 440,000-token victim; at the incident's own numbers a 690,000-token victim took decode
    # past the machine's memory and the kernel's OOM killer stopped it): docs/tutorial/reproduce-an-incident.md
    "largest-fit": Scale("largest-fit", 425_792, 655_360, decode_pool=450_560, oversized=(440_000,),
                         background=120, background_tokens=(200, 480), bound_s=1800.0, max_running=16),
}
# decode's torch_native attention (the CPU path) gathers a request's whole context and lets SDPA expand it
# to every query head in fp32: about this many bytes a context token while the victim decodes (the MLA
# probe, 4 heads: decode's process tree peaked at 18.06 GB over a 440,000-token victim, 2.4 GB of it its
# pool and process before the victim came; 2026-12-06, test_glm53_incident_scale.py at largest-fit)
CPU_ATTENTION_BYTES_PER_TOKEN = 36_000
ENGINE_BASE_BYTES = 6 << 30  # both roles' processes, the router and the harness, without their pools


def scale_of(name: str) -> Scale:
    if name not in SCALES:
        raise ValueError(f"scale {name!r}: one of {', '.join(SCALES)} (the CI scale is the suite's default)")
    return SCALES[name]


def scaled_plans(scale: Scale, seed: int = GLM53_SEED):
    """The incident's traffic at ``scale``: ``background`` requests of 15 tenants first, then the victim
    tenant's oversized prompts (3 canaries each). Returns ``(plans, victim tenant)``."""
    scale.check()
    wl = Workload(seed, n_tenants=16, prefix="g")
    victim, others = wl.tenants[-1], wl.tenants[:-1]
    lo, hi = scale.background_tokens
    plans = [wl.request(others[i % len(others)], "plain", n_tokens=others[i % len(others)].rng.randrange(lo, hi))
             for i in range(scale.background)]
    big = [wl.request(victim, "oversized", n_tokens=n, n_canaries=3) for n in scale.oversized]
    for p in big:  # one recited canary is the evidence: each decode step over the victim's context is long
        p.max_new_tokens = canary.LENGTH + 2
    return plans + big, victim.name


def scaled_spec(base: dict, scale: Scale) -> dict:
    """``base`` (a ClusterSpec dict) deployed at ``scale``: prefill's pool, decode's pool, the context,
    ``max_running`` on both roles (a probe model is served from a copy whose positions reach the context:
    :func:`kvchaos.probe.reaching`, by the launcher)."""
    scale.check()
    run = ["--max-running-requests", str(scale.max_running)]
    return {**base, "context_length": scale.context, "pool_tokens": scale.decode_pool,
            "startup_timeout_s": max(base.get("startup_timeout_s", 300.0), 600.0),
            "prefill_args": list(base["prefill_args"]) + ["--max-total-tokens", str(scale.prefill_pool)] + run,
            "decode_args": list(base["decode_args"]) + ["--max-total-tokens", str(scale.decode_pool)] + run}


class PeakRss:
    """Peak resident memory of each role's process tree while the ``with`` block runs, sampled every
    ``every_s`` (``/proc`` through psutil): ``peaks`` maps role -> bytes, ``peak_total`` the most the
    roles held at one sample."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.5):
        self.pids, self.every_s = dict(pids), every_s
        self.peaks = {r: 0 for r in self.pids}
        self.peak_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvchaos-peak-rss", daemon=True)

    def sample(self) -> dict[str, int]:
        import psutil

        now = {}
        for role, pid in self.pids.items():
            total = 0
            try:
                root = psutil.Process(pid)
                for p in [root, *root.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        pass
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
            now[role] = total
            self.peaks[role] = max(self.peaks[role], total)
        self.peak_total = max(self.peak_total, sum(now.values()))
        return now

    def _run(self):
        while not self._stop.wait(self.every_s):
            self.sample()

    def __enter__(self):
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()
        return False

    def to_dict(self) -> dict:
        return {"every_s": self.every_s, "peak_bytes": dict(self.peaks), "peak_total_bytes": self.peak_total}


def scale_record(scale: Scale) -> dict:
    return asdict(scale)


# --------------------------------------------------------------------------- one trial
def trial_record(ex, plans, victim: str, release: str, trial: int, seed: int, selftest: dict | None = None,
                 deployment: str = "incident") -> dict:
    """What one unmodified run of the incident showed on ``release`` (from the experiment's log and
    verdicts; nothing assumed from the version)."""
    ends = {e["rid"]: e for e in ex.events if e.get("ev") == "end"}
    sent = kv_pages_written(ex.events)
    big = [p for p in plans if p.oversized]
    over = {}
    for p in big:
        e = ends.get(p.rid, {})
        over[p.rid] = {"prompt_tokens": p.n_tokens, "outcome": e.get("outcome"), "status": e.get("status"),
                       "latency_s": round(e["latency_s"], 2) if "latency_s" in e else None,
                       "kv_pages_sent": sent.get(p.rid)}
    iso, by = ex.by["isolation"], ex.by
    leaked = {"fail": True, "pass": False}.get(iso.status)  # unknown: not measured, never "no leak"
    cross = [w for w in iso.witnesses if w.get("owner_tenant") not in (None, w.get("victim_tenant"))]
    first = cross[0] if cross else (iso.witnesses[0] if iso.witnesses else None)
    bystanders = [e for rid, e in ends.items() if rid not in over]
    outcomes = [v["outcome"] for v in over.values()]
    return {
        "release": release, "deployment": deployment, "trial": trial, "seed": seed, "experiment": ex.id, "engine": _engine_versions(ex),
        "victim_tenant": victim, "leaked": leaked,
        "leak_witnesses": len(iso.witnesses), "cross_tenant_witnesses": len(cross),
        "leak_victims": sorted({w["victim_rid"] for w in iso.witnesses}),
        "first_witness": _witness(first),
        "hung": any(o == "timeout" for o in outcomes),
        "rejected_4xx": bool(outcomes) and all(v["outcome"] == "http_error" and 400 <= (v["status"] or 0) < 500
                                               for v in over.values()),
        "answered_200": sum(v["status"] == 200 for v in over.values()),
        "oversized": over,
        "bystanders": {"n": len(bystanders), "timeouts": sum(e.get("outcome") == "timeout" for e in bystanders),
                       "ok": sum(e.get("outcome") == "ok" for e in bystanders)},
        "verdicts": {v.oracle: v.status for v in ex.verdicts},
        "isolation_summary": iso.summary, "sensitivity": by["sensitivity"].summary if "sensitivity" in by else None,
        "selftest": (selftest or {}).get("status"),
        "events": _rel(ex.path, ex.run_dir),
    }


def _engine_versions(ex) -> dict:
    head = next((e for e in ex.events if e.get("ev") == "experiment"), {})
    return (head.get("engine") or {}).get("roles", {})


def _witness(w: dict | None) -> dict | None:
    if not w:
        return None
    keep = ("victim_rid", "victim_tenant", "owner_tenant", "owner_rid", "matched", "status", "origin")
    return {k: w.get(k) for k in keep if k in w}


# --------------------------------------------------------------------------- the table
def aggregate(trials: list[dict], code_reading: dict | None = None, releases: list[str] | None = None,
              deployment: str = "incident") -> dict:
    """Per release: verdict (``leaks`` / ``clean`` / ``unknown``), counts, the first witness, and the
    code reading's prediction beside it (where given). A release in ``releases`` none of whose trials
    ran is in the table, unmeasured."""
    by: dict[str, list[dict]] = {r: [] for r in releases or ()}
    for t in (t for t in trials if t.get("deployment", "incident") == deployment):
        by.setdefault(t["release"], []).append(t)
    rows = {}
    reading = (code_reading or {}).get("releases", {})
    for rel in sorted(by, key=version_key):
        ts = sorted(by[rel], key=lambda t: t["trial"])
        leaked = [t for t in ts if t["leaked"] is True]
        blind = [t for t in ts if t["leaked"] is None]
        verdict = LEAKS if leaked else (UNMEASURED if blind or not ts else CLEAN)
        w = next((t["first_witness"] for t in leaked if t["first_witness"]), None)
        # the code reading predicts the incident deployment's path (reports/releases/code-reading.md)
        pred = reading.get(rel, {}).get("predicted_behaviour") if deployment == "incident" else None
        rows[rel] = {"verdict": verdict, "trials": len(ts), "leaked": len(leaked), "unmeasured": len(blind),
                     "hung": sum(t["hung"] for t in ts), "rejected_4xx": sum(t["rejected_4xx"] for t in ts),
                     "oversized_answered_200": sum(t["answered_200"] for t in ts),
                     "oversized_per_trial": len(OVERSIZED),
                     "witness": w, "code_prediction": pred,
                     "audit_engine_version": sorted({(t.get("audit_engine_version") or {}).get("status") or "—"
                                                     for t in ts}),
                     "experiments": [t["experiment"] for t in ts]}
    return {"workload": {"incident": "glm53", "prefill_pool_tokens": PREFILL_POOL, "oversized_tokens": list(OVERSIZED),
                         "bound_s": BOUND_S, "mutation": None, "deployment": deployment,
                         "server_args": DEPLOYMENTS[deployment]},
            "releases": rows, "derived": derive(rows), "trials": trials}


def derive(rows: dict) -> dict:
    """The thresholds the audit uses: the oldest measured release from which every measured release
    is clean (``first_clean``), the releases measured to leak, and where the write-up's "≥ 0.5.22"
    disagrees with the measurements."""
    order = sorted(rows, key=version_key)
    leaking = [r for r in order if rows[r]["verdict"] == LEAKS]
    unmeasured = [r for r in order if rows[r]["verdict"] == UNMEASURED]
    first_clean = None
    for i, r in enumerate(order):
        if all(rows[x]["verdict"] == CLEAN for x in order[i:]):
            first_clean = r
            break
    disagree = []
    for r in order:
        says_fixed = version_key(r) >= version_key(WRITEUP_FIRST_FIXED)
        v = rows[r]["verdict"]
        if v == UNMEASURED:
            continue
        if says_fixed and v == LEAKS:
            disagree.append(f"{r}: the write-up's >= {WRITEUP_FIRST_FIXED} calls it fixed, measured to leak")
        elif not says_fixed and v == CLEAN:
            disagree.append(f"{r}: the write-up's >= {WRITEUP_FIRST_FIXED} calls it unfixed, measured clean "
                            f"(no leak in {rows[r]['trials']} trial(s))")
    return {"measured": order, "leaking": leaking, "unmeasured": unmeasured, "first_clean": first_clean,
            "writeup_first_fixed": WRITEUP_FIRST_FIXED, "writeup_disagreements": disagree}


def load_table(path: str | Path | None = None) -> dict | None:
    """The committed release table, or None when there is none (the audit then says UNKNOWN)."""
    p = Path(path) if path else TABLE_FILE
    if not p.exists():
        return None
    try:
        t = json.loads(p.read_text())
    except ValueError as e:
        raise ReleaseError(f"{p}: not JSON ({e})") from None
    if not isinstance(t, dict) or not isinstance(t.get("releases"), dict):
        raise ReleaseError(f"{p}: no 'releases' table")
    for rel, row in t["releases"].items():
        version_key(rel)
        if row.get("verdict") not in (CLEAN, LEAKS, UNMEASURED):
            raise ReleaseError(f"{p}: release {rel}: verdict {row.get('verdict')!r} is not one of "
                               f"{CLEAN}/{LEAKS}/{UNMEASURED}")
    t["derived"] = derive(t["releases"])  # always recomputed from the rows, never trusted as stored
    return t


def load_code_reading(path: str | Path | None = None) -> dict | None:
    """The per-release code reading (reports/releases/code-reading.json), or None when absent."""
    p = Path(path) if path else CODE_READING_FILE
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except ValueError as e:
        raise ReleaseError(f"{p}: not JSON ({e})") from None


def assess(version: str, table: dict | None) -> tuple[str, str]:
    """(``leaks`` / ``clean`` / ``unknown``, why) for one running release, from the measured table:
    a measured release answers for itself; an unmeasured one is judged only when measured releases
    on both sides agree; newer than everything measured is unknown (run kvchaos bisect on it)."""
    if table is None:
        return UNMEASURED, "no release table for this deployment (reports/releases/): run kvchaos bisect"
    rows = table["releases"]
    vk = version_key(version)
    leaking = ", ".join(table["derived"]["leaking"]) or "none"
    wl = table.get("workload") or {}
    what = ("the unmodified incident" if wl.get("deployment", "incident") == "incident"
            else f"the incident deployed with {' '.join(wl.get('server_args') or [])}")
    if version in rows:
        r = rows[version]
        n = r["trials"]
        if r["verdict"] == LEAKS:
            w = r.get("witness") or {}
            return LEAKS, (f"sglang {version} was measured to leak: {r['leaked']}/{n} trial(s) of {what} "
                           f"served other tenants' canaries with HTTP 200"
                           + (f" (e.g. {w.get('victim_rid')} got {w.get('owner_tenant')}'s {w.get('matched')!r})" if w else ""))
        if r["verdict"] == CLEAN:
            return CLEAN, (f"sglang {version} was measured clean: no leak in {n}/{n} trial(s) of {what} "
                           f"(hung in {r['hung']}, rejected with 4xx in {r['rejected_4xx']}); releases measured to "
                           f"leak: {leaking}")
        return UNMEASURED, f"sglang {version}: trials ran but {r['unmeasured']}/{n} could not see a leak (blind)"
    measured = sorted(rows, key=version_key)
    older = [r for r in measured if version_key(r) < vk and rows[r]["verdict"] != UNMEASURED]
    newer = [r for r in measured if version_key(r) > vk and rows[r]["verdict"] != UNMEASURED]
    if older and newer and rows[older[-1]]["verdict"] == rows[newer[0]]["verdict"]:
        v = rows[older[-1]]["verdict"]
        return v, (f"sglang {version} not measured; both neighbours {older[-1]} and {newer[0]} were measured "
                   f"{'to leak' if v == LEAKS else 'clean'}; releases measured to leak: {leaking}")
    if newer and not older and rows[newer[0]]["verdict"] == LEAKS:
        return LEAKS, (f"sglang {version} not measured, older than {newer[0]}, which was measured to leak; "
                       f"releases measured to leak: {leaking}")
    return UNMEASURED, (f"sglang {version} not measured (measured: {', '.join(measured)}; leaking: {leaking}): "
                        f"run kvchaos bisect --releases {version}")


# --------------------------------------------------------------------------- rendering
def render_markdown(table: dict, command: str | None = None) -> str:
    rows, d = table["releases"], table["derived"]
    w = table["workload"]
    lines = ["# Which SGLang releases leak: the GLM-5.3 incident, unmodified, per release", ""]
    if command:
        lines += ["Produced by:", "", f"    {command}", ""]
    args = " ".join(w.get("server_args") or [])
    lines += [f"Deployment `{w.get('deployment', 'incident')}`: prefill KV pool {w['prefill_pool_tokens']} tokens < context 4096"
              + (f", `{args}` on both roles" if args else "") + "; the victim tenant's "
              f"oversized prompts of {', '.join(map(str, w['oversized_tokens']))} tokens among 80 other requests; no "
              f"mutation, no fault. Hung = an oversized prompt unanswered within {w['bound_s']:.0f} s.", "",
              "| release | verdict | leaked | hung | rejected 4xx | oversized answered 200 | code reading predicts "
              "| audit engine_version then | first witness |",
              "|---|---|---|---|---|---|---|---|---|"]
    for rel in sorted(rows, key=version_key):
        r = rows[rel]
        n = r["trials"]
        wit = r.get("witness")
        ws = (f"`{wit.get('victim_rid')}` got {wit.get('owner_tenant')}'s `{wit.get('matched')}`" if wit else "—")
        lines.append(f"| {rel} | **{r['verdict']}** | {r['leaked']}/{n} | {r['hung']}/{n} | {r['rejected_4xx']}/{n} | "
                     f"{r['oversized_answered_200']}/{n * r['oversized_per_trial']} | {r.get('code_prediction') or '—'} | "
                     f"{', '.join(r.get('audit_engine_version') or ['—'])} | {ws} |")
    lines += ["", "(*audit engine_version then*: `kvchaos audit` of each trial's live cluster, judged by the release "
              "table committed when the trial ran; unknown while there was none.)",
              "", f"- Measured to leak: {', '.join(d['leaking']) or 'none'}; unmeasured (blind): "
              f"{', '.join(d['unmeasured']) or 'none'}.",
              f"- First release from which every measured release is clean: **{d['first_clean'] or 'none'}**.",
              f"- The incident write-up recommends >= {d['writeup_first_fixed']}."]
    if d["writeup_disagreements"]:
        lines += ["- Where measurement and the write-up disagree:"] + [f"  - {x}" for x in d["writeup_disagreements"]]
    else:
        lines.append("- Measurement and the write-up agree on every measured release.")
    return "\n".join(lines) + "\n"


def load_trials(out_dir: Path) -> list[dict]:
    """The trial records a release-matrix run appended to ``<out_dir>/trials.jsonl`` ([] when none)."""
    f = Path(out_dir) / "trials.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def record_trial(rec: dict, out_dir: Path) -> dict:
    """Append one trial's record and rebuild its deployment's table beside it; returns the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "trials.jsonl", "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
    table = aggregate(load_trials(out_dir), load_code_reading(), deployment=rec["deployment"])
    write_table(table, out_dir)
    return table


def write_table(table: dict, out_dir: Path, command: str | None = None) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    j = table_file(table["workload"].get("deployment", "incident"), out_dir)
    m = j.with_suffix(".md")
    j.write_text(json.dumps({**table, "command": command}, indent=2, default=str) + "\n")
    m.write_text(render_markdown(table, command))
    return j, m
