"""The kvchaos hooks (kvchaos/plugin/hookspecs.py, docs/reference/hooks.md): each is called, and what it
returns takes effect where kvchaos uses it — a checker a conftest adds judges the experiments, a
report section lands in report.html, a fault kind arms through ``faults.kinds`` and is healed after
the test. Inner sessions run in-process (pytester) with the plugin as installed."""

from __future__ import annotations

import json

import pytest

import kvchaos.oracles.base  # noqa: F401 - imported before the inner runs (pytester drops what they import)
import kvchaos.plugin.fixtures  # noqa: F401
import kvchaos.policy  # noqa: F401
import kvchaos.report  # noqa: F401

pytest_plugins = ["pytester"]

ARGS = ("-p", "no:cacheprovider", "-o", "testpaths=", "-o", "addopts=", "--kvchaos-reports", "reports")


def _run(pytester, *extra):
    return pytester.runpytest_inprocess(*ARGS, *extra)


def _run_dir(pytester):
    (d,) = (pytester.path / "reports").iterdir()
    return d


CHECKER_CONFTEST = """
from kvchaos.oracles.base import Checker, Verdict

class Canary(Checker):
    name, leak, log_only = "conftest_canary", True, True
    def check(self, history, registry=None):
        return Verdict(self.name, "fail", "added by a conftest: FAILs every history")

CALLS = []

def pytest_kvchaos_checkers(config):
    CALLS.append(config)
    return [Canary()]
"""

CHECKER_TEST = """
import conftest
from kvchaos.oracles import Liveness
from kvchaos.oracles.base import Verdict
from kvchaos.policy import Context

class StandIn:
    pass

def test_the_policy_judges_by_the_added_checker(kvchaos_policy, experiment):
    assert len(conftest.CALLS) == 1
    ex = experiment("hooked", [], [Liveness(bound_s=60)], cluster=StandIn(), faults=None)
    assert "conftest_canary" in ex.checks.names and "conftest_canary" not in ex.claimed
    assert "conftest_canary" in kvchaos_policy.checks([Liveness(bound_s=60)])[0].names
    verdicts = ex.checks.check([])
    j = kvchaos_policy.judge(verdicts, Context.of([]), {})
    red = {i.verdict.oracle: i.verdict.status for i in j.red}
    assert red.get("conftest_canary") == "fail"  # an added leak checker's FAIL is red
"""


def test_checkers_hook_adds_checkers_to_every_experiment(pytester):
    pytester.makeconftest(CHECKER_CONFTEST)
    pytester.makepyfile(test_inner=CHECKER_TEST)
    _run(pytester).assert_outcomes(passed=1)


def test_without_the_checkers_hook_the_policy_is_unchanged(pytester):
    pytester.makepyfile(test_inner="""
        from kvchaos.policy import Policy
        def test_plain(kvchaos_policy):
            assert type(kvchaos_policy) is Policy
            assert "conftest_canary" not in kvchaos_policy.checks([])[0].names
    """)
    _run(pytester).assert_outcomes(passed=1)


def test_a_checkers_hook_returning_a_non_checker_is_a_usage_error(pytester):
    pytester.makeconftest("def pytest_kvchaos_checkers(config):\n    return ['isolation']\n")
    pytester.makepyfile(test_inner="def test_x(kvchaos_policy):\n    pass\n")
    r = _run(pytester)
    assert r.ret != 0
    r.stdout.fnmatch_lines(["*pytest_kvchaos_checkers returned 'isolation': not a checker*"])


