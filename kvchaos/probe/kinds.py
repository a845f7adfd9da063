"""The probe kinds, where the committed one lives, and the digest of what a built one is made from."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

PROBE_KINDS = ("mha", "gqa", "mla")  # the hand-written kinds; like:<name> kinds come from kvchaos.probe.like
_HERE = Path(__file__).resolve().parent
COMMITTED = _HERE / "model"
# pace (kvchaos.cluster.spec.ClusterSpec.pace): on CPU every layer of a probe is computed, so a token costs
# its layers over the 2-layer probes' (mha/gqa/mla), capped so that no time bound stretches without limit.
# Here, not in a recipe file: a probe's weights do not depend on them
PROBE_LAYERS = 2
PACE_MAX = 64.0
RECIPE_FILES = ("build.py", "circuit.py", "mla.py")  # the builders' source, hashed into the digest
LIKE_RECIPE_FILES = (*RECIPE_FILES, "like.py")  # a like probe's: the builders and the geometry's derivation


def recipe_digest(kind: str) -> str:
    """Digest of everything a built probe of ``kind`` is made from: the builders' source and the
    (committed) tokenizer; for a like probe also its config's geometry. Computed without importing numpy."""
    # on use: the package imports this module, and `python -m kvchaos.probe.like` must find like unimported
    from kvchaos.probe import like

    name = like.name_of_kind(kind)
    h = hashlib.sha256(kind.encode())
    for f in (*(_HERE / n for n in (RECIPE_FILES if name is None else LIKE_RECIPE_FILES)), COMMITTED / "tokenizer.json"):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    if name is not None:
        h.update(json.dumps(like.geometry(name).to_dict(), sort_keys=True).encode())
    return h.hexdigest()[:12]


def _check_kind(kind: str) -> None:
    from kvchaos.probe import like  # on use, as in recipe_digest

    name = like.name_of_kind(kind)
    if name is not None:
        like.geometry(name)  # LikeError (a ValueError) naming the config and field
        return
    if kind not in PROBE_KINDS:
        raise ValueError(f"unknown probe kind {kind!r}: valid kinds are {', '.join(PROBE_KINDS)} and like:<name> "
                         f"({', '.join(like.names())})")
