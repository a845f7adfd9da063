"""Run commands in the background beside the one in the foreground, stopped with it: ``make test`` runs
the cluster-free tests, then the two-host session, this way while the cluster session runs.

    python scripts/beside.py COMMAND [ARG ...] [--then COMMAND [ARG ...]] ...

One command: it execs COMMAND (its exit status is the command's) after two changes to this process:

- SIGINT back to its default: a shell starts a background job with SIGINT ignored, and Python leaves an
  ignored SIGINT ignored, so Ctrl-C in the terminal would stop the foreground run and not this one;
- SIGINT when the shell that started it dies (``PR_SET_PDEATHSIG``), even by SIGKILL: nothing runs on
  after the ``make`` that started it is gone.

Several (``--then``): it runs them one after the other, each to its end whatever the one before it
returned, and exits with the first non-zero status (0 when all passed). It stays as their supervisor: each
command runs in a process group of its own, gets SIGINT when this process dies, even by SIGKILL, and every
SIGINT or SIGTERM this process gets (Ctrl-C, the shell's death, the recipe's trap) goes to that group; after
one, no further command starts. A line before and after each command says which runs and how it ended.

Its priority is left as it is. At nice 19 the unit tests that time a few hundred milliseconds would wait
whole seconds whenever the cluster kept both cores busy; at equal priority both sides slow alike, which
each already does on 2 cores (3 xdist workers; two clusters at once were green, bench/RESULTS.md).
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
THEN = "--then"
USAGE = "usage: python scripts/beside.py COMMAND [ARG ...] [--then COMMAND [ARG ...]] ..."


def _die_with_parent(sig: int = signal.SIGINT) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def prepare(on_sigint=signal.SIG_DFL) -> None:
    signal.signal(signal.SIGINT, on_sigint)
    _die_with_parent()
    if os.getppid() == 1:  # the parent died before the prctl: nobody would signal us
        sys.exit("beside.py: the shell that started this is already gone")


def split(argv: list[str]) -> list[list[str]]:
    """``A a --then B b`` -> ``[[A, a], [B, b]]``; an empty command is a usage error (ValueError)."""
    cmds, cur = [], []
    for a in argv:
        if a == THEN:
            cmds.append(cur)
            cur = []
        else:
            cur.append(a)
    cmds.append(cur)
    if not all(cmds):
        raise ValueError("an empty command" + (f" around {THEN}" if len(cmds) > 1 else ""))
    return cmds


def _program(cmd: list[str]) -> str:
    """What ``cmd`` runs, past ``env NAME=value ...``: ``python -m pytest``, not ``env``."""
    rest = cmd[1:] if os.path.basename(cmd[0]) == "env" else cmd
    while rest and "=" in rest[0] and not rest[0].startswith("-"):
        rest = rest[1:]
    return " ".join((rest or cmd)[:3])


def _child_setup() -> None:  # in the child, before exec
    os.setpgid(0, 0)
    _die_with_parent()


def run_all(cmds: list[list[str]]) -> int:
    """Run ``cmds`` one after the other as described in the module's docstring."""
    state = {"child": None, "stopped": 0}

    def forward(sig, _frame):
        state["stopped"] = state["stopped"] or sig
        child = state["child"]
        if child is not None and child.poll() is None:
            try:
                os.killpg(child.pid, sig)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    prepare(forward)
    first_bad = 0
    for i, cmd in enumerate(cmds, 1):
        if state["stopped"]:
            print(f"beside.py: stopped by signal {state['stopped']}; not run: {shlex.join(cmd)}", flush=True)
            first_bad = first_bad or 128 + state["stopped"]
            continue
        print(f"beside.py: [{i}/{len(cmds)}] {shlex.join(cmd)}", flush=True)
        try:
            state["child"] = subprocess.Popen(cmd, preexec_fn=_child_setup)
        except OSError as e:
            print(f"beside.py: cannot run {cmd[0]!r}: {e.strerror}", file=sys.stderr, flush=True)
            first_bad = first_bad or 127
            continue
        if state["stopped"]:  # signalled while it started, before forward() could see it
            forward(state["stopped"], None)
        rc = state["child"].wait()
        state["child"] = None
        rc = 128 - rc if rc < 0 else rc  # killed by a signal: the shell's 128 + N
        print(f"beside.py: [{i}/{len(cmds)}] exit {rc}: {_program(cmd)}", flush=True)
        first_bad = first_bad or rc
    return first_bad


def main(argv: list[str]) -> int:
    try:
        cmds = split(argv)
    except ValueError as e:
        print(f"beside.py: {e}\n{USAGE}", file=sys.stderr)
        return 2
    if len(cmds) > 1:
        return run_all(cmds)
    prepare()
    try:
        os.execvp(cmds[0][0], cmds[0])
    except OSError as e:
        print(f"beside.py: cannot run {cmds[0][0]!r}: {e.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
