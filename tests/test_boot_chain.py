"""The boot hook (kvchaos/_boot/sitecustomize.py) chains to another sitecustomize further down the path.

Each case starts a fresh interpreter with the boot dir first on PYTHONPATH, as the launcher does for
every engine process, and looks at what ran and what was printed.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BOOT = REPO / "kvchaos" / "_boot"
PRIVATE = "_kvchaos_chained_sitecustomize"

# what the child prints after start-up: which module `import sitecustomize` gives, and the chained one
PROBE = textwrap.dedent(f"""
    import json, sys
    import sitecustomize
    chained = sys.modules.get({PRIVATE!r})
    print("ok")
    print("PROBE " + json.dumps({{
        "sitecustomize": getattr(sitecustomize, "__file__", None),
        "chained": getattr(chained, "__file__", None) if chained is not None else None,
    }}))
""")

OTHER = textwrap.dedent("""
    import json
    import os

    import _other_helper  # a module next to it: imports work

    MARK = _other_helper.VALUE


    def _payload():  # reads a global of this module at call time
        return {"file": __file__, "name": __name__, "spec": __spec__.name, "mark": MARK}


    with open(os.environ["KVCHAOS_TEST_MARKER"], "a") as fh:
        fh.write(json.dumps(_payload()) + "\\n")
    print("OTHER-SITECUSTOMIZE-RAN")
""")

FAKE_AGENT = textwrap.dedent("""
    import os


    def boot():
        with open(os.environ["KVCHAOS_TEST_BOOT_LOG"], "a") as fh:
            fh.write("boot\\n")
