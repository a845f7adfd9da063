"""kvchaos boot hook, imported by every Python process whose PYTHONPATH holds this directory.

The launcher puts ``kvchaos/_boot`` first on PYTHONPATH for every engine process it starts, so
SGLang's own subprocesses (scheduler, detokenizer, spawned with multiprocessing) load it too.

- ``KVCHAOS_CPU_COMPAT=1``: install ``kvchaos.cpucompat`` (CPU profile only).
- ``KVCHAOS_AGENT=<spec>``: load the in-engine fault agent (``faults.agent``), if present.

Failures in the compat layer are fatal on purpose (a half-patched engine gives misleading
results); the error names the package and version.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_repo = os.path.dirname(os.path.dirname(_here))
if _repo not in sys.path:
    sys.path.append(_repo)

if os.environ.get("KVCHAOS_CPU_COMPAT") == "1":
    from kvchaos import cpucompat

    cpucompat.install()

if os.environ.get("KVCHAOS_AGENT"):
    try:
        import faults.agent as _agent  # noqa: F401
    except ModuleNotFoundError as e:  # only when the agent module itself is absent
        if e.name not in ("faults.agent", "faults"):
            raise
        sys.stderr.write(f"kvchaos: KVCHAOS_AGENT set but faults.agent unavailable: {e}\n")
    else:
        _agent.boot()

# chain to any other sitecustomize further down the path (e.g. the distro's)
try:
    import importlib.machinery as _m
    import importlib.util as _u

    _rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    _spec = _m.PathFinder.find_spec("sitecustomize", _rest)
    if _spec and _spec.origin and os.path.dirname(os.path.abspath(_spec.origin)) != _here:
        _spec.name = "_kvchaos_chained_sitecustomize"
        _spec.loader.exec_module(_u.module_from_spec(_spec))
except Exception as _e:  # pragma: no cover
    sys.stderr.write(f"kvchaos: chained sitecustomize failed: {_e}\n")
