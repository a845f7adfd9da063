"""What the commands share: configuration (``--config`` / ``[tool.kvchaos]``), usage errors, and the
option groups several subparsers carry (``common``: where a cluster comes from and where reports go;
``running``: how a pytest session of suites runs)."""

from __future__ import annotations

import argparse
from contextlib import contextmanager
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG_KEYS = {"profile": str, "model": str, "reports": str, "suites": list, "markers": str, "k": str, "attach": str,
               "backends": str, "verbose": bool, "prefill": str, "decode": str, "router": str, "strict": bool,
               "timeout": (int, float), "accept_known": bool, "blind_model": bool, "releases": str, "trials": int,
               "release_table": str, "lb_probe": str, "lb_disconnect_ms": (int, float),
               "deployment": str, "seed": (int, str)}


class UsageError(SystemExit):
    def __init__(self, msg: str):
        print(f"kvchaos: {msg}", file=sys.stderr)
        super().__init__(2)


def load_config(path: str | None) -> dict:
    """The ``[kvchaos]`` / ``[tool.kvchaos]`` table of ``path`` (or ./pyproject.toml), checked."""
    explicit = path is not None
    p = Path(path) if explicit else Path.cwd() / "pyproject.toml"
    if not p.exists():
        if explicit:
            raise UsageError(f"--config {p}: no such file")
        return {}
    try:
        doc = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{p}: invalid TOML: {e}")
    cfg = doc.get("tool", {}).get("kvchaos") or doc.get("kvchaos")
    if cfg is None:
        cfg = {k: v for k, v in doc.items() if k != "tool"} if explicit else {}
    if not isinstance(cfg, dict):
        raise UsageError(f"{p}: [kvchaos] must be a table")
    for k, v in cfg.items():
        if k not in CONFIG_KEYS:
            raise UsageError(f"{p}: unknown key {k!r} in the kvchaos table; known: {', '.join(sorted(CONFIG_KEYS))}")
        want = CONFIG_KEYS[k]
        if not isinstance(v, want) or (want is list and not all(isinstance(x, str) for x in v)):
            raise UsageError(f"{p}: key {k!r} = {v!r}: expected "
                             f"{'a list of strings' if want is list else getattr(want, '__name__', 'a number')}")
    return cfg


@contextmanager
def usage_errors(command: str, *errors: type[Exception]):
    """An error of ``errors`` raised inside (bad input the command's library named) becomes a
    :class:`UsageError` naming the command: its message, exit 2."""
    try:
        yield
    except errors as e:
        raise UsageError(f"{command}: {e}") from None


def subparser(sub, name: str, **kw) -> argparse.ArgumentParser:
    """``sub.add_parser(name, **kw)``; ``--config`` is accepted after the subcommand too (``main`` reads it
    before parsing, so here it is only swallowed)."""
    sp = sub.add_parser(name, **kw)
    sp.add_argument("--config", help=argparse.SUPPRESS)
    return sp


def common(sp, cfg: dict) -> None:
    """--profile, --model, --reports: the cluster a command stands up and where its reports go."""
    sp.add_argument("--profile", default=cfg.get("profile", "cpu"), help="cluster profile name or TOML path")
    sp.add_argument("--model", default=cfg.get("model"), help="tiny:SEED or a model directory")
    sp.add_argument("--reports", default=cfg.get("reports", "reports"), help="reports directory")


def verbose(sp, cfg: dict) -> None:
    sp.add_argument("--verbose", action=argparse.BooleanOptionalAction, default=cfg.get("verbose", False),
                    help="stream pytest's output instead of the progress bar")


def running(sp, cfg: dict) -> None:
    """The options of a pytest session of suites (``run``, ``repro``)."""
    sp.add_argument("--backends", default=cfg.get("backends"), help="KV transfer backends, e.g. mooncake_tcp,nixl")
    verbose(sp, cfg)
    sp.add_argument("--accept-known", action="store_true", default=cfg.get("accept_known", False),
                    help="known engine findings (kvchaos/findings.toml) matched for the running version are "
                         "KNOWN, not red [the profile's [policy] accept_known]")
    sp.add_argument("--strict", action="store_true", default=cfg.get("strict", False),
                    help="fail when a listed finding did not reproduce on a version it lists")
    sp.add_argument("--blind-model", action="store_true", default=cfg.get("blind_model", False),
                    help="declare a model that cannot echo canaries: isolation is not claimed (not red)")