""")


def _env(pythonpath, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "KVCHAOS_")) and k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return {**env, **extra}


def _run(tmp_path, env) -> subprocess.CompletedProcess:
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def _probe(proc) -> dict:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0][len("PROBE "):])


def _other_dir(tmp_path, body=OTHER) -> Path:
    d = tmp_path / "other"
    d.mkdir()
    (d / "sitecustomize.py").write_text(body)
    (d / "_other_helper.py").write_text("VALUE = 'chained-ok'\n")
    return d


def _markers(path: Path) -> list:
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def _same(a, b) -> bool:
    return a is not None and os.path.samefile(a, b)


def test_other_sitecustomize_runs_once_as_its_own_module(tmp_path):
    other = _other_dir(tmp_path)
    marker = tmp_path / "marker.jsonl"
    proc = _run(tmp_path, _env([BOOT, other], KVCHAOS_TEST_MARKER=str(marker)))

    assert proc.returncode == 0, proc.stderr
    assert "chained sitecustomize failed" not in proc.stderr
    assert "kvchaos:" not in proc.stderr, proc.stderr
    assert proc.stdout.count("OTHER-SITECUSTOMIZE-RAN") == 1, proc.stdout
    runs = _markers(marker)
    assert len(runs) == 1, runs
    (run,) = runs
    assert _same(run["file"], other / "sitecustomize.py")
    assert run["name"] == run["spec"] == PRIVATE
    assert run["mark"] == "chained-ok"

    probe = _probe(proc)
    assert _same(probe["sitecustomize"], BOOT / "sitecustomize.py")  # `import sitecustomize` is still ours
    assert _same(probe["chained"], other / "sitecustomize.py")


def test_failing_other_sitecustomize_is_named_and_does_not_break_boot(tmp_path):
    other = _other_dir(tmp_path, body="import os\nraise RuntimeError('boom from the image')\n")
    proc = _run(tmp_path, _env([BOOT, other]))

    assert proc.returncode == 0, proc.stderr
    assert "ok" in proc.stdout.splitlines()
    lines = [ln for ln in proc.stderr.splitlines() if "chained sitecustomize" in ln]
    assert len(lines) == 1, proc.stderr
    (line,) = lines
    assert str(other / "sitecustomize.py") in line
    assert "RuntimeError" in line and "boom from the image" in line
    assert "Traceback" not in proc.stderr  # one clear line, not a dump
    probe = _probe(proc)
    assert _same(probe["sitecustomize"], BOOT / "sitecustomize.py")
    assert probe["chained"] is None  # a failed one is not left half-registered


def test_boot_dir_twice_on_the_path_via_symlink_runs_ours_once(tmp_path):
    alias = tmp_path / "boot-alias"
    alias.symlink_to(BOOT, target_is_directory=True)
    other = _other_dir(tmp_path)
    # a stand-in agent package counts how often our hook runs (each run calls the named module's boot())
    agent_dir = tmp_path / "agentpkg"
    (agent_dir / "standin").mkdir(parents=True)
    (agent_dir / "standin" / "__init__.py").write_text("")
    (agent_dir / "standin" / "agent.py").write_text(FAKE_AGENT)
    marker, boot_log = tmp_path / "marker.jsonl", tmp_path / "boot.log"

    # the same boot dir as a different string too (trailing "/.")
    env = _env([BOOT, alias, f"{BOOT}/.", agent_dir, other], KVCHAOS_AGENT="test", KVCHAOS_BOOT_AGENT="standin.agent",
               KVCHAOS_TEST_MARKER=str(marker), KVCHAOS_TEST_BOOT_LOG=str(boot_log))
    proc = _run(tmp_path, env)

    assert proc.returncode == 0, proc.stderr
    assert "chained sitecustomize failed" not in proc.stderr
    assert "RecursionError" not in proc.stderr
    assert boot_log.read_text().splitlines() == ["boot"]  # ours ran exactly once
    runs = _markers(marker)
    assert len(runs) == 1, runs  # and the real other one, found past both aliases, once
    assert _same(runs[0]["file"], other / "sitecustomize.py")
    probe = _probe(proc)
    assert _same(probe["sitecustomize"], BOOT / "sitecustomize.py")
    assert _same(probe["chained"], other / "sitecustomize.py")


def test_the_boot_hook_loads_the_agent_the_cluster_names_and_nothing_else(tmp_path):
    """The hook imports no fault module by name: it boots the module in KVCHAOS_BOOT_AGENT (what the
    cluster passes on from kvchaos.cluster.hooks), and says so when that module is missing."""
    agent_dir = tmp_path / "agentpkg"
    agent_dir.mkdir()
    (agent_dir / "my_agent.py").write_text(FAKE_AGENT)
    boot_log = tmp_path / "boot.log"
    ok = _run(tmp_path, _env([BOOT, agent_dir], KVCHAOS_AGENT="test", KVCHAOS_BOOT_AGENT="my_agent",
                             KVCHAOS_TEST_BOOT_LOG=str(boot_log)))
    assert ok.returncode == 0, ok.stderr
    assert boot_log.read_text().splitlines() == ["boot"]
    for name in ("", "no_such_agent_module"):
        proc = _run(tmp_path, _env([BOOT, agent_dir], KVCHAOS_AGENT="test", KVCHAOS_BOOT_AGENT=name))
        assert proc.returncode == 0, proc.stderr
        assert f"agent module {name!r} (KVCHAOS_BOOT_AGENT) is unavailable; agent not loaded" in proc.stderr
    assert "faults" not in (BOOT / "sitecustomize.py").read_text().replace("# ", "")


def test_no_other_sitecustomize_prints_nothing(tmp_path):
    bare = subprocess.run(
        [sys.executable, "-c", "import sys; print('sitecustomize' not in sys.modules)"],
        env=_env([]), capture_output=True, text=True, timeout=60)
    if bare.stdout.strip() != "True":
        pytest.skip("this interpreter ships its own sitecustomize")

    proc = _run(tmp_path, _env([BOOT]))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.splitlines()[0] == "ok"
    probe = _probe(proc)
    assert _same(probe["sitecustomize"], BOOT / "sitecustomize.py")
    assert probe["chained"] is None


@pytest.mark.parametrize("value,ok", [("0.0001", True), ("soon", False)])
def test_switch_interval_knob_is_applied_or_refused_by_name(value, ok):
    """``KVCHAOS_SWITCH_INTERVAL`` (a measurement's amplifier) is every engine process's GIL switch
    interval; a value that is not a number stops the process naming it, never runs at the default."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCHAOS_")}
    env.update(PYTHONPATH=str(BOOT), KVCHAOS_SWITCH_INTERVAL=value)
    p = subprocess.run([sys.executable, "-c", "import sys; print(sys.getswitchinterval())"], env=env,
                       capture_output=True, text=True, timeout=60)
    if ok:
        assert p.returncode == 0 and float(p.stdout) == pytest.approx(1e-4), p.stderr
    else:
        assert p.returncode != 0 and "KVCHAOS_SWITCH_INTERVAL='soon'" in p.stderr, (p.returncode, p.stderr)
