"""``kvchaos audit``: the GLM-5.3 incident's operator checklist, as checks on a running deployment.

    kvchaos audit --prefill URL --decode URL [--router URL] [--json]

Each check is PASS / FAIL / UNKNOWN with the numbers it judged and what to do:

* ``pool_vs_context``      each node's KV pool (``max_total_num_tokens``) against the declared context;
                           on decode, the pool minus ``num_reserved_decode_tokens`` (what a prompt can
                           get pre-allocated). A pool below the context is the incident's configuration:
                           prompts in between go down the reject path (pre-fix: leaked; 0.5.23: hang).
* ``engine_version``       each role's release as *measured* by ``kvchaos bisect`` (the committed
                           reports/releases/release_table.json; ``--release-table`` for another): FAIL
                           on a release measured to leak (or older than the oldest measured, which
                           leaked), PASS only on one measured clean, UNKNOWN otherwise (``kvchaos
                           bisect --releases V`` measures it). The message names the releases measured
                           to leak and the fixes with the first release that has them by the code
                           (reports/releases/code-reading.md: #36988 in 0.5.20, #38935 in 0.5.21);
                           open PR #38704 (transferred-length check) is in no release.
* ``deferred_kv_release``  ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE`` on each role (decode
                           keeps an aborted transfer's pages until in-flight writes drain). Not in
                           ``/server_info``: read from the server process's environment when it runs on
                           this host, else the release's default where kvchaos knows it, else UNKNOWN.
* ``mooncake_batch_bound`` ``SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES`` > 0 (bounded transfer batches;
                           0 = unbounded), same sources; not applicable to other transfer backends.
* ``kv_integrity``         ``--disaggregation-enable-kv-checksum`` on both roles, or ``--kv-canary``
                           log/raise (both CUDA-only in 0.5.23; absent from older releases).
* ``router_workers``       (with ``--router``) the router lists the audited prefill and decode, healthy.
* ``lb_first_token``       (with ``--router``; checklist item 5) the load balancer lets a request run
                           to its first token: one streaming and one non-streaming ``/generate`` with a
                           unique rid, the client gone 50 ms after sending; FAIL when prefill or decode
                           then counts an abort (``sglang:num_aborted_requests_total``), UNKNOWN when
                           a token came first or the metric is not exported. Sends two requests.

Exit status: 0 no FAIL, 1 at least one FAIL (``--strict``: UNKNOWN counts as FAIL), 2 bad input or an
unreachable node.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

from kvchaos import httpclient
from kvchaos import releases as R
from kvchaos.cluster.metrics import Metrics
from kvchaos.workload.snapshots import server_field

PASS, FAIL, UNKNOWN = "pass", "fail", "unknown"
FIXES = (("#36988", "prefill retires an aborted request's result before sending KV: _retire_aborted_prefill_result"),
         ("#38935", "a request rejected at intake is not admitted to the PD handoff: is_unadmitted_reject"))
OPEN_PRS = ("#38704 (decode checks the transferred KV length; open, in no release)",)
# defaults read in each release's own srt/environ.py (reports/releases/code-reading.md); others unknown
DEFERRED_DEFAULT = {"0.5.19": False, "0.5.20": False, "0.5.21": True, "0.5.22": True, "0.5.23": True}
BATCH_BOUND_SUPPORTED = {"0.5.19": False, "0.5.20": True, "0.5.21": True, "0.5.22": True, "0.5.23": True}
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


def field_of(info, key):
    """First value of ``key`` anywhere in a nested ``/server_info`` answer."""
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


def check_versions(infos: dict, table: dict | None = None, reading: dict | None = None) -> Check:
    """Each role's release judged by what it was *measured* to do (``kvchaos bisect``'s committed table,
    :func:`kvchaos.releases.assess`), not by PR numbers: FAIL when a role runs a release measured to
    leak (or older than one), PASS only when every role's release was measured clean, else UNKNOWN."""
    vers = {r: field_of(i, "version") for r, i in infos.items()}
    title = "engine release vs the measured release table"
    prs = {pr: (reading or {}).get("prs", {}).get(pr, {}).get("first_release") for pr, _ in FIXES}
    nums = {"versions": vers, "table": None, "fixes": {pr: {"what": what, "first_release_by_code": prs[pr]}
                                                       for pr, what in FIXES}, "open": list(OPEN_PRS)}
    if table is not None:
        d = table["derived"]
        nums["table"] = {"deployment": table["workload"].get("deployment", "incident"),
                         "measured": {r: row["verdict"] for r, row in table["releases"].items()},
                         "leaking": d["leaking"], "first_clean": d["first_clean"],
                         "writeup_first_fixed": d["writeup_first_fixed"], "disagreements": d["writeup_disagreements"]}
    per, bad = {}, []
    for role, v in vers.items():
        try:
            per[role] = R.assess(v, table)
        except ValueError:
            bad.append(f"{role}: {v!r}")
    nums["assessed"] = {r: a[0] for r, a in per.items()}
    fixes = "; ".join(f"{pr} ({what}; first in {prs[pr] or 'a release kvchaos has not read'} by the code)"
                      for pr, what in FIXES)
    leak = {r: why for r, (st, why) in per.items() if st == R.LEAKS}
    if leak:
        return Check("engine_version", "both", FAIL, title, nums,
                     "; ".join(f"{r}: {why}" for r, why in leak.items())
                     + f". Upgrade to a release measured clean (from {nums['table']['first_clean'] if table else '?'}). "
                     f"The fixes: {fixes}")
    unknown = {r: why for r, (st, why) in per.items() if st == R.UNMEASURED}
    if bad or unknown:
        return Check("engine_version", "both", UNKNOWN, title, nums,
                     "; ".join([f"no release version reported: {', '.join(bad)}"] if bad else []
                               + [f"{r}: {why}" for r, why in unknown.items()]))
    note = "" if len(set(vers.values())) == 1 else f"; roles run different releases: {vers}"
    return Check("engine_version", "both", PASS, title, nums,
                 "; ".join(f"{r}: {why}" for r, (_, why) in per.items()) + f"{note}; still open upstream: {OPEN_PRS[0]}")


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


