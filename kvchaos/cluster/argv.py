"""How an engine and the router are started: their command lines, their environment (the boot hook on
``PYTHONPATH``) and the model directory they serve."""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

from kvchaos.model import is_complete, tiny_model_dir
from kvchaos.probe import ensure_probe, reaching

from .layouts import probe_kind_of_model
from .reaper import ENV_KEY
from .spec import ClusterSpec, SpecError, flag_value

REPO_ROOT = Path(__file__).resolve().parents[2]
BOOT_DIR = REPO_ROOT / "kvchaos" / "_boot"
LOOPBACK = "127.0.0.1"
HEALTH_TIMEOUT_FLAG = "--health-check-timeout-secs"
ROUTER_HEALTH_TIMEOUT_S = 5  # sglang-router 0.3.2's default (RouterArgs.health_check_timeout_secs)


def engine_env(spec: ClusterSpec, extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV_KEY}
    pp = [str(BOOT_DIR), str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(pp))
    if spec.cpu_compat:
        env["KVCHAOS_CPU_COMPAT"] = "1"
    else:
        env.pop("KVCHAOS_CPU_COMPAT", None)
    if spec.transfer_backend == "mooncake_tcp":
        env.setdefault("MC_FORCE_TCP", "1")
    env.update(spec.env)
    env.update(extra or {})
    return env


def server_argv(spec: ClusterSpec, model_path: str, role: str, port: int, bootstrap_port: int | None = None,
                host: str = LOOPBACK) -> list[str]:
    """argv for one SGLang server. role: 'prefill' | 'decode' | 'single'; ``host``: the address it
    serves on (its namespace's, in the two-hosts topology)."""
    if role not in ("prefill", "decode", "single"):
        raise ValueError(f"unknown role {role!r}")
    argv = [
        spec.python, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--device", spec.device,
        "--dtype", spec.dtype,
        *(["--kv-cache-dtype", spec.kv_cache_dtype] if spec.kv_cache_dtype != "auto" else []),
        "--max-total-tokens", str(spec.pool_tokens),
        "--context-length", str(spec.context_length),
        "--page-size", str(spec.page_size),
        "--host", host, "--port", str(port),
        "--enable-metrics",
    ]
    argv += spec.common_args
    if role == "single":
        return argv
    argv += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", spec.transfer_backend]
    if spec.transfer_backend == "mooncake" and (spec.ib_device or os.environ.get("KVCHAOS_IB_DEVICE")):
        argv += ["--disaggregation-ib-device", spec.ib_device or os.environ["KVCHAOS_IB_DEVICE"]]
    if role == "prefill":
        if bootstrap_port is None:
            raise ValueError("prefill needs a bootstrap port")
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)] + spec.prefill_args
    else:
        argv += spec.decode_args
    return argv


def router_argv(spec: ClusterSpec, prefill_url: str, bootstrap_port: int, decode_url: str, port: int,
                metrics_port: int | None = None) -> list[str]:
    """sglang-router argv. Its Prometheus exporter binds a fixed port (29000) unless told otherwise,
    so two clusters on one host collide: every router gets a reserved ``metrics_port``."""
    argv = [
        spec.python, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", prefill_url, str(bootstrap_port),
        "--decode", decode_url,
        "--host", LOOPBACK, "--port", str(port),
    ]
    if spec.router == "mini-lb":
        argv.append("--mini-lb")
    elif metrics_port is not None:
        argv += ["--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port)]
    if spec.router == "sglang-router" and spec.pace > 1 and not flag_value(spec.router_args, HEALTH_TIMEOUT_FLAG):
        # its health check is a generate on each worker, 3 timeouts in a row take the worker out: at a slower
        # pace a busy engine misses it and every request gets 503 "No available prefill workers" (measured on
        # like:llama-3.1-8b, docs/reference/layouts-and-backends.md). A profile's own value wins.
        argv += [HEALTH_TIMEOUT_FLAG, str(math.ceil(spec.paced(ROUTER_HEALTH_TIMEOUT_S)))]
    return argv + spec.router_args


def resolve_model(spec: ClusterSpec) -> str:
    """The model directory ``spec.model`` names; a ``tiny:<seed>`` model is generated on first use in
    the engine's interpreter (which has torch), so the harness itself never imports torch."""
    kind = probe_kind_of_model(spec.model)  # mha | gqa | mla | like:<name>
    if kind is not None:  # served from a copy whose positions reach the context where the probe's do not
        return str(reaching(ensure_probe(kind), spec.context_length))
    if spec.model.startswith("tiny:"):
        seed = int(spec.model[5:])
        path = tiny_model_dir(seed)
        if not is_complete(path):
            r = subprocess.run([spec.python, "-m", "kvchaos.model", str(seed)], env=engine_env(spec),
                               capture_output=True, text=True, timeout=600)
            if r.returncode != 0 or not is_complete(path):
                raise SpecError(f"generating tiny model (seed {seed}) failed:\n{r.stderr[-3000:]}")
        return str(path)
    return str(Path(spec.model).expanduser().resolve())
