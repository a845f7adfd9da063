"""The ``kvchaos`` CLI as a user runs it (subprocesses): configuration from a TOML file or
``[tool.kvchaos]`` with flags on top, clear errors, ``run`` with its progress display and report,
Ctrl-C stopping the whole pytest tree, ``report`` exit codes. No cluster: the suites here are tiny."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvchaos.cli import UsageError, load_config
from tests.test_report import make_run
from tests.util import child_env, written

REPO = Path(__file__).resolve().parents[1]


def kvchaos(*args, cwd=None, timeout=180, **kw):
    env = child_env()
    return subprocess.run([sys.executable, "-m", "kvchaos", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO, env=env, **kw)


def test_config_file_and_pyproject_table(tmp_path, monkeypatch):
    f = tmp_path / "k.toml"
    f.write_text('[kvchaos]\nprofile = "gpu"\nmarkers = "slow"\nsuites = ["suites/test_smoke.py"]\n')
    assert load_config(str(f)) == {"profile": "gpu", "markers": "slow", "suites": ["suites/test_smoke.py"]}
    f.write_text('profile = "gpu"\n')                           # keys at top level of an explicit file
    assert load_config(str(f)) == {"profile": "gpu"}
    (tmp_path / "pyproject.toml").write_text('[tool.kvchaos]\nreports = "out"\n')
    monkeypatch.chdir(tmp_path)
    assert load_config(None) == {"reports": "out"}
    for text, msg in (('[kvchaos]\nprofil = "cpu"\n', "unknown key 'profil'"),
                      ('[kvchaos]\nsuites = "x"\n', "expected a list of strings"),
                      ('[kvchaos]\nstrict = "yes"\n', "expected bool"),
                      ("[kvchaos\n", "invalid TOML")):
        f.write_text(text)
        with pytest.raises(UsageError):
            load_config(str(f))
        p = kvchaos("--config", str(f), "report", str(tmp_path))
        assert p.returncode == 2 and msg in p.stderr, p.stderr
    p = kvchaos("--config", str(tmp_path / "missing.toml"), "report", str(tmp_path))
    assert p.returncode == 2 and "no such file" in p.stderr


def test_flags_override_the_config(tmp_path):
    suite = tmp_path / "test_one.py"
    suite.write_text("def test_ok():\n    pass\n")
    cfg = tmp_path / "k.toml"
    cfg.write_text(f'[kvchaos]\nreports = "{tmp_path / "from-config"}"\nsuites = ["{suite}"]\n')
    p = kvchaos("--config", str(cfg), "run", "--reports", str(tmp_path / "from-flag"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert list((tmp_path / "from-flag").iterdir()) and not (tmp_path / "from-config").exists()


def test_run_shows_progress_and_leaves_a_report(tmp_path):
    suite = tmp_path / "test_mini.py"
    suite.write_text("import pytest, time\n"
                     "def test_a():\n    time.sleep(0.3)\n"
                     "@pytest.mark.xfail(reason='known engine finding', strict=True)\n"
                     "def test_known():\n    assert False\n"
                     "def test_broken():\n    assert 'reply' == 'leak'\n")
    p = kvchaos("run", str(suite), "--reports", str(tmp_path / "r"))
    assert p.returncode == 1, p.stdout + p.stderr                    # pytest's status: one test failed
    (d,) = (tmp_path / "r").iterdir()
    assert {"junit.xml", "progress.jsonl", "report.html", "verdicts.json", "run.json", "pytest.log"} <= \
        {x.name for x in d.iterdir()}
    assert "FAILED " in p.stderr and "test_broken" in p.stderr      # shown while running (rich, stderr)
    assert "XFAIL " in p.stderr and "known engine finding" in p.stderr
    assert "3/3" in p.stderr                                          # the progress bar's count
    assert f"report: {d / 'report.html'}" in p.stdout.replace("\n", "")
    v = json.loads((d / "verdicts.json").read_text())
    assert v["overall"] == "fail" and v["tests"]["counts"] == {"passed": 1, "xfailed": 1, "failed": 1}
    assert json.loads((d / "run.json").read_text())["exit_code"] == 1
    assert "assert 'reply' == 'leak'" in (d / "pytest.log").read_text()


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigkill"])
def test_stopping_kvchaos_run_stops_pytest_and_its_children(tmp_path, how):
    suite = tmp_path / "test_slow.py"
    pidfile = tmp_path / "child.pid"
    suite.write_text("import subprocess, time\n"
                     "def test_hold():\n"
                     "    c = subprocess.Popen(['sleep', '300'])\n"
                     f"    open({str(pidfile)!r}, 'w').write(str(c.pid))\n"
                     "    time.sleep(300)\n")
    env = child_env()
    # as from a terminal: SIGINT at its default even when this test runs under a shell that ignores it
    # (a non-interactive shell's background job inherits SIGINT ignored, and Python then never raises
    # KeyboardInterrupt)
    proc = subprocess.Popen([sys.executable, "-m", "kvchaos", "run", str(suite), "--reports", str(tmp_path / "r")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        t0 = time.monotonic()
        while not written(pidfile):
            assert proc.poll() is None and time.monotonic() - t0 < 60, "the test never started"
            time.sleep(0.2)
        kvc = psutil.Process(proc.pid)
        tree = [p.pid for p in kvc.children(recursive=True)]
        assert int(pidfile.read_text()) in tree
        sig = {"ctrl-c": signal.SIGINT, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}[how]
        proc.send_signal(sig)                                        # SIGINT is what Ctrl-C sends
        out, err = proc.communicate(timeout=90)
        if how == "sigkill":
            assert proc.returncode == -signal.SIGKILL
        else:
            assert proc.returncode == 130 and "interrupted" in err, (proc.returncode, err)

        def alive():
            return [p for p in tree if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

        t1 = time.monotonic()
        while alive() and time.monotonic() - t1 < 60:  # after SIGKILL: kvchaos' reaper kills the tree
            time.sleep(0.2)
        assert not alive(), f"left running after {how}: {alive()}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_report_exit_codes(tmp_path):
    leak, clean = tmp_path / "leak", tmp_path / "clean"
    make_run(leak, leak=True)
    make_run(clean, leak=False)
    p = kvchaos("report", str(leak))
    assert p.returncode == 1 and "FAIL" in p.stdout and str(leak / "report.html") in p.stdout
    assert kvchaos("report", str(clean)).returncode == 0
    p = kvchaos("report", str(tmp_path / "nope"))
    assert p.returncode == 2 and "no such run directory" in p.stderr


def test_audit_and_repro_input_errors():
    p = kvchaos("audit", "--prefill", "http://127.0.0.1:9")
    assert p.returncode == 2 and "--decode URL" in p.stderr
    p = kvchaos("audit", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", "--timeout", "2")
    assert p.returncode == 2 and "not reachable" in p.stderr
    p = kvchaos("repro", "nope")
    assert p.returncode == 2 and "unknown incident 'nope'" in p.stderr and "glm53" in p.stderr
    p = kvchaos("repro", "--list")
    assert p.returncode == 0 and "glm53" in p.stdout and "--scale incident" in p.stdout
    p = kvchaos("repro", "glm53", "--scale", "huge")
    assert p.returncode == 2 and "unknown scale 'huge'; one of ci, incident, largest-fit" in p.stderr, p.stderr
    p = kvchaos("audit", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", "--lb-probe", "sse")
    assert p.returncode == 2 and "--lb-probe 'sse': unknown mode(s) ['sse']" in p.stderr


def test_bisect_input_errors_before_any_cluster():
    p = kvchaos("bisect", "--releases", "0.5.19,latest")
    assert p.returncode == 2 and "not a release version: 'latest'" in p.stderr
    p = kvchaos("bisect", "--trials", "0")
    assert p.returncode == 2 and "--trials 0: at least 1" in p.stderr
    p = kvchaos("bisect", "--deployment", "paged")
    assert p.returncode == 2 and "--deployment 'paged': one of incident, auto-truncate" in p.stderr
    p = kvchaos("bisect", "--releases", "0.5.18")
    assert p.returncode == 2 and "no recipe for sglang 0.5.18" in p.stderr


# --------------------------------------------------------------------------- docs/reference/cli.md
# The page's per-command sections are generated from the parser itself, so they cannot go stale:
# ``python -m tests.test_cli --write`` rewrites them between the markers; the test below fails (and
# says to run that) when a command, option, default or help text changed without the page.
CLI_PAGE = REPO / "docs" / "reference" / "cli.md"
GEN_BEGIN = "<!-- BEGIN generated by `python -m tests.test_cli --write`: edit the commands, not this -->"
GEN_END = "<!-- END generated -->"


def _md(text: str) -> str:
    """Prose for a markdown table cell / paragraph: no raw HTML (``<run-id>``), no cell breaks."""
    return " ".join(text.split()).replace("&", "&amp;").replace("<", "&lt;").replace("|", "\\|")


def _config_keys(cmd: str) -> dict:
    """dest -> the config key that sets its default, found by setting each key and seeing which default moves."""
    from kvchaos.cli import CONFIG_KEYS, build_parser

    def defaults(cfg):
        sp = _subparsers(build_parser(cfg))[cmd]
        return {a.dest: a.default for a in sp._actions}

    base, out = defaults({}), {}
    sentinels = {str: "§", list: ["§"], bool: True, int: 987654}
    for key, typ in CONFIG_KEYS.items():
        val = sentinels.get(typ, 987654 if typ == (int, float) else "§")
        out.update({dest: key for dest, d in defaults({key: val}).items() if d != base[dest]})
    return out


def _subparsers(parser) -> dict:
    import argparse

    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _option_rows(sp, keys: dict) -> list[str]:
    import argparse

    fmt = sp._get_formatter()
    rows = []
    for a in sp._actions:
        if a.help == argparse.SUPPRESS or isinstance(a, argparse._HelpAction):
            continue
        if a.option_strings:
            inv = fmt._format_action_invocation(a)
        else:
            inv = fmt._format_args(a, fmt._get_default_metavar_for_positional(a))
        if isinstance(a.default, bool) or a.nargs == 0:
            default = "on" if a.default else "off"
        else:
            default = "—" if a.default is None else f"`{a.default}`"
        key = f"`{keys[a.dest]}`" if a.dest in keys else ""
        rows.append(f"| `{inv}` | {default} | {key} | {_md(a.help) if a.help else '—'} |")
    return rows


def cli_reference() -> str:
    """The generated part of docs/reference/cli.md: per command its help, description, usage and options."""
    import os

    from kvchaos.cli import build_parser
    from kvchaos.commands import COMMANDS

    cols = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "102"  # argparse wraps the usage to the terminal: the page's width, fixed
    try:
        subs = _subparsers(build_parser({}))
        out = [GEN_BEGIN, ""]
        for mod in COMMANDS:
            sp = subs[mod.NAME]
            out += [f"### `kvchaos {mod.NAME}`", "", _md(mod.HELP), ""]
            if getattr(mod, "DESCRIPTION", None):
                out += [_md(mod.DESCRIPTION), ""]
            out += ["```text", sp.format_usage().strip(), "```", "",
                    "| option | default | config key | meaning |", "|---|---|---|---|",
                    *_option_rows(sp, _config_keys(mod.NAME)), ""]
    finally:
        if cols is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = cols
    return "\n".join(out + [GEN_END])


def test_cli_reference_page_is_current():
    from kvchaos.cli import CONFIG_KEYS
    from kvchaos.commands import COMMANDS

    page = CLI_PAGE.read_text()
    assert GEN_BEGIN in page and GEN_END in page, f"{CLI_PAGE}: the generated section's markers are gone"
    current = page[page.index(GEN_BEGIN):page.index(GEN_END) + len(GEN_END)]
    assert current == cli_reference(), f"{CLI_PAGE} is stale: run `python -m tests.test_cli --write`"
    hand = page.replace(current, "")
    for mod in COMMANDS:  # the hand-written exit-code table names every command
        assert f"| `{mod.NAME}` |" in hand, f"{CLI_PAGE}: no exit codes for {mod.NAME}"
    for key in CONFIG_KEYS:  # and the configuration section every key
        assert f"`{key}`" in hand, f"{CLI_PAGE}: config key {key} not listed"


def test_every_command_module_has_the_interface():
    from kvchaos.cli import build_parser
    from kvchaos.commands import COMMANDS

    names = [m.NAME for m in COMMANDS]
    assert names == list(_subparsers(build_parser({})))
    for mod in COMMANDS:
        assert isinstance(mod.HELP, str) and callable(mod.add_parser) and callable(mod.run), mod.__name__


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.test_cli --write   (regenerates the commands of docs/reference/cli.md)")
    text = CLI_PAGE.read_text()
    start, end = text.index(GEN_BEGIN), text.index(GEN_END) + len(GEN_END)
    CLI_PAGE.write_text(text[:start] + cli_reference() + text[end:])
    print(f"wrote {CLI_PAGE}")
