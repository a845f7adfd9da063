"""Helpers shared by the harness's own tests."""

import importlib.util
import os


def child_env(**extra) -> dict:
    """This environment for a child kvchaos/pytest process, without the outer pytest's and kvchaos'
    own variables (a child must pick its own run id, reports dir and xdist role)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "KVCHAOS_"))}
    return {**env, **extra}


def load_file(path, name: str):
    """The Python file at ``path`` (a bench or script outside any package) as a fresh module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def written(path) -> bool:
    """The file is there with its text: a child's ``write_text`` creates it empty first, and a reader
    that looks in between reads '' (make test runs these tests beside two cluster sessions)."""
    try:
        return bool(path.read_text())
    except FileNotFoundError:
        return False
