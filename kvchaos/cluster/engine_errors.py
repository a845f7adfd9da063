"""Engine failures that leave the server process alive and answering /health while it no longer works.

The signatures are data, beside the findings they explain: ``[[engine_error]]`` tables of
``kvchaos/findings.toml`` (name, role, pattern, explanation). A finding matches one by name
(``signature = { engine_error = "..." }``); the cluster scans its engines' logs for them
(:meth:`kvchaos.cluster.Cluster.engine_errors`) and the run heals what they broke.
"""

from __future__ import annotations

import os
import re
import time
import tomllib
from pathlib import Path

from kvchaos import FINDINGS_FILE


def load_engine_errors(path: str | Path = FINDINGS_FILE) -> dict[str, re.Pattern]:
    """name -> compiled pattern of every ``[[engine_error]]`` in the findings registry."""
    doc = tomllib.loads(Path(path).read_text())
    out = {}
    for i, e in enumerate(doc.get("engine_error", [])):
        name, pattern = e.get("name"), e.get("pattern")
        if not name or not pattern:
            raise ValueError(f"{path}: engine_error #{i} needs a name and a pattern")
        if name in out:
            raise ValueError(f"{path}: engine_error {name!r} listed twice")
        out[name] = re.compile(pattern)
    return out


ENGINE_ERRORS = load_engine_errors()


def scan_engine_errors(logs: dict, offsets: dict) -> list[dict]:
    """New matches of ``ENGINE_ERRORS`` in each role's log since the last scan (``offsets[role]`` holds
    the read position and the last lines, updated); each with the role, signature, the matching line
    and the lines before it (the traceback, also when it was read by an earlier scan)."""
    found = []
    for role, path in logs.items():
        try:
            size = os.path.getsize(path)
        except OSError:
            continue
        st = offsets.setdefault(role, {"pos": 0, "tail": []})
        if size < st["pos"]:  # the log was replaced
            st.update(pos=0, tail=[])
        with open(path, "rb") as f:
            f.seek(st["pos"])
            chunk = f.read(size - st["pos"])
        end = chunk.rfind(b"\n") + 1  # only whole lines; the rest is read next time
        st["pos"] += end
        lines = st["tail"] + chunk[:end].decode("utf-8", "replace").splitlines()
        for i in range(len(st["tail"]), len(lines)):
            for sig, rx in ENGINE_ERRORS.items():
                m = rx.search(lines[i])
                if m:
                    found.append({"role": role, "signature": sig, "line": lines[i].strip(), **m.groupdict(),
                                  "traceback": "\n".join(lines[max(0, i - 20):i + 1]), "log": str(path),
                                  "wall": time.time()})
        st["tail"] = lines[-20:]
    return found
