"""kvchaos boot hook, imported by every Python process whose PYTHONPATH holds this directory.

The launcher puts ``kvchaos/_boot`` first on PYTHONPATH for every engine process it starts, so
SGLang's own subprocesses (scheduler, detokenizer, spawned with multiprocessing) load it too.

- ``KVCHAOS_CPU_COMPAT=1``: install ``kvchaos.cpucompat`` (CPU profile only).
- ``KVCHAOS_SWITCH_INTERVAL=<seconds>``: ``sys.setswitchinterval`` in every engine process (a
  measurement amplifier for thread races, e.g. the Mooncake worker-death provoke script's plain-load
  trials; never set by a profile).
- ``KVCHAOS_AGENT=<spec>``: load the in-engine fault agent: the module the cluster names in
  ``KVCHAOS_BOOT_AGENT`` (its ``boot()`` is called). This hook imports nothing of the fault layer by
  name; the cluster passes on what the fault layer registered (``kvchaos.cluster.hooks``).

Failures in the compat layer are fatal on purpose (a half-patched engine gives misleading
results); the error names the package and version.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_repo = os.path.dirname(os.path.dirname(_here))
if _repo not in sys.path:
    sys.path.append(_repo)

if os.environ.get("KVCHAOS_SWITCH_INTERVAL"):
    _si = os.environ["KVCHAOS_SWITCH_INTERVAL"]
    try:
        sys.setswitchinterval(float(_si))
    except ValueError as e:  # a measurement that silently ran at the default would lie
        raise SystemExit(f"kvchaos: KVCHAOS_SWITCH_INTERVAL={_si!r} is not a positive number of seconds: {e}")

if os.environ.get("KVCHAOS_CPU_COMPAT") == "1":
    from kvchaos import cpucompat

    cpucompat.install()

if os.environ.get("KVCHAOS_AGENT"):
    import importlib

    _name = os.environ.get("KVCHAOS_BOOT_AGENT", "")
    try:
        _agent = importlib.import_module(_name) if _name else None
    except ModuleNotFoundError as e:  # only when the agent module itself is absent
        if not _name.startswith(str(e.name)):
            raise
        _agent = None
    if _agent is None:
        sys.stderr.write(f"kvchaos: KVCHAOS_AGENT set but the agent module {_name!r} (KVCHAOS_BOOT_AGENT) "
                         "is unavailable; agent not loaded\n")
    else:
        _agent.boot()

# Chain to any other sitecustomize further down the path (GPU images often ship one), after the
# compat layer and the agent. One level only: whatever that one chains to is its own business. It
# runs as a module of its own under a private name, registered in sys.modules, so it can import,
# keep globals and see its own ``__file__``, while ``import sitecustomize`` still gives this module.
_CHAINED_NAME = "_kvchaos_chained_sitecustomize"


def _is_boot_dir(entry) -> bool:
    """Whether the sys.path ``entry`` is this directory, however spelt (relative, "/.", symlink, bind mount)."""
    if not isinstance(entry, str):
        return False
    path = entry or "."
    try:
        return os.path.realpath(path) == os.path.realpath(_here) or os.path.samefile(path, _here)
    except (OSError, ValueError):  # a missing directory, a zip file, a path hook's marker string
        return False


def _chain_sitecustomize() -> None:
    if _CHAINED_NAME in sys.modules:  # already chained in this process; never twice
        return
    origin = "sitecustomize"
    try:
        import importlib.machinery as m
        import importlib.util as u

        rest = [p for p in sys.path if isinstance(p, str) and not _is_boot_dir(p)]
        spec = m.PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.loader is None:
            return
        origin = spec.origin or origin
        if spec.has_location and os.path.exists(origin) and os.path.samefile(origin, __file__):
            return  # this very file (a hard link, a bind mount of it): never chain to ourselves
        if isinstance(spec.loader, (m.SourceFileLoader, m.SourcelessFileLoader)):
            # a file loader only serves the name it was made for; make one for the private name
            loader = type(spec.loader)(_CHAINED_NAME, origin)
            spec = u.spec_from_file_location(_CHAINED_NAME, origin, loader=loader,
                                              submodule_search_locations=spec.submodule_search_locations)
        # any other loader (extension module, zip) keeps its own name inside; only sys.modules differs
        module = u.module_from_spec(spec)
        sys.modules[_CHAINED_NAME] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(_CHAINED_NAME, None)
            raise
    except Exception as e:
        msg = " ".join(str(e).split()) or "(no message)"
        sys.stderr.write(f"kvchaos: chained sitecustomize failed ({origin}): {type(e).__name__}: {msg}\n")


_chain_sitecustomize()
