"""The progress lines while a run goes (``--kvchaos-progress``): tests done and left, the test running,
an ETA from earlier runs' durations (:func:`earlier_durations`), each experiment as it opens and its
verdicts as it closes (:data:`kvchaos.experiment.OBSERVERS`). :mod:`kvchaos.plugin.rundir` writes
``progress.jsonl`` and registers :class:`ProgressLines` as a plugin."""

from __future__ import annotations

import contextlib
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import pytest

PROGRESS_MODES = ("auto", "on", "off")
QUIET_S = 10.0  # auto: a test's line when this long has passed since the last one, or it took this long last time
ETA_RUNS = 20  # earlier run directories read for durations, newest first
_WORKER_DIR = re.compile(r"-gw\d+$")  # an xdist worker's run directory: its controller's has every test
_PREFIX = "[kvchaos]"


def read_durations(path: Path) -> tuple[dict[str, float], int]:
    """nodeid -> seconds, of each test whose ``end`` the ``progress.jsonl`` at ``path`` holds (the attempts
    of a test run again summed), and how many lines are not a record (a killed run's cut last line)."""
    out: dict[str, float] = {}
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                e = json.loads(line)
                if not isinstance(e, dict):
                    raise TypeError(f"not a record: {line[:40]!r}")
                if e.get("ev") == "end":
                    d = float(e["duration"])
                    if not math.isfinite(d) or d < 0:
                        raise ValueError(f"duration {d}")
                    out[str(e["nodeid"])] = out.get(str(e["nodeid"]), 0.0) + d
            except (ValueError, TypeError, KeyError):
                bad += 1
    return out, bad


def earlier_durations(reports: Path, nodeids, exclude: Path | None = None,
                      max_runs: int = ETA_RUNS) -> tuple[dict[str, float], list[str], list[str]]:
    """What the tests ``nodeids`` took in earlier runs under ``reports``: (nodeid -> seconds, the run ids
    that gave them, newest first, warnings). A test's time is from the newest of the ``max_runs`` newest
    run directories (by their ``progress.jsonl``'s time) that saw it end: ``make test``'s sessions share
    ``reports/``, so the newest run alone is often another session's. ``exclude`` (this run) and xdist
    workers' directories (their controller's has every test) are not read. A file or line that cannot be
    read is skipped, and said in a warning."""
    want = set(nodeids)
    found: dict[str, float] = {}
    used: list[str] = []
    warns: list[str] = []
    skip = exclude.resolve() if exclude is not None else None
    runs = []
    try:
        dirs = [d for d in reports.iterdir() if d.is_dir() and not _WORKER_DIR.search(d.name)]
    except OSError as e:
        return found, used, [f"{reports}: {e}"]
    for d in dirs:
        if skip is not None and d.resolve() == skip:
            continue
        with contextlib.suppress(OSError):  # no progress.jsonl: not a run of this plugin's
            runs.append((d.joinpath("progress.jsonl").stat().st_mtime, d.name))
    for _mtime, name in sorted(runs, reverse=True)[:max_runs]:
        if want <= found.keys():
            break
        path = reports / name / "progress.jsonl"
        try:
            durations, bad = read_durations(path)
        except OSError as e:
            warns.append(f"{path}: {e}")
            continue
        if bad:
            warns.append(f"{path}: {bad} unreadable line{'s' if bad > 1 else ''} skipped")
        new = {n: t for n, t in durations.items() if n in want and n not in found}
        if new:
            found.update(new)
            used.append(name)
    return found, used, warns