ABORTS = "sglang:num_aborted_requests_total"  # TokenizerManager.abort_request, with --enable-metrics
REQUESTS = "sglang:num_requests_total"  # same collector (observability/metrics_collector.py)
LB_MODES = ("stream", "nonstream")


def check_lb_first_token(probes: list[dict]) -> Check:
    """Checklist item 5: the load balancer must let a request run at least to its first token (or
    never abort mid-transfer). Judged from :func:`lb_trial` results: a client that left before the
    first token must not have turned into an abort on prefill or decode."""
    title = "load balancer lets a request run to its first token"
    nums = {"probes": probes}
    seen = [p for p in probes if p.get("aborts") is not None and not p.get("token_before_close")]
    aborted = [p for p in seen if any((d or 0) > 0 for d in p["aborts"].values())]
    if aborted:
        p = aborted[0]
        where = ", ".join(f"{r} +{d:g}" for r, d in p["aborts"].items() if d)
        return Check("lb_first_token", "router", FAIL, title, nums,
                     f"{len(aborted)}/{len(seen)} probe(s): the client left {p['disconnect_ms']:.0f} ms after sending "
                     f"({p['mode']}, {p['bytes_before_close']} bytes received, no token) and the router turned it into "
                     f"abort(s) on {where} ({ABORTS}; rid {p['rid']}): aborts before the first token need "
                     "cross-node coordination (decode's pre-allocated pages, prefill's in-flight KV write). Keep the "
                     "LB from cancelling upstream before the first token (sglang-router 0.3.2 and mini-lb both "
                     "cancel streaming requests; see README). Counts any other abort in the window: audit a quiet "
                     "deployment.")
    why = [p.get("why") or "a token arrived before the disconnect (raise the prompt size or lower --lb-disconnect-ms)"
           for p in probes if p not in seen]
    if not seen or why:
        return Check("lb_first_token", "router", UNKNOWN, title, nums,
                     "; ".join(why) or "no probe ran")
    return Check("lb_first_token", "router", PASS, title, nums,
                 f"{len(seen)} probe(s) ({', '.join(p['mode'] for p in seen)}): the client left before the first token "
                 "and neither prefill nor decode counted an abort; the request ran on")


