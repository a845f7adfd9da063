"""The run directory ``reports/<run-id>/``: the run id and seed, ``run.json``, ``progress.jsonl``
(:class:`Progress`), JUnit XML, and at the session's end ``findings.json``, ``verdicts.json`` and
``report.html`` (with the sections plugins add: ``pytest_kvchaos_report_sections``); the terminal
summary; it registers the progress lines (:mod:`kvchaos.plugin.progress`)."""

from __future__ import annotations

import contextlib
import html
import json
import os
import re
import threading
import time
from pathlib import Path

import pytest

from kvchaos.plugin import known
from kvchaos.plugin.progress import PROGRESS_MODES, ProgressLines
from kvchaos.workload.seed import SeedError, parse

RUN_ID = pytest.StashKey[str]()
SEED = pytest.StashKey[int]()
PROGRESS = pytest.StashKey["Progress"]()
LINES = pytest.StashKey["ProgressLines"]()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # the cluster layer does not import the fault layer: the network fault proxy and the engines'
    # in-engine agent are wired in here
    from faults import install

    install()
    mode = config.getoption("--kvchaos-progress")
    if mode not in PROGRESS_MODES:
        raise pytest.UsageError(f"--kvchaos-progress / KVCHAOS_PROGRESS {mode!r}: one of {', '.join(PROGRESS_MODES)}")
    run_id = os.environ.get("KVCHAOS_RUN_ID") or time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        run_id += f"-{worker}"
    config.stash[RUN_ID] = run_id

    try:
        config.stash[SEED] = seed = parse(config.getoption("--kvchaos-seed"))
    except SeedError as e:
        raise pytest.UsageError(str(e)) from None
    # xdist workers inherit the environment: one run, one seed, even when it was drawn here
    os.environ["KVCHAOS_SEED"] = str(seed)
    if config.getoption("--kvchaos-dry"):
        os.environ["KVCHAOS_DRY"] = "1"  # clusters of a test's own (kvchaos.suite.own_cluster) start nothing
    if getattr(config.option, "collectonly", False):
        return
    run_dir = Path(config.getoption("--kvchaos-reports")) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    if not worker:  # what ``kvchaos replay`` needs to run this again; the report shows the seed
        _write_run_json(config, run_dir, run_id, seed)
    progress = config.stash[PROGRESS] = Progress(run_dir / "progress.jsonl")
    config.pluginmanager.register(progress, "kvchaos-progress")
    lines = config.stash[LINES] = ProgressLines(config, progress, mode)
    config.pluginmanager.register(lines, "kvchaos-progress-lines")
    # here, not at the top: the runner loads with the fault layer installed above (both cost nothing more
    # by now); it tells its listeners when an experiment opens and closes and never imports this plugin
    from kvchaos import experiment

    experiment.OBSERVERS.append(lines.experiment)
    # every run leaves JUnit XML in its run directory (unless the caller chose a path)
    if not worker and not getattr(config.option, "xmlpath", None):
        config.option.xmlpath = str(run_dir / "junit.xml")


def _write_run_json(config, run_dir: Path, run_id: str, seed: int) -> None:
    (run_dir / "run.json").write_text(json.dumps({
        "run_id": run_id, "seed": seed, "dry": config.getoption("--kvchaos-dry"),
        "args": list(config.invocation_params.args), "cwd": str(config.invocation_params.dir),
        "profile": config.getoption("--kvchaos-profile"), "layouts": config.getoption("--kvchaos-layouts"),
        "backends": config.getoption("--kvchaos-backends"), "model": config.getoption("--kvchaos-model"),
        "attach": config.getoption("--kvchaos-attach"), "started": time.time()}, indent=2))


class Progress:
    """``<run dir>/progress.jsonl``: what ``kvchaos run`` shows while the run goes, and how the report
    links each scenario to the test that ran it. Lines: ``collected`` (n), ``start`` (nodeid), ``end``
    (nodeid, outcome passed|failed|error|skipped|xfailed|xpassed, wall_start, wall_end, duration, message)."""

    def __init__(self, path: Path):
        self.path = path
        self.run_dir = path.parent
        self._f = None
        self._open: dict[str, dict] = {}
        self._lock = threading.Lock()  # an experiment's live watch writes from its own thread

    def emit(self, ev: str, **fields):
        line = json.dumps({"ev": ev, "wall": time.time(), **fields}, default=str) + "\n"
        with self._lock:
            if self._f is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._f = open(self.path, "a", buffering=1)
            self._f.write(line)

    # pytest hooks (this object is registered as a plugin of its session)
    def pytest_collection_finish(self, session):
        self.emit("collected", n=len(session.items))

    def pytest_runtest_logreport(self, report):
        if report.when == "setup":
            self.emit("start", nodeid=report.nodeid)
        self.report(report)

    def report(self, rep):
        st = self._open.setdefault(rep.nodeid, {"outcome": "passed", "message": "", "start": time.time()})
        if rep.when == "setup":
            st["start"] = time.time() - (rep.duration or 0)
        if getattr(rep, "wasxfail", "").startswith("KNOWN ") and rep.skipped:
            st["outcome"] = "known"
            st["message"] = rep.wasxfail
        elif hasattr(rep, "wasxfail"):
            st["outcome"] = "xfailed" if rep.skipped else "xpassed"
            st["message"] = rep.wasxfail
        elif rep.outcome == "rerun":  # blinded by an accepted engine failure: the test runs again
            st["outcome"] = "rerun"
            st["message"] = str(rep.longrepr)[-2000:]
        elif rep.failed:
            st["outcome"] = "failed" if rep.when == "call" else "error"
            st["message"] = str(rep.longrepr)[-2000:]
        elif rep.skipped and st["outcome"] == "passed":
            st["outcome"] = "skipped"
            lr = rep.longrepr
            st["message"] = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
        if rep.when == "teardown":
            self._open.pop(rep.nodeid, None)
            end = time.time()
            self.emit("end", nodeid=rep.nodeid, outcome=st["outcome"], wall_start=st["start"], wall_end=end,
                      duration=round(end - st["start"], 3), message=st["message"])

    def close(self):
        if self._f:
            self._f.close()
            self._f = None


