"""The probe kinds, where the committed one lives, and the digest of what a built one is made from."""

from __future__ import annotations

import hashlib
from pathlib import Path

PROBE_KINDS = ("mha", "gqa", "mla")
_HERE = Path(__file__).resolve().parent
COMMITTED = _HERE / "model"
RECIPE_FILES = ("build.py", "circuit.py", "mla.py")  # the builders' source, hashed into the digest


def recipe_digest(kind: str) -> str:
    """Digest of everything a built probe of ``kind`` is made from: the builders' source and the
    (committed) tokenizer. Computed without importing numpy."""
    h = hashlib.sha256(kind.encode())
    for f in (*(_HERE / n for n in RECIPE_FILES), COMMITTED / "tokenizer.json"):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def _check_kind(kind: str) -> None:
    if kind not in PROBE_KINDS:
        raise ValueError(f"unknown probe kind {kind!r}: valid kinds are {', '.join(PROBE_KINDS)}")