def lb_trial(router: str, prefill: str, decode: str, mode: str = "stream", *, prompt_tokens: int = 1000,
             disconnect_ms: float = 50.0, settle_s: float = 6.0, before_send=None, timeout: float = 15.0) -> dict:
    """Send one ``/generate`` through the router with a unique rid and close the connection
    ``disconnect_ms`` after sending (before the first token), then read whether prefill and decode
    counted an abort (``sglang:num_aborted_requests_total`` delta, read after ``settle_s``: SGLang
    notices a dropped non-streaming connection only at its 4 s poll). ``before_send(rid)`` may widen
    the window (a test arms a transfer delay on that rid)."""
    import socket
    import uuid

    if mode not in LB_MODES:
        raise AuditError(f"lb trial mode {mode!r}: one of {', '.join(LB_MODES)}")
    rid = f"kvchaos-audit-lb-{mode}-{uuid.uuid4().hex[:8]}"
    out = {"rid": rid, "mode": mode, "disconnect_ms": disconnect_ms, "prompt_tokens": prompt_tokens}
    before = {}
    for role, url in (("prefill", prefill), ("decode", decode)):
        try:
            before[role] = Metrics.fetch(url, timeout)
        except (httpx.HTTPError, ValueError) as e:
            return {**out, "aborts": None, "why": f"{role} {url}/metrics unreadable ({e!r}): run it with --enable-metrics"}
    if before_send is not None:
        before_send(rid)
    words = ("lorem ipsum dolor sit amet consectetur adipiscing elit sed do " * (prompt_tokens // 5 + 1))
    body = json.dumps({"text": words[:prompt_tokens], "rid": rid, "stream": mode == "stream",
                       "sampling_params": {"max_new_tokens": 32, "temperature": 0}}).encode()
    u = urlparse(router.rstrip("/") + "/generate")
    req = (f"POST {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port or 80}\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    got = b""
    try:
        with socket.create_connection((u.hostname, u.port or 80), timeout=timeout) as sock:
            sock.sendall(req)
            deadline = time.monotonic() + disconnect_ms / 1000
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                try:
                    chunk = sock.recv(65536)
                except socket.timeout:
                    break
                if not chunk:
                    break
                got += chunk
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
    except OSError as e:
        return {**out, "aborts": None, "why": f"router {router}: {e!r}"}
    head, _, rest = got.partition(b"\r\n\r\n")
    out.update(bytes_before_close=len(got), headers=head.split(b"\r\n")[0].decode(errors="replace") if got else None,
               token_before_close=b'"text"' in rest or b"data:" in rest)
    time.sleep(settle_s)
    aborts, after = {}, {}
    for role, url in (("prefill", prefill), ("decode", decode)):
        try:
            after[role] = Metrics.fetch(url, timeout)
        except (httpx.HTTPError, ValueError) as e:
            return {**out, "aborts": None, "why": f"{role} {url}/metrics unreadable after the probe ({e!r})"}
        aborts[role] = after[role].delta(before[role], ABORTS)
    # SGLang's multiprocess metrics declare a labelled counter only at its first increment; the
    # tokenizer collector that owns it (in 0.5.19-0.5.23) declares num_requests once any request ends
    blind = [r for r in after if not any(m.declares(x) for m in (before[r], after[r]) for x in (ABORTS, REQUESTS))]
    if blind:
        return {**out, "aborts": None, "why": f"{', '.join(blind)} exports neither {ABORTS} nor {REQUESTS} "
                                              "(--enable-metrics off, or a release kvchaos has not read)"}
    out["aborts"] = aborts
    return out


# --------------------------------------------------------------------------- gathering
def fetch_info(url: str, timeout: float = 15.0) -> dict:
    for path in ("/server_info", "/get_server_info"):
        try:
            r = httpclient.get(url.rstrip("/") + path, timeout=timeout)
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


def deployment_of(infos: dict) -> str:
    """Which measured deployment these servers run: with ``--allow-auto-truncate`` on either role a
    prompt over prefill's limit is truncated, not rejected — another path, another release table."""
    return "auto-truncate" if any(field_of(i, "allow_auto_truncate") for i in infos.values()) else "incident"


def release_evidence(path=None, deployment: str = "incident") -> tuple[dict | None, dict | None]:
    """The measured release table (``kvchaos bisect``; ``path``, or the committed one of the
    deployment the servers run) and the code reading of each release
    (reports/releases/code-reading.json), each None when absent."""
    if path is not None and not Path(path).exists():
        raise AuditError(f"--release-table {path}: no such file")
    try:
        return R.load_table(path or R.table_file(deployment)), R.load_code_reading()
    except (R.ReleaseError, ValueError) as e:
        raise AuditError(f"release evidence: {e}") from None


def audit(prefill: str, decode: str, router: str | None = None, timeout: float = 15.0,
          release_table: str | None = None, lb_modes=LB_MODES, lb_disconnect_ms: float = 50.0) -> dict:
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
    table, reading = release_evidence(release_table, deployment_of(infos))
    checks = [check_pool("prefill", infos["prefill"]), check_pool("decode", infos["decode"]),
              check_versions(infos, table, reading)]
    for role in ("prefill", "decode"):
        checks.append(check_deferred(role, infos[role], envs[role]))
    for role in ("prefill", "decode"):
        checks.append(check_batch_bound(role, infos[role], envs[role]))
    checks.append(check_integrity(infos))
    if router:
        try:
            r = httpclient.get(router.rstrip("/") + "/workers", timeout=timeout)
            ws = r.json().get("workers") if r.status_code == 200 else None
            checks.append(check_router(ws, prefill, decode, None if ws is not None else f"GET /workers: HTTP {r.status_code}"))
        except (httpx.HTTPError, ValueError) as e:
            checks.append(check_router(None, prefill, decode, f"router {router}: {e!r}"))
        if lb_modes:
            n = max(16, min(1000, (field_of(infos["prefill"], "max_req_input_len") or 1000) - 16))
            checks.append(check_lb_first_token([lb_trial(router, prefill, decode, m, prompt_tokens=n,
                                                         disconnect_ms=lb_disconnect_ms, timeout=timeout)
                                                for m in lb_modes]))
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, FAIL, UNKNOWN)}
    return {"targets": {"prefill": prefill, "decode": decode, "router": router}, "environment_source": env_src,
            "checks": [c.to_dict() for c in checks], "counts": counts}


def exit_code(result: dict, strict: bool = False) -> int:
    c = result["counts"]
    return 1 if c[FAIL] or (strict and c[UNKNOWN]) else 0
