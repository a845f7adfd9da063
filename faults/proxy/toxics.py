"""The fault model: toxic types and their attributes, a toxic's state and draws, and validation of
what the API is given (the errors it answers with)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

TOXIC_TYPES = {
    "latency": {"latency": 0, "jitter": 0},
    "bandwidth": {"rate": 0},
    "slow_close": {"delay": 0},
    "timeout": {"timeout": 0},
    "reset_peer": {"timeout": 0},
    "limit_data": {"bytes": 0},
    "slicer": {"average_size": 0, "size_variation": 0, "delay": 0},
}
STREAMS = ("upstream", "downstream")


class ApiError(Exception):
    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status, self.msg = status, msg


@dataclass
class Toxic:
    name: str
    type: str
    stream: str
    toxicity: float
    attributes: dict
    fired: dict = field(default_factory=lambda: {"connections": 0, "chunks": 0, "bytes": 0})
    added_at: float = field(default_factory=time.monotonic)
    # its draws (toxicity per connection, latency jitter, slice sizes): seeded by the ``seed``
    # attribute (kvchaos' extension; a run's seed reaches its network faults through it)
    rng: random.Random = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.rng is None:
            seed = self.attributes.get("seed")
            self.rng = random.Random(int(seed)) if seed is not None else random.Random()

    @classmethod
    def from_body(cls, body: dict) -> "Toxic":
        if not isinstance(body, dict):
            raise ApiError(400, "toxic: body must be a JSON object")
        ttype = body.get("type")
        if ttype not in TOXIC_TYPES:
            raise ApiError(400, f"toxic: unknown type {ttype!r}; one of {sorted(TOXIC_TYPES)}")
        stream = body.get("stream") or "downstream"
        if stream not in STREAMS:
            raise ApiError(400, f"toxic: stream must be one of {STREAMS}, got {stream!r}")
        tox = body.get("toxicity", 1.0)
        if not isinstance(tox, (int, float)) or not 0.0 <= tox <= 1.0:
            raise ApiError(400, f"toxic: toxicity must be a number in [0, 1], got {tox!r}")
        attrs = dict(TOXIC_TYPES[ttype])
        attrs.update(_check_attrs(ttype, body.get("attributes") or {}))
        name = body.get("name") or f"{ttype}_{stream}"
        return cls(name=name, type=ttype, stream=stream, toxicity=float(tox), attributes=attrs)

    def as_dict(self) -> dict:
        return {"name": self.name, "type": self.type, "stream": self.stream, "toxicity": self.toxicity,
                "attributes": self.attributes, "fired": dict(self.fired)}


def _check_attrs(ttype: str, attrs: dict) -> dict:
    if not isinstance(attrs, dict):
        raise ApiError(400, f"toxic {ttype}: attributes must be an object")
    allowed = {**TOXIC_TYPES[ttype], "seed": 0}  # seed: every type (its draws), kvchaos' extension
    out = {}
    for k, v in attrs.items():
        if k not in allowed:
            raise ApiError(400, f"toxic {ttype}: unknown attribute {k!r}; allowed {sorted(allowed)}")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise ApiError(400, f"toxic {ttype}: attribute {k} must be a non-negative number, got {v!r}")
        out[k] = v
    return out


def _split_hostport(s: str, what: str) -> tuple[str, int]:
    if not isinstance(s, str) or ":" not in s:
        raise ApiError(400, f"{what} must be host:port, got {s!r}")
    host, _, port = s.rpartition(":")
    try:
        p = int(port)
    except ValueError:
        raise ApiError(400, f"{what} port is not a number: {s!r}") from None
    if not 0 <= p < 65536:
        raise ApiError(400, f"{what} port out of range: {s!r}")
    return host or "127.0.0.1", p


def _slice(data: bytes, a: dict, rng: random.Random) -> list[bytes]:
    avg = int(a.get("average_size") or 0)
    var = int(a.get("size_variation") or 0)
    if avg <= 0:
        return [data]
    out, i = [], 0
    while i < len(data):
        n = max(1, avg + rng.randint(-var, var) if var else avg)
        out.append(data[i:i + n])
        i += n
    return out