def test_report_sections_hook_adds_sections_to_report_html(pytester):
    pytester.makeconftest("""
        SEEN = []
        def pytest_kvchaos_report_sections(config, run_dir):
            SEEN.append(run_dir)
            (run_dir / "sections-called.json").write_text('"' + str(run_dir) + '"')
            return [{"title": "Capacity", "html": "<p id='cap'>pool 81% used</p>"},
                    ("Notes", "a < b & c")]
    """)
    pytester.makepyfile(test_inner="def test_ok():\n    pass\n")
    r = _run(pytester)
    r.assert_outcomes(passed=1)
    d = _run_dir(pytester)
    assert (pytester.path / json.loads((d / "sections-called.json").read_text())).resolve() == d.resolve()
    page = (d / "report.html").read_text()
    assert "<h2>Capacity</h2><p id='cap'>pool 81% used</p>" in page
    assert "<h2>Notes</h2><pre>a &lt; b &amp; c</pre>" in page
    assert page.index("plugin-section") < page.index('<section id="logs">')  # before the engine logs
    r.stdout.fnmatch_lines(["kvchaos report sections (plugins): Capacity, Notes"])


def test_a_broken_report_section_leaves_the_report_and_says_so(pytester):
    pytester.makeconftest("def pytest_kvchaos_report_sections(run_dir):\n    return [{'html': 'no title'}]\n")
    pytester.makepyfile(test_inner="def test_ok():\n    pass\n")
    r = _run(pytester)
    assert r.ret == 0
    d = _run_dir(pytester)
    assert (d / "report.html").exists() and "no title" not in (d / "report.html").read_text()
    assert "not a section" in (d / "report-sections-error.txt").read_text()
    r.stdout.fnmatch_lines(["kvchaos report sections (plugins): NOT ADDED*"])


FAULT_CONFTEST = """
import pytest
from faults.base import Fault

LOG = []

class Blip(Fault):
    injector = "conftest"
    def __init__(self, kit, ms):
        self.id, self.kind, self.ms, self.kit = f"blip-{ms}", "blip", ms, kit
        LOG.append(("armed", ms))
    def verify(self):
        return []
    def heal(self):
        if not self.healed:
            LOG.append(("healed", self.ms))
        self.healed = True
    def fired_events(self):
        return []

def pytest_kvchaos_fault_kinds():
    return {"blip": Blip}

class StandIn:
    def check_alive(self):
        pass
    def generate(self, **kw):
        return type("R", (), {"status_code": 200, "text": "ok"})()

@pytest.fixture(scope="session")
def cluster():
    return StandIn()
"""


def test_fault_kinds_hook_arms_through_faults_kinds_and_is_healed(pytester):
    pytester.makeconftest(FAULT_CONFTEST)
    pytester.makepyfile(test_inner="""
        import conftest

        def test_arms(faults):
            assert sorted(faults.kinds) == ["blip"]
            f = faults.kinds["blip"](ms=5)
            assert f.kit is faults and f.id == "blip-5" and not f.healed
            assert conftest.LOG == [("armed", 5)]

        def test_healed_after(faults):
            assert conftest.LOG == [("armed", 5), ("healed", 5)]
    """)
    _run(pytester).assert_outcomes(passed=2)


def test_an_unknown_fault_kind_names_those_there_are(pytester):
    pytester.makeconftest(FAULT_CONFTEST)
    pytester.makepyfile(test_inner="""
        import pytest

        def test_unknown(faults):
            with pytest.raises(KeyError, match="'nope': not one a plugin adds \\\\(blip\\\\)"):
                faults.kinds["nope"]
    """)
    _run(pytester).assert_outcomes(passed=1)


def test_the_package_alone_is_the_whole_plugin(pytester):
    """``-p kvchaos.plugin`` without the installed entry point: options, fixtures, hooks and outcomes."""
    pytester.makeconftest("def pytest_kvchaos_report_sections(run_dir):\n    return [('Solo', 'x')]\n")
    pytester.makepyfile(test_inner="""
        def test_fixtures(kvchaos_seed, kvchaos_run_dir, kvchaos_policy, seeds):
            assert kvchaos_seed == 7 and kvchaos_run_dir.is_dir() and seeds.run == 7
    """)
    r = _run(pytester, "-p", "no:kvchaos", "-p", "kvchaos.plugin", "--kvchaos-seed", "7")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["kvchaos seed: 7 (again: --kvchaos-seed 7)", "*kvchaos report sections (plugins): Solo"])
