"""``kvchaos audit``: the GLM-5.3 incident's operator checklist, as checks on a running deployment.

    kvchaos audit --prefill URL --decode URL [--router URL] [--json]

Each check is PASS / FAIL / UNKNOWN with the numbers it judged and what to do:

* ``pool_vs_context``      each node's KV pool (``max_total_num_tokens``) against the declared context;
                           on decode, the pool minus ``num_reserved_decode_tokens`` (what a prompt can
                           get pre-allocated). A pool below the context is the incident's configuration:
                           prompts in between go down the reject path (pre-fix: leaked; 0.5.23: hang).
* ``engine_version``       both roles at or above the releases with PR #36988 (0.5.20: no PD admission
                           of a request rejected at intake) and PR #38935 (0.5.21: the PD queues see
                           ``to_finish``); open PR #38704 (transferred-length check) is in no release.
* ``deferred_kv_release``  ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE`` on each role (decode
                           keeps an aborted transfer's pages until in-flight writes drain). Not in
                           ``/server_info``: read from the server process's environment when it runs on
                           this host, else the release's default where kvchaos knows it, else UNKNOWN.
* ``mooncake_batch_bound`` ``SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES`` > 0 (bounded transfer batches;
                           0 = unbounded), same sources; not applicable to other transfer backends.
* ``kv_integrity``         ``--disaggregation-enable-kv-checksum`` on both roles, or ``--kv-canary``
                           log/raise (both CUDA-only in 0.5.23; absent from older releases).
* ``router_workers``       (with ``--router``) the router lists the audited prefill and decode, healthy.

Exit status: 0 no FAIL, 1 at least one FAIL (``--strict``: UNKNOWN counts as FAIL), 2 bad input or an
unreachable node.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

import httpx

PASS, FAIL, UNKNOWN = "pass", "fail", "unknown"
FIXES = (("0.5.20", "#36988", "a request rejected at intake is no longer admitted to the PD bootstrap queue"),
         ("0.5.21", "#38935", "the PD queues treat a parked abort (to_finish) as finished"))
OPEN_PRS = ("#38704 (decode checks the transferred KV length; open, in no release)",)
# defaults read in the releases' own srt/environ.py (kvchaos checked these two; others are unknown)
DEFERRED_DEFAULT = {"0.5.19": False, "0.5.23": True}
BATCH_BOUND_SUPPORTED = {"0.5.19": False, "0.5.23": True}
ENV_DEFERRED = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
ENV_BATCH = "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"


class AuditError(RuntimeError):
    """Bad input or a node that does not answer (the message names which)."""


@dataclass
class Check:
    id: str
    role: str
    status: str
    title: str
    numbers: dict = field(default_factory=dict)
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def version_tuple(v: str) -> tuple:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", str(v or ""))
    if not m:
        raise ValueError(f"not a release version: {v!r}")
    return tuple(int(x) for x in m.groups())


def field_of(info, key):
    """First value of ``key`` anywhere in a nested ``/server_info`` answer."""
    from kvchaos.workload.probes import server_field

    return server_field(info, key)


def _truthy(v: str) -> bool:
    return str(v).strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------- the checks (pure)
def check_pool(role: str, info: dict) -> Check:
    pool, ctx = field_of(info, "max_total_num_tokens"), field_of(info, "context_length")
    nums = {"pool_tokens": pool, "context_length": ctx, "max_req_input_len": field_of(info, "max_req_input_len")}
    if pool is None or ctx is None:
        return Check("pool_vs_context", role, UNKNOWN, "KV pool vs context", nums,
                     "/server_info has no max_total_num_tokens or context_length")
    usable, what = pool, "pool"
    if role == "decode":
        res = field_of(info, "num_reserved_decode_tokens") or 0
        usable, what = pool - res, "pool minus num_reserved_decode_tokens"
        nums.update(num_reserved_decode_tokens=res, usable_for_prompt=usable)
    title = f"KV {what} vs declared context"
    if usable < ctx:
        return Check("pool_vs_context", role, FAIL, title, nums,
                     f"{what} {usable} < context {ctx}: prompts of {usable}..{ctx} tokens go down the reject path "
                     "(pre-fix releases served them from stale pages: the GLM-5.3 incident; 0.5.23 hangs them). "
                     f"Lower --context-length to <= {usable} or grow the pool.")
    return Check("pool_vs_context", role, PASS, title, nums, f"{what} {usable} >= context {ctx}")


def check_versions(infos: dict) -> Check:
    vers = {r: field_of(i, "version") for r, i in infos.items()}
    nums = {"versions": vers, "fixes": {pr: rel for rel, pr, _ in FIXES}, "open": list(OPEN_PRS)}
    missing, bad = {}, []
    for role, v in vers.items():
        try:
            vt = version_tuple(v)
        except ValueError:
            bad.append(f"{role}: {v!r}")
            continue
        miss = [f"{pr} ({rel}: {what})" for rel, pr, what in FIXES if vt < version_tuple(rel)]
        if miss:
            missing[role] = miss
    if missing:
        return Check("engine_version", "both", FAIL, "engine version vs the fix releases", nums,
                     "; ".join(f"{r} {vers[r]} lacks " + ", ".join(m) for r, m in missing.items()))
    if bad:
        return Check("engine_version", "both", UNKNOWN, "engine version vs the fix releases", nums,
                     "no release version reported: " + ", ".join(bad))
    note = "" if len(set(vers.values())) == 1 else f"; roles run different releases: {vers}"
    return Check("engine_version", "both", PASS, "engine version vs the fix releases", nums,
                 f"{', '.join(f'{r} {v}' for r, v in vers.items())} include #36988 and #38935{note}; "
                 f"still open upstream: {OPEN_PRS[0]}")


def _env_setting(role, info, env, var, defaults):
    """(value, source) of an env knob: the process environment, else the release default, else None."""
    if env is not None and var in env:
        return env[var], "process environment"
    ver = field_of(info, "version")
    if ver in defaults:
        return defaults[ver], f"default of sglang {ver}" + ("" if env is not None else " (environment not readable)")
    return None, ("environment not readable from here (remote host?) and kvchaos does not know sglang "
                  f"{ver}'s default" if env is None else f"unset, and kvchaos does not know sglang {ver}'s default")


def check_deferred(role: str, info: dict, env: dict | None) -> Check:
    val, src = _env_setting(role, info, env, ENV_DEFERRED, DEFERRED_DEFAULT)
    nums = {ENV_DEFERRED: val, "source": src}
    title = "deferred decode KV release"
    if val is None:
        return Check("deferred_kv_release", role, UNKNOWN, title, nums, src)
    on = val if isinstance(val, bool) else _truthy(val)
    if not on:
        return Check("deferred_kv_release", role, FAIL, title, nums,
                     f"off ({src}): decode frees an aborted transfer's pages while its RDMA writes may still "
                     f"land (late writes into recycled pages). Set {ENV_DEFERRED}=1.")
    return Check("deferred_kv_release", role, PASS, title, nums, f"on ({src})")


def check_batch_bound(role: str, info: dict, env: dict | None) -> Check:
    backend = field_of(info, "disaggregation_transfer_backend")
    title = "bounded Mooncake transfer batches"
    if backend is not None and backend != "mooncake":
        return Check("mooncake_batch_bound", role, UNKNOWN, title, {"transfer_backend": backend},
                     f"not applicable: transfer backend is {backend}")
    ver = field_of(info, "version")
    if BATCH_BOUND_SUPPORTED.get(ver) is False:
        return Check("mooncake_batch_bound", role, FAIL, title, {"version": ver},
                     f"sglang {ver} has no {ENV_BATCH}: transfer batches are unbounded")
    val, src = _env_setting(role, info, env, ENV_BATCH, {v: 0 for v, ok in BATCH_BOUND_SUPPORTED.items() if ok})
    nums = {ENV_BATCH: val, "source": src}
    if val is None:
        return Check("mooncake_batch_bound", role, UNKNOWN, title, nums, src)
    try:
        n = int(val)
    except ValueError:
        return Check("mooncake_batch_bound", role, FAIL, title, nums, f"{ENV_BATCH}={val!r} is not an integer")
    if n <= 0:
        return Check("mooncake_batch_bound", role, FAIL, title, nums,
                     f"{ENV_BATCH}={n} ({src}): unbounded; set it (e.g. 1024) so one huge transfer cannot "
                     "monopolise the transfer engine")
    return Check("mooncake_batch_bound", role, PASS, title, nums, f"{ENV_BATCH}={n} ({src})")


def check_integrity(infos: dict) -> Check:
    nums, missing, off = {}, [], []
    for role, info in infos.items():
        ck, kc = field_of(info, "disaggregation_enable_kv_checksum"), field_of(info, "kv_canary")
        nums[role] = {"disaggregation_enable_kv_checksum": ck, "kv_canary": kc, "device": field_of(info, "device")}
        if ck is None and kc is None:
            missing.append(role)
        elif not (ck or (kc not in (None, "none", "off"))):
            off.append(role)
    title = "KV checksum / --kv-canary"
    if missing:
        return Check("kv_integrity", "both", UNKNOWN, title, nums,
                     f"{', '.join(missing)}: this release reports neither option (not supported)")
    if off:
        cpu = [r for r in off if nums[r]["device"] == "cpu"]
        return Check("kv_integrity", "both", FAIL, title, nums,
                     f"off on {', '.join(off)}: a short or stale transfer is served silently. Enable "
                     "--disaggregation-enable-kv-checksum on both roles (or --kv-canary log)"
                     + (" — both are CUDA-only in sglang 0.5.23, so a CPU deployment cannot enable them" if cpu else ""))
    return Check("kv_integrity", "both", PASS, title, nums, "enabled on both roles")


def check_router(workers: list | None, prefill: str, decode: str, error: str | None = None) -> Check:
    title = "router lists the audited workers, healthy"
    if workers is None:
        return Check("router_workers", "router", UNKNOWN, title, {}, error or "router did not list its workers")

    def hp(u):
        p = urlparse(u)
        host = "127.0.0.1" if p.hostname in ("localhost", "::1") else p.hostname
        return (host, p.port)

    listed = {hp(w.get("url", "")): w for w in workers}
    nums = {"workers": [{k: w.get(k) for k in ("url", "worker_type", "is_healthy")} for w in workers]}
    probs = []
    for role, url in (("prefill", prefill), ("decode", decode)):
        w = listed.get(hp(url))
        if w is None:
            probs.append(f"{role} {url} is not one of the router's workers (behind a proxy? audit the URLs the router uses)")
        elif w.get("is_healthy") is False:
            probs.append(f"{role} {url} is listed unhealthy")
    if probs:
        st = FAIL if any("unhealthy" in p for p in probs) else UNKNOWN
        return Check("router_workers", "router", st, title, nums, "; ".join(probs))
    return Check("router_workers", "router", PASS, title, nums, "both listed and healthy")


# --------------------------------------------------------------------------- gathering
def fetch_info(url: str, timeout: float = 15.0) -> dict:
    for path in ("/server_info", "/get_server_info"):
        try:
            r = httpx.get(url.rstrip("/") + path, timeout=timeout)
        except httpx.HTTPError as e:
            raise AuditError(f"{url}: not reachable ({e!r})") from None
        if r.status_code == 200:
            try:
                return r.json()
            except ValueError:
                raise AuditError(f"{url}{path}: answered non-JSON") from None
    raise AuditError(f"{url}: neither /server_info nor /get_server_info answered 200 (HTTP {r.status_code})")


def local_env(url: str) -> tuple[dict | None, str]:
    """The environment of the SGLang process listening on ``url``'s port, when it runs on this host
    and is readable; (None, why) otherwise."""
    import psutil

    p = urlparse(url)
    if p.hostname not in ("127.0.0.1", "localhost", "::1"):
        return None, f"{p.hostname} is not this host"
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, PermissionError):
        return None, "cannot list sockets (not root)"
    pids = {c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == p.port and c.pid}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            cmd = " ".join(proc.cmdline())
            if "sglang" not in cmd:
                return None, f"port {p.port} is served by pid {pid}, not an SGLang server ({cmd[:80]}): a proxy?"
            return proc.environ(), f"pid {pid}"
        except (psutil.NoSuchProcess, psutil.AccessDenied) as e:
            return None, f"pid {pid}: {e!r}"
    return None, f"no process of this host listens on port {p.port}"


def audit(prefill: str, decode: str, router: str | None = None, timeout: float = 15.0) -> dict:
    for name, u in (("prefill", prefill), ("decode", decode), ("router", router)):
        if u is not None and urlparse(u).scheme not in ("http", "https"):
            raise AuditError(f"--{name} {u!r}: expected an http(s) URL such as http://127.0.0.1:30000")
    infos = {"prefill": fetch_info(prefill, timeout), "decode": fetch_info(decode, timeout)}
    for role, info in infos.items():
        mode = field_of(info, "disaggregation_mode")
        if mode not in (None, role):
            raise AuditError(f"--{role} {prefill if role == 'prefill' else decode}: that server runs "
                             f"disaggregation_mode={mode!r}, not {role}")
    envs, env_src = {}, {}
    for role, url in (("prefill", prefill), ("decode", decode)):
        envs[role], env_src[role] = local_env(url)
    checks = [check_pool("prefill", infos["prefill"]), check_pool("decode", infos["decode"]), check_versions(infos)]
    for role in ("prefill", "decode"):
        checks.append(check_deferred(role, infos[role], envs[role]))
    for role in ("prefill", "decode"):
        checks.append(check_batch_bound(role, infos[role], envs[role]))
    checks.append(check_integrity(infos))
    if router:
        try:
            r = httpx.get(router.rstrip("/") + "/workers", timeout=timeout)
            ws = r.json().get("workers") if r.status_code == 200 else None
            checks.append(check_router(ws, prefill, decode, None if ws is not None else f"GET /workers: HTTP {r.status_code}"))
        except (httpx.HTTPError, ValueError) as e:
            checks.append(check_router(None, prefill, decode, f"router {router}: {e!r}"))
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, FAIL, UNKNOWN)}
    return {"targets": {"prefill": prefill, "decode": decode, "router": router}, "environment_source": env_src,
            "checks": [c.to_dict() for c in checks], "counts": counts}


def exit_code(result: dict, strict: bool = False) -> int:
    c = result["counts"]
    return 1 if c[FAIL] or (strict and c[UNKNOWN]) else 0
