"""Run a command in the background beside the one in the foreground, stopped with it: ``make test`` runs
the cluster-free tests this way while the cluster sessions run.

    python scripts/beside.py COMMAND [ARG ...]

It execs COMMAND (its exit status is the command's) after two changes to this process:

- SIGINT back to its default: a shell starts a background job with SIGINT ignored, and Python leaves an
  ignored SIGINT ignored, so Ctrl-C in the terminal would stop the foreground run and not this one;
- SIGINT when the shell that started it dies (``PR_SET_PDEATHSIG``), even by SIGKILL: nothing runs on
  after the ``make`` that started it is gone.

Its priority is left as it is. At nice 19 the unit tests that time a few hundred milliseconds would wait
whole seconds whenever the cluster kept both cores busy; at equal priority both sides slow alike, which
each already does on 2 cores (3 xdist workers; two clusters at once were green, bench/RESULTS.md).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
USAGE = "usage: python scripts/beside.py COMMAND [ARG ...]"


def prepare() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGINT, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() == 1:  # the parent died before the prctl: nobody would signal us
        sys.exit("beside.py: the shell that started this is already gone")


def main(argv: list[str]) -> int:
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    prepare()
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        print(f"beside.py: cannot run {argv[0]!r}: {e.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