def pytest_unconfigure(config):
    lines = config.stash.get(LINES, None)
    if lines is not None:
        # the runner is loaded by now (pytest_configure); a session in this process stops listening
        from kvchaos import experiment

        with contextlib.suppress(ValueError):
            experiment.OBSERVERS.remove(lines.experiment)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """After JUnit is written: the run-level findings.json, verdicts.json and report.html of this run
    directory."""
    pr = session.config.stash.get(PROGRESS, None)
    if pr is None:
        return
    exitstatus = known.write_findings(session, pr.run_dir, exitstatus)
    pr.emit("finished", exitstatus=int(exitstatus))
    pr.close()
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    try:
        from kvchaos.report import build  # not at plugin load: the plugin loads in every pytest run

        r = build(pr.run_dir)
        msg = "\n".join(r["lines"] + [f"kvchaos report: {r['html']} ({r['label']})"])
    except Exception as e:  # noqa: BLE001 - the run's result stands; say loudly that its report is missing
        (pr.run_dir / "report-error.txt").write_text(repr(e))
        msg = f"kvchaos report: NOT BUILT for {pr.run_dir}: {e!r}"
    else:
        msg += _plugin_sections(session.config, pr.run_dir, Path(r["html"]))
        if r["overall"] in ("fail", "unknown") and session.exitstatus == pytest.ExitCode.OK:
            # every test passed but the run is red: an experiment no test owns (an engine leak during the
            # session's self-test) — the exit code says what the report says, never green
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            msg += f"\nkvchaos: every test passed, but the run is {r['label']}: exit {int(session.exitstatus)}"
    if tr is not None:
        tr.ensure_newline()
        for line in msg.splitlines():
            tr.write_line(line)


# --------------------------------------------------------------------------- sections plugins add
def report_sections(config, run_dir: Path) -> list[dict]:
    """What every ``pytest_kvchaos_report_sections`` implementation returned, as ``{"title", "html"}``
    (a ``text`` body is escaped into a ``<pre>``)."""
    out = []
    for result in config.hook.pytest_kvchaos_report_sections(config=config, run_dir=run_dir):
        for s in result or ():
            if isinstance(s, (tuple, list)) and len(s) == 2:
                s = {"title": s[0], "text": s[1]}
            if not isinstance(s, dict) or "title" not in s or ("html" in s) == ("text" in s):
                raise TypeError(f"pytest_kvchaos_report_sections: {s!r} is not a section: a dict with 'title' "
                                "and one of 'html' or 'text', or a (title, text) pair")
            body = s["html"] if "html" in s else f"<pre>{html.escape(str(s['text']))}</pre>"
            out.append({"title": str(s["title"]), "html": body})
    return out


def _plugin_sections(config, run_dir: Path, page: Path) -> str:
    """Add the plugins' sections to ``report.html`` (before its engine logs); the terminal line that
    says so, or why they are missing ("" when no plugin adds one)."""
    try:
        sections = report_sections(config, run_dir)
        if not sections:
            return ""
        text = page.read_text()
        blocks = "".join(
            f'<section class="plugin-section" id="plugin-{i}-{re.sub(r"[^a-z0-9]+", "-", s["title"].lower())}">'
            f'<h2>{html.escape(s["title"])}</h2>{s["html"]}</section>\n' for i, s in enumerate(sections))
        at = text.find('<section id="logs">')
        at = at if at >= 0 else text.rfind("</body>")
        page.write_text(text[:at] + blocks + text[at:])
        return "\nkvchaos report sections (plugins): " + ", ".join(s["title"] for s in sections)
    except Exception as e:  # noqa: BLE001 - the run's result and report stand; say what is missing
        (run_dir / "report-sections-error.txt").write_text(repr(e))
        return f"\nkvchaos report sections (plugins): NOT ADDED: {e!r}"


# --------------------------------------------------------------------------- terminal
def pytest_report_header(config):
    s = config.stash.get(SEED, None)
    if s is not None:
        return f"kvchaos seed: {s} (again: --kvchaos-seed {s})"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    pr = config.stash.get(PROGRESS, None)
    seed = config.stash.get(SEED, None)
    if pr is not None and seed is not None:
        terminalreporter.write_line(f"kvchaos seed: {seed} — replay: kvchaos replay {pr.run_dir}")
    if pr is not None:
        known.findings_lines(terminalreporter, config)
        _scenario_lines(terminalreporter, pr.run_dir)


def _scenario_lines(tr, run_dir: Path) -> None:
    """How many of the run's experiments can be re-run from data alone (``kvchaos replay FILE``,
    ``kvchaos shrink FILE``), and each that cannot, with why."""
    from kvchaos.replay import scenario_files  # not at plugin load

    got = scenario_files(run_dir)
    if not got["experiments"]:
        return
    tr.write_line(f"kvchaos scenarios: {len(got['complete'])} of {got['experiments']} experiments replay from "
                  f"their scenario.json" + (f"; {len(got['incomplete'])} incomplete, {len(got['missing'])} missing"
                                            if got["incomplete"] or got["missing"] else ""))
    for name, why in got["incomplete"] + got["missing"]:
        tr.write_line(f"  {name}: {why}"[:300])
