"""Helpers shared by the harness's own tests."""

import os


def child_env(**extra) -> dict:
    """This environment for a child kvchaos/pytest process, without the outer pytest's and kvchaos'
    own variables (a child must pick its own run id, reports dir and xdist role)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "KVCHAOS_"))}
    return {**env, **extra}
