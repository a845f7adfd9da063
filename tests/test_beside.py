"""``scripts/beside.py``: what ``make test`` runs the cluster-free tests under, beside the cluster session —
Ctrl-C restored although a shell's background job starts with SIGINT ignored, and SIGINT when the shell
that started it dies, even by SIGKILL."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.util import written

BESIDE = Path(__file__).resolve().parents[1] / "scripts" / "beside.py"
REPORT = ("import os, signal; h = signal.getsignal(signal.SIGINT); "
          "print(os.nice(0), 'default' if h is signal.default_int_handler else 'ignored' if h == signal.SIG_IGN else h)")


def _ignoring_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what `cmd &` in a non-interactive shell does


def test_a_background_job_gets_its_ctrl_c_back():
    plain = subprocess.run([sys.executable, "-c", REPORT], preexec_fn=_ignoring_sigint,
                           capture_output=True, text=True, timeout=60)
    assert plain.stdout.split() == [str(os.nice(0)), "ignored"], plain  # without it: Ctrl-C would not reach it
    r = subprocess.run([sys.executable, str(BESIDE), sys.executable, "-c", REPORT], preexec_fn=_ignoring_sigint,
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.split()) == (0, [str(os.nice(0)), "default"]), r  # priority left as it is


def test_the_command_gets_sigint_when_the_shell_that_started_it_is_killed(tmp_path):
    got, pidfile = tmp_path / "got", tmp_path / "pid"
    child = ("import os, signal, time, pathlib\n"
             f"signal.signal(signal.SIGINT, lambda *a: (pathlib.Path({str(got)!r}).write_text('SIGINT'), os._exit(0)))\n"
             f"pathlib.Path({str(pidfile)!r}).write_text(str(os.getpid()))\n"
             "time.sleep(60)\n")
    shell = subprocess.Popen(["bash", "-c", f"{sys.executable} {BESIDE} {sys.executable} -c \"$0\" & wait", child])
    try:
        assert _wait_for(pidfile, 30), "the command never started"
        shell.kill()
        shell.wait(10)
        _wait_for(got, 20)
        assert got.read_text() == "SIGINT"
    finally:
        shell.kill()
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_no_command_or_one_that_does_not_exist_is_a_clear_error():
    r = subprocess.run([sys.executable, str(BESIDE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "beside.py COMMAND" in r.stderr, r
    r = subprocess.run([sys.executable, str(BESIDE), "no-such-command-kvchaos"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 127 and "no-such-command-kvchaos" in r.stderr, r


def _script(tmp_path, name, body):
    """A child that records SIGINT in ``<name>.got`` and its start in ``<name>.pid``, then runs ``body``."""
    f = tmp_path / f"{name}.py"
    f.write_text("import os, signal, sys, time, pathlib\n"
                 f"d = pathlib.Path({str(tmp_path)!r})\n"
                 f"signal.signal(signal.SIGINT, lambda *a: ((d / '{name}.got').write_text('SIGINT'), os._exit(130)))\n"
                 f"(d / '{name}.pid').write_text(str(os.getpid()))\n" + body)
    return [sys.executable, str(f)]


def _wait_for(path, bound_s=30.0):
    deadline = time.monotonic() + bound_s
    while not written(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return written(path)


def test_then_runs_every_command_in_order_and_exits_with_the_first_failure(tmp_path):
    a = _script(tmp_path, "a", "sys.exit(3)\n")
    b = _script(tmp_path, "b", "print('b ran', os.getpgid(0) == os.getpid())\n")
    c = _script(tmp_path, "c", "sys.exit(5)\n")
    r = subprocess.run([sys.executable, str(BESIDE), *a, "--then", *b, "--then", *c], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 3, r  # the first failure, and the ones after it still ran
    assert all((tmp_path / f"{n}.pid").exists() for n in "abc")
    assert "b ran True" in r.stdout  # each in a process group of its own
    assert [ln.split(":")[1].strip() for ln in r.stdout.splitlines() if " exit " in ln] == \
        ["[1/3] exit 3", "[2/3] exit 0", "[3/3] exit 5"], r.stdout
    ok = subprocess.run([sys.executable, str(BESIDE), *b, "--then", *b], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok


def test_then_a_sigint_stops_the_running_command_and_starts_no_other(tmp_path):
    a = _script(tmp_path, "a", "time.sleep(60)\n")
    b = _script(tmp_path, "b", "")
    p = subprocess.Popen([sys.executable, str(BESIDE), *a, "--then", *b], stdout=subprocess.PIPE, text=True,
                         preexec_fn=_ignoring_sigint)  # started as `cmd &` is: its SIGINT ignored
    try:
        assert _wait_for(tmp_path / "a.pid"), "the first command never started"
        p.send_signal(signal.SIGINT)  # Ctrl-C, the recipe's trap, or the shell's death (PR_SET_PDEATHSIG)
        out, _ = p.communicate(timeout=30)
        assert (tmp_path / "a.got").read_text() == "SIGINT"
        assert not (tmp_path / "b.pid").exists() and "not run" in out, out
        assert p.returncode == 130, out
    finally:
        p.kill()


def test_then_a_sigkilled_supervisor_leaves_its_command_a_sigint(tmp_path):
    a = _script(tmp_path, "a", "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, str(BESIDE), *a, "--then", *a], stdout=subprocess.DEVNULL)
    try:
        assert _wait_for(tmp_path / "a.pid"), "the first command never started"
        p.kill()
        p.wait(10)
        assert _wait_for(tmp_path / "a.got", 20), "the command outlived its supervisor"
    finally:
        p.kill()
        if (tmp_path / "a.pid").exists():
            try:
                os.kill(int((tmp_path / "a.pid").read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_then_with_an_empty_command_is_a_usage_error():
    for argv in (["--then", "true"], ["true", "--then"], ["true", "--then", "--then", "true"]):
        r = subprocess.run([sys.executable, str(BESIDE), *argv], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "empty command" in r.stderr and "--then" in r.stderr, (argv, r)
