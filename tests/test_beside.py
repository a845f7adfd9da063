"""``scripts/beside.py``: what ``make test`` runs the cluster-free tests under, beside the cluster session —
Ctrl-C restored although a shell's background job starts with SIGINT ignored, and SIGINT when the shell
that started it dies, even by SIGKILL."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
        deadline = time.monotonic() + 30
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pidfile.exists(), "the command never started"
        shell.kill()
        shell.wait(10)
        deadline = time.monotonic() + 20
        while not got.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
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
