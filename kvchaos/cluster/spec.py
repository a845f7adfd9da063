"""Cluster specification: what to launch (or attach to), loaded from a TOML profile.

Profiles ship in ``kvchaos/profiles/`` (``cpu``: the embedded CPU cluster these machines run;
``gpu``: CUDA + Mooncake RDMA, for nightly GPU CI). A profile may also be a path to a TOML file.
Any field can be overridden (``ClusterSpec.load("cpu", pool_tokens=4096)``).

Unknown keys and bad values raise :class:`SpecError` naming the key, the value and what is
allowed — a typo in a profile must never silently fall back to a default.

The defence arm (:data:`DEFENCES_ENV`, ``--kvchaos-defences``; docs/operations/gpu.md): SGLang's own KV
defences on both roles. A profile that can run it says how in a ``[defences]`` table (``prefill_args``,
``decode_args``: appended to the roles' own); :meth:`ClusterSpec.load` applies it when asked
(``defences=True``, or ``KVCHAOS_DEFENCES=1`` in the environment) and refuses it by name on a profile
without the table or on a device other than CUDA (:data:`DEFENCES_NEED_CUDA`).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvchaos.probe import like

from .layouts import ATTENTION, PACE_MAX, attention_of_model, of_spec, probe_kind_of_model

PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"
TRANSFER_BACKENDS = ("mooncake_tcp", "nixl", "mooncake")
ROUTERS = ("sglang-router", "mini-lb")
DEVICES = ("cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # --kv-cache-dtype: auto = the model's dtype
DEFENCES_ENV = "KVCHAOS_DEFENCES"
DEFENCES_KEYS = ("prefill_args", "decode_args")
SGLANG_DECODE_RESERVATION = 512  # SGLang's default --num-reserved-decode-tokens (srt/arg_groups/fields/disagg.py)
# why the defence arm is CUDA-only (sglang 0.5.23; the file:line evidence is in docs/operations/gpu.md)
DEFENCES_NEED_CUDA = (
    "--disaggregation-enable-kv-checksum and --kv-canary need CUDA devices: the checksum's Adler-32 computer "
    "is built on cuda: (sglang/srt/disaggregation/prefill.py:248, decode.py:486) and the canary's stamp "
    "kernels are CUDA-JIT only (other devices get a torch reference this project has never run); on cpu the "
    "defence arm cannot run")


class SpecError(ValueError):
    pass


@dataclass
class ClusterSpec:
    name: str = "cpu"
    engine: str = "sglang"
    engine_python: str = ""  # interpreter that runs the engine; "" = the harness's own
    # "tiny:<seed>", "probe" / "probe:<mha|gqa|mla>" / "probe:like:<name>" (built locally) or a model directory
    model: str = "tiny:0"
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: auto (the model's dtype) or fp8_e4m3 (not on cpu)
    pool_tokens: int = 2048  # --max-total-tokens on each server
    context_length: int = 4096
    page_size: int = 1
    transfer_backend: str = "mooncake_tcp"
    router: str = "sglang-router"
    cpu_compat: bool = True  # load kvchaos.cpucompat into every engine process
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 60.0
    # how many times longer a token takes here than on the profile's own probe (a like: probe on CPU: its
    # layers over the probe's, kvchaos.cluster.layouts.apply). Every time bound of a request — the suites'
    # and the experiment's timeouts, liveness's bound (read back from the history), the router's health
    # check — is its pace-1 figure times this; never anything a leak checker reads (PACE_MAX bounds it)
    pace: float = 1.0
    env: dict = field(default_factory=dict)
    common_args: list = field(default_factory=list)
    prefill_args: list = field(default_factory=list)
    decode_args: list = field(default_factory=list)
    router_args: list = field(default_factory=list)
    ib_device: str = ""  # RDMA device for transfer_backend=mooncake (GPU profile)
    agent: bool = True  # load the in-engine fault agent (faults/agent/) into every server process
    # how the harness reaches the agents: "unix" (their control directory on this host) or "tcp" (each
    # server's gateway with a shared token, faults/agent/net.py: no engine-side file is read)
    agent_channel: str = "unix"
    # "one-host": every server on this host's loopback; "two-hosts": prefill and decode each in a network
    # namespace of its own, reached over a bridge (kvchaos.cluster.netns; the agents over TCP)
    topology: str = "one-host"
    # fault proxy between client and router and between router and each server:
    # "" = none, "embedded" = faults/proxy/ in the harness, "host:port" = a real toxiproxy-server
    network_proxy: str = ""

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, profile: str | os.PathLike = "cpu", defences: bool | None = None, **overrides) -> "ClusterSpec":
        """The profile's ``[cluster]`` with ``overrides``; ``defences``: apply its ``[defences]`` arm
        (None: when :data:`DEFENCES_ENV` asks for it)."""
        path = Path(profile)
        if not (path.suffix == ".toml" and path.exists()):
            path = PROFILE_DIR / f"{profile}.toml"
            if not path.exists():
                avail = sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))
                raise SpecError(f"unknown profile {str(profile)!r}: not a .toml file and not one of {avail}")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise SpecError(f"profile {path}: invalid TOML: {e}") from None
        data = raw.get("cluster", raw)
        data.setdefault("name", path.stem)
        data.update({k: v for k, v in overrides.items() if v is not None})
        if defences if defences is not None else defences_requested():
            data = with_defences(data, raw.get("defences") if "cluster" in raw else None, str(path))
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> "ClusterSpec":
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise SpecError(f"{source}: unknown key(s) {unknown}; allowed: {sorted(known)}")
        kwargs = {}
        for k, v in data.items():
            want = known[k].type
            if want in ("int", "float") and isinstance(v, bool):
                raise SpecError(f"{source}: {k}={v!r} must be a number")
            if want == "int":
                if not isinstance(v, int):
                    raise SpecError(f"{source}: {k}={v!r} must be an integer")
            elif want == "float":
                if not isinstance(v, (int, float)):
                    raise SpecError(f"{source}: {k}={v!r} must be a number")
                v = float(v)
            elif want == "bool" and not isinstance(v, bool):
                raise SpecError(f"{source}: {k}={v!r} must be true or false")
            elif want == "str" and not isinstance(v, str):
                raise SpecError(f"{source}: {k}={v!r} must be a string")
            elif want == "list":
                if isinstance(v, str):
                    v = shlex.split(v)
                if not isinstance(v, list) or not all(isinstance(x, (str, int, float)) for x in v):
                    raise SpecError(f"{source}: {k}={v!r} must be a list of arguments")
                v = [str(x) for x in v]
            elif want == "dict":
                if not isinstance(v, dict):
                    raise SpecError(f"{source}: {k}={v!r} must be a table of strings")
                v = {str(a): str(b) for a, b in v.items()}
            kwargs[k] = v
        spec = cls(**kwargs)
        spec.validate(source)
        return spec

    def validate(self, source: str = "<spec>") -> None:
        def bad(msg):
            raise SpecError(f"{source}: {msg}")

        if self.engine != "sglang":
            bad(f"engine={self.engine!r}: only 'sglang' is supported")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            bad(f"transfer_backend={self.transfer_backend!r} not one of {TRANSFER_BACKENDS}")
        if self.router not in ROUTERS:
            bad(f"router={self.router!r} not one of {ROUTERS}")
        if self.device not in DEVICES:
            bad(f"device={self.device!r} not one of {DEVICES}")
        if self.transfer_backend == "mooncake" and self.device != "cuda":
            bad("transfer_backend='mooncake' (RDMA) needs device='cuda'; use 'mooncake_tcp' on CPU")
        if self.cpu_compat and self.device != "cpu":
            bad("cpu_compat=true only makes sense with device='cpu'")
        for k in ("pool_tokens", "context_length", "page_size"):
            if getattr(self, k) < 1:
                bad(f"{k}={getattr(self, k)} must be >= 1")
        if self.pool_tokens % self.page_size:
            bad(f"pool_tokens={self.pool_tokens} must be a multiple of page_size={self.page_size}")
        if self.startup_timeout_s <= 0 or self.request_timeout_s <= 0:
            bad("timeouts must be > 0")
        if isinstance(self.pace, bool) or not isinstance(self.pace, (int, float)) or not 1 <= self.pace <= PACE_MAX:
            bad(f"pace={self.pace!r} must be a number from 1 to {PACE_MAX} (how many times slower a token is "
                "than on the profile's own probe)")
        probe = probe_kind_of_model(self.model)
        like_name = like.name_of_kind(probe) if probe is not None else None
        if like_name is not None:
            try:
                like.geometry(like_name)
            except like.LikeError as e:
                bad(f"model={self.model!r}: {e}")
        elif probe is not None and probe not in ATTENTION:
            bad(f"model={self.model!r}: probe kind {probe!r} is not one of {ATTENTION} or like:<name>")
        if not (self.model.startswith("tiny:") or probe or Path(self.model).expanduser().exists()):
            bad(f"model={self.model!r} is neither 'tiny:<seed>', 'probe[:<kind>]' nor an existing model directory")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad(f"kv_cache_dtype={self.kv_cache_dtype!r} not one of {KV_CACHE_DTYPES}")
        if self.kv_cache_dtype == "fp8_e4m3" and self.device == "cpu":
            # SGLang 0.5.23 (mem_cache/kv_cache_configurator.py, configure): an FP8 KV cache on CPU is for MHA pools
            # only, with Intel AMX and the intel_amx attention backend (the CPU profile runs torch_native)
            backend = flag_value(self.common_args, "--attention-backend") or "the default"
            mla = attention_of_model(self.model) == "mla"
            if mla or backend != "intel_amx":
                bad(f"kv cache dtype fp8_e4m3 is not supported on cpu by SGLang with "
                    f"{'an MLA model' if mla else f'attention backend {backend}'}: SGLang 0.5.23 takes an FP8 KV cache "
                    "on CPU only for MHA/GQA models, with Intel AMX and --attention-backend intel_amx (on cpu use a "
                    "bf16/fp16/fp32 layout; fp8 on cuda)")
        if self.topology not in ("one-host", "two-hosts"):
            bad(f"topology={self.topology!r}: use 'one-host' or 'two-hosts' (prefill and decode in network "
                "namespaces of their own)")
        if self.agent_channel not in ("unix", "tcp"):
            bad(f"agent_channel={self.agent_channel!r}: use 'unix' (the agents' control directory) or 'tcp' "
                "(each server's agent gateway)")
        if self.network_proxy not in ("", "embedded"):
            host, _, port = self.network_proxy.rpartition(":")
            if not host or not port.isdigit():
                bad(f"network_proxy={self.network_proxy!r}: use '' (none), 'embedded' or host:port of a toxiproxy-server")
        if self.model.startswith("tiny:") and not self.model[5:].isdigit():
            bad(f"model={self.model!r}: the seed after 'tiny:' must be a non-negative integer")

    # ------------------------------------------------------------------ derived
    @property
    def python(self) -> str:
        return self.engine_python or sys.executable

    @property
    def layout(self) -> str:
        """The KV layout name (``kvchaos.cluster.layouts``): attention kind, page size, dtype."""
        return of_spec(self)

    @property
    def decode_reservation(self) -> int:
        """Decode's ``num_reserved_decode_tokens`` as this spec deploys it: the last
        ``--num-reserved-decode-tokens`` of its args, else SGLang's default. A running cluster's own value
        is in its ``/server_info``; this is for sizing a deployment before it starts."""
        got = flag_value([str(a) for a in [*self.common_args, *self.decode_args]], "--num-reserved-decode-tokens")
        return SGLANG_DECODE_RESERVATION if got is None else int(got)

    def paced(self, seconds: float) -> float:
        """A time bound set for the profile's own probe, at this cluster's :attr:`pace`."""
        return seconds * self.pace

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def defences_requested(environ=None) -> bool:
    """Whether the environment asks for the defence arm (``KVCHAOS_DEFENCES``: 1, true, yes or on)."""
    return (environ if environ is not None else os.environ).get(DEFENCES_ENV, "").strip().lower() in ("1", "true",
                                                                                                       "yes", "on")


def with_defences(data: dict, table, source: str = "<spec>") -> dict:
    """``data`` (a ``[cluster]`` table) with the profile's defence arm applied: each role's args from
    ``table`` (``[defences]``) appended to its own, once. Refused by name (:class:`SpecError`) on a device
    other than CUDA and for a profile without the table."""
    device = data.get("device", ClusterSpec.device)
    if device != "cuda":
        raise SpecError(f"{source}: the defence arm ({DEFENCES_ENV}=1 / --kvchaos-defences) on device={device!r}: "
                        f"{DEFENCES_NEED_CUDA}")
    if not isinstance(table, dict) or not table:
        raise SpecError(f"{source}: the defence arm ({DEFENCES_ENV}=1 / --kvchaos-defences) needs a [defences] "
                        f"table ({', '.join(DEFENCES_KEYS)}: the args that turn the defences on); this profile "
                        "has none")
    unknown = sorted(set(table) - set(DEFENCES_KEYS))
    if unknown:
        raise SpecError(f"{source}: [defences] unknown key(s) {unknown}; allowed: {', '.join(DEFENCES_KEYS)}")
    out = dict(data)
    for key in DEFENCES_KEYS:
        add = table.get(key, [])
        if not isinstance(add, list) or not all(isinstance(x, str) for x in add):
            raise SpecError(f"{source}: [defences] {key}={add!r} must be a list of arguments")
        have = list(out.get(key) or [])
        if isinstance(have, str):
            have = shlex.split(have)
        if not _contains(have, add):
            have = have + add
        out[key] = have
    return out


def _contains(args: list, part: list) -> bool:
    """``part`` appears in ``args`` as a contiguous run (the arm applied twice adds nothing)."""
    n = len(part)
    return n == 0 or any(args[i:i + n] == part for i in range(len(args) - n + 1))


def flag_value(args: list, flag: str) -> str | None:
    """The last value given to ``flag`` in an argument list (``--flag v`` or ``--flag=v``), or None."""
    got = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            got = args[i + 1]
        elif a.startswith(flag + "="):
            got = a.split("=", 1)[1]
    return got
