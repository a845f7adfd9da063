"""Cluster specification: what to launch (or attach to), loaded from a TOML profile.

Profiles ship in ``kvchaos/profiles/`` (``cpu``: the embedded CPU cluster these machines run;
``gpu``: CUDA + Mooncake RDMA, for nightly GPU CI). A profile may also be a path to a TOML file.
Any field can be overridden (``ClusterSpec.load("cpu", pool_tokens=4096)``).

Unknown keys and bad values raise :class:`SpecError` naming the key, the value and what is
allowed — a typo in a profile must never silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .layouts import ATTENTION, attention_of_model, of_spec

PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"
TRANSFER_BACKENDS = ("mooncake_tcp", "nixl", "mooncake")
ROUTERS = ("sglang-router", "mini-lb")
DEVICES = ("cpu", "cuda")


class SpecError(ValueError):
    pass


@dataclass
class ClusterSpec:
    name: str = "cpu"
    engine: str = "sglang"
    engine_python: str = ""  # interpreter that runs the engine; "" = the harness's own
    model: str = "tiny:0"  # "tiny:<seed>", "probe" / "probe:<mha|gqa|mla>" (built locally) or a model directory
    device: str = "cpu"
    dtype: str = "float32"
    pool_tokens: int = 2048  # --max-total-tokens on each server
    context_length: int = 4096
    page_size: int = 1
    transfer_backend: str = "mooncake_tcp"
    router: str = "sglang-router"
    cpu_compat: bool = True  # load kvchaos.cpucompat into every engine process
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 60.0
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
    def load(cls, profile: str | os.PathLike = "cpu", **overrides) -> "ClusterSpec":
        path = Path(profile)
        if not (path.suffix == ".toml" and path.exists()):
            path = PROFILE_DIR / f"{profile}.toml"
            if not path.exists():
                avail = sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))
                raise SpecError(f"unknown profile {str(profile)!r}: not a .toml file and not one of {avail}")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise SpecError(f"profile {path}: invalid TOML: {e}") from None
        data = data.get("cluster", data)
        data.setdefault("name", path.stem)
        data.update({k: v for k, v in overrides.items() if v is not None})
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
        probe = attention_of_model(self.model)
        if probe is not None and probe not in ATTENTION:
            bad(f"model={self.model!r}: probe kind {probe!r} is not one of {ATTENTION}")
        if not (self.model.startswith("tiny:") or probe or Path(self.model).expanduser().exists()):
            bad(f"model={self.model!r} is neither 'tiny:<seed>', 'probe[:<kind>]' nor an existing model directory")
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