def clock(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


class ProgressLines:
    """The progress lines a person watching the run reads (``--kvchaos-progress``), and the experiment
    records of ``progress.jsonl``.

    When a test starts: ``[kvchaos] 12/64 done, 52 left · now: <nodeid> · ETA 14m 05s (from run <id>)``
    (``auto``: when :data:`QUIET_S` has passed since the last such line, or the test took that long in
    an earlier run; ``on``: every test). When an experiment of this run opens and closes
    (``kvchaos.experiment.OBSERVERS``): its requests, then its checkers' verdicts the moment they are
    judged — before the test requires anything of them — and an ``experiment`` record (``phase`` open |
    leak (a leak checker's FAIL the moment the experiment's live watch saw it; no line then: it comes
    from the watch's thread, and the terminal is pytest's) | close, wall times, verdicts) in
    ``progress.jsonl`` whatever the mode. Under pytest-xdist the
    controller prints the test lines (the tests of every worker; the ETA divided among the workers), and
    each worker records its own experiments in its run directory but prints nothing (xdist shows no
    worker output). The lines go through pytest's terminal reporter; a failure here never fails the
    session: it is said in one line and the lines stop."""

    def __init__(self, config, progress, mode: str):  # progress: rundir.Progress (which imports this module)
        self.config, self.progress, self.mode = config, progress, mode
        self.run_dir = progress.run_dir.resolve()
        self.reports = progress.run_dir.parent  # as given (--kvchaos-reports)
        self.worker = hasattr(config, "workerinput")
        self.show = mode != "off" and not self.worker
        self.ids: list[str] | None = None
        self.ended: set[str] = set()
        self.running: dict[str, float] = {}  # nodeid -> monotonic start
        self.again: set[str] = set()  # tests whose attempt is to run once more (the rerun rule)
        self.durations: dict[str, float] = {}
        self.sources: list[str] = []
        self.typical: float | None = None  # what a test without an earlier time is counted at: the mean
        self.last: float | None = None  # monotonic time of the last test line
        self.warned = False
        self.dangling = False  # a line of ours is open amid a file's row of results

    @property
    def xdist(self) -> bool:
        """This process is the controller of xdist workers (known once xdist has configured)."""
        return self.config.pluginmanager.has_plugin("dsession")

    @property
    def workers(self) -> int:
        n = getattr(self.config.option, "numprocesses", None)
        return n if self.xdist and isinstance(n, int) and n > 0 else 1

    # ------------------------------------------------------------------ pytest hooks
    def pytest_collection_finish(self, session):
        if not self.xdist:
            self._safely(self._collected, [i.nodeid for i in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        if self.ids is None:  # every worker collects the same tests; the controller collects none
            self.progress.emit("collected", n=len(ids))
            self._safely(self._collected, list(ids))

    @pytest.hookimpl(tryfirst=True)  # before the terminal reporter starts the test's line
    def pytest_runtest_logstart(self, nodeid, location):
        self.running.pop(nodeid, None)
        self.running[nodeid] = time.monotonic()
        self._safely(self._started, nodeid)

    @pytest.hookimpl(tryfirst=True)  # before the terminal reporter writes the test's result
    def pytest_runtest_logreport(self, report):
        if self.dangling:
            self.dangling = False
            self._safely(self._row_again, report.nodeid)
        if report.outcome == "rerun":
            self.again.add(report.nodeid)
        elif report.when not in ("setup", "call"):  # teardown (or xdist's report of a crashed worker)
            if report.nodeid in self.again:
                self.again.discard(report.nodeid)
            else:
                self.ended.add(report.nodeid)
                self.running.pop(report.nodeid, None)

    # ------------------------------------------------------------------ the runner's listener
    def experiment(self, event: str, ex, error: str | None = None, **_info) -> None:
        """``kvchaos.experiment.OBSERVERS``: an experiment writing into this run's directory opened or
        closed (another session's in this process — pytester's — is not this run's)."""
        given, where = Path(ex.run_dir), Path(ex.run_dir).resolve()
        if not (where == self.run_dir or self.run_dir in where.parents  # or as given, should a test chdir
                or given == self.progress.run_dir or self.progress.run_dir in given.parents):
            return
        head = {"name": ex.name, "id": ex.id, "test": ex.test_id, "record": ex.record}
        if event == "leak":  # from the experiment's watch thread: the record only (the terminal is pytest's)
            v = _info["verdict"]
            self.progress.emit("experiment", phase="leak", oracle=v.oracle, status=v.status, after_s=ex.live.after_s,
                               victims=len({w.get("victim_rid") for w in v.witnesses}), summary=v.summary[:300], **head)
            return
        if event == "open":
            self.progress.emit("experiment", phase="open", n=len(ex.plans), events=str(ex.path), **head)
            self._safely(self._say, f"{_PREFIX}   experiment {ex.name}: {len(ex.plans)} requests")
            return
        took = round(time.time() - ex.t_start, 3) if ex.t_start else None
        verdicts = {v.oracle: v.status for v in ex.verdicts}
        leak = {c.name for c in ex.checks.checkers if getattr(c, "leak", False)}
        leaks = sorted(o for o, st in verdicts.items() if st == "fail" and o in leak)
        status = "aborted" if error else (ex.judgement.status if ex.judgement is not None else None)
        self.progress.emit("experiment", phase="close", status=status, verdicts=verdicts, leaks=leaks,
                           wall_open=ex.t_start, duration=took, error=error, **head)
        # the checkers it was given, and any other's FAIL (the always-run leak checkers' UNKNOWN is noise here)
        shown = {o: st for o, st in verdicts.items() if o in ex.claimed or st == "fail"}
        said = (f"aborted: {error[:160]}" if error
                else " · ".join(f"{o} {st.upper()}" for o, st in shown.items()) or "no verdict")
        live = getattr(ex, "live", None)
        when = ([f"{took:.1f} s"] if took is not None else []) + (
            [f"{live.fail.oracle} was red {live.after_s:.1f} s in"] if live is not None and live.fail is not None
            and live.after_s is not None and not error else [])
        took_s = f" ({'; '.join(when)})" if when else ""
        self._safely(self._say, f"{_PREFIX}   experiment {ex.name}: {said}{took_s}",
                     red=bool(error or "fail" in verdicts.values()))

    # ------------------------------------------------------------------ the lines
    def _collected(self, ids: list[str]) -> None:
        self.ids = ids
        if not self.show:
            return
        self.durations, self.sources, warns = earlier_durations(self.reports, ids, exclude=self.run_dir)
        known = [self.durations[n] for n in ids if n in self.durations]
        # the mean, not the median: the ETA is a sum, and test times are skewed (most unit tests take
        # milliseconds, a few minutes): at the median, 248 new tests counted 0.0 s each and the ETA said
        # 46 s with 4 minutes left (2026-12-06)
        self.typical = statistics.fmean(known) if known else None
        if warns:
            self._warn(f"ETA: {warns[0]}" + (f" (and {len(warns) - 1} more)" if len(warns) > 1 else ""))

    def _started(self, nodeid: str) -> None:
        if not self.show:
            return
        now = time.monotonic()
        due = (self.mode == "on" or self.last is None or now - self.last >= QUIET_S
               or self.durations.get(nodeid, 0.0) >= QUIET_S)
        if due:
            self.last = now
            self._say(self.line(nodeid, now), at_start=True)

    def line(self, nodeid: str, now: float | None = None) -> str:
        """The line shown as ``nodeid`` starts."""
        now = time.monotonic() if now is None else now
        done = len(self.ended)
        if self.ids is None:
            head = f"{done} done"
        else:
            head = f"{done}/{len(self.ids)} done, {max(0, len(self.ids) - done)} left"
        more = len(self.running) - 1 if nodeid in self.running else len(self.running)
        cur = nodeid + (f" (+{more} running)" if more > 0 else "")
        return f"{_PREFIX} {head} · now: {cur} · {self.eta(now)}"

    def eta(self, now: float) -> str:
        if self.ids is None or self.typical is None:
            return f"ETA unknown (no earlier run of these tests in {self.reports}/)"
        left, new = 0.0, 0
        for n in self.ids:
            if n in self.ended:
                continue
            t = self.durations.get(n)
            if t is None:
                t, new = self.typical, new + 1
            if n in self.running:
                t = max(0.0, t - (now - self.running[n]))
            left += t
        src = f"run {self.sources[0]}" + (f" +{len(self.sources) - 1} older" if len(self.sources) > 1 else "")
        notes = [f"from {src}"]
        if new:
            notes.append(f"{new} new test{'s' if new > 1 else ''} counted at the mean {self.typical:.1f} s")
        if self.workers > 1:
            notes.append(f"{self.workers} workers")
        return f"ETA {'~' if new else ''}{clock(left / self.workers)} ({'; '.join(notes)})"

    # ------------------------------------------------------------------ the terminal
    def _safely(self, fn, *args, **kw) -> None:
        """Watching the run never fails it: an error is said once and the lines stop."""
        try:
            fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - said in one line; the session goes on without the lines
            self.show = False
            self._warn(f"progress lines off after {type(e).__name__} in {getattr(fn, '__name__', fn)}: {e}")

    def _warn(self, msg: str) -> None:
        if self.warned:
            return
        self.warned = True
        tr = None if self.worker else self.config.pluginmanager.get_plugin("terminalreporter")
        try:
            if tr is None:
                raise RuntimeError("no terminal reporter")
            with self._uncaptured():
                tr.ensure_newline()
                tr.write_line(f"{_PREFIX} progress: {msg}", yellow=True)
        except Exception:  # noqa: BLE001 - no terminal to say it on: stderr
            print(f"{_PREFIX} progress: {msg}", file=sys.__stderr__, flush=True)

    def _uncaptured(self):
        capman = self.config.pluginmanager.get_plugin("capturemanager")
        return capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext()

    def _say(self, text: str, at_start: bool = False, **markup) -> None:
        """``text`` as a line of its own amid pytest's output, as a test starts (``at_start``) or while
        it runs. It is left open where pytest begins a line next anyway (the test's line or its file's
        row as it starts; the test's result line in ``-v``), so no blank line follows; amid a file's row
        of results, the row starts again with the file's name as the test reports."""
        if not self.show:
            return
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is None:
            return
        tw = getattr(tr, "_tw", None)
        with self._uncaptured():
            if tw is None or getattr(self.config.option, "capture", None) == "no":
                # the test's own prints may follow (-s): whole lines, pytest's row left as it was
                was = tr.currentfspath
                tr.write_line(text, **markup)
                tr.currentfspath = was
                return
            if tw.width_of_current_line:
                tw.line()
            tw.write(text, flush=True, **markup)
            tr.currentfspath = None  # the test's line or row is to start afresh
            if at_start and (tr.showlongtestinfo or tr.showfspath):
                return  # the terminal reporter starts the test's line (-v) or its file's row next
            if tr.showlongtestinfo and not self.xdist:
                # pytest starts a line wherever it finds another "current" path: its next line does
                tr.currentfspath = "[kvchaos progress line]"
                return
            if tr.showfspath and not self.xdist:
                self.dangling = True  # the test's next report starts its file's row again
                return
            tw.line()
            tw.flush()

    def _row_again(self, nodeid: str) -> None:
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_fspath_result(nodeid, "")  # ends the line above; the file's row starts again
