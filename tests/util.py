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


def agent_process_result(script: str, ctl_dir, role: str = "decode", timeout: float = 300) -> dict:
    """Run ``script`` in a child Python booted as an engine process of ``role`` is (``KVCHAOS_AGENT`` /
    ``KVCHAOS_AGENT_ROLE``: the agent hooks SGLang's classes as they import) and return the JSON it printed
    after ``RESULT `` (the test fails with the child's output when there is none)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "KVCHAOS_AGENT": str(ctl_dir), "KVCHAOS_AGENT_ROLE": role,
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env.pop("KVCHAOS_CPU_COMPAT", None)
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout,
                       cwd=str(repo))
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, f"rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(line[len("RESULT "):])


def once_per_session(tmp_path_factory, name: str, compute):
    """``compute()``'s JSON-able result, computed once per pytest session: under xdist the first worker to
    ask computes it under a lock and the others read it (a module- or session-scoped fixture runs once per
    worker, and a child that imports SGLang costs ~10 s of CPU each time)."""
    import fcntl
    import json

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return compute()
    shared = tmp_path_factory.getbasetemp().parent  # this session's base directory, shared by its workers
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / f"{name}.json"
        if not done.exists():
            done.write_text(json.dumps(compute()))
        return json.loads(done.read_text())
