"""report.html opened in headless Chromium (Debian's chromium + chromedriver, installed by
scripts/setup.sh, driven by selenium): the elements a reader needs must render — the run's status
badge and reason first, then the leaks (every witness with the leaked text highlighted), the known
findings, the experiments (verdict tables, the timeline and latency plots with one bar per request
and the fault window), the tests that ran them and the harness's own tests as one line — and the page
must load nothing from outside itself."""

import json
import re
import shutil

import pytest

from kvchaos import canary
from kvchaos.report import build
from tests.test_report import make_run
from tests.test_report_findings import HANG_TEST, junit, known_run, selftest_run

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    # no skip: scripts/setup.sh installs both; a machine without them fails here, saying so
    assert CHROMIUM and DRIVER, "chromium / chromedriver not on PATH: run scripts/setup.sh (apt chromium chromium-driver)"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,1800"):
        opts.add_argument(a)
    d = webdriver.Chrome(options=opts, service=Service(DRIVER))
    d.set_page_load_timeout(60)
    yield d
    d.quit()


def _open(browser, path):
    from selenium.webdriver.common.by import By

    browser.get(path.resolve().as_uri())
    return lambda css: browser.find_elements(By.CSS_SELECTOR, css)


def test_leak_report_renders_plots_verdicts_and_highlighted_witnesses(tmp_path, browser):
    run = make_run(tmp_path, leak=True)
    r = build(tmp_path)
    page = r["html"].read_text()
    # self-contained: no script, stylesheet, image or font fetched from anywhere
    assert not re.search(r"<script|<link|<img|<iframe|url\((?!#)|src=|href=\"?https?:", page)
    q = _open(browser, r["html"])
    (summary,) = q("#summary")
    assert summary.is_displayed() and summary.get_attribute("data-overall") == "fail"
    (badge,) = q("#verdict .badge.big")
    assert badge.is_displayed() and badge.text == "FAIL"
    assert badge.value_of_css_property("background-color") == "rgba(198, 40, 40, 1)"
    (sec,) = q("section.scenario")
    assert sec.get_attribute("data-status") == "fail"
    rows = q("section.scenario table.verdicts tr")
    assert [x.text.split()[0] for x in rows[1:]] == ["isolation", "sensitivity"]
    assert "FAIL" in rows[1].text and "LEAK" in rows[1].text
    for fig in ("figure.timeline svg", "figure.latency svg"):
        (svg,) = q(fig)
        assert svg.is_displayed() and svg.size["width"] > 600 and svg.size["height"] > 150, (fig, svg.size)
    bars = q("figure.timeline svg g[id^='req-']")
    assert len(bars) == len(run["plans"]) and all(b.size["width"] > 0 for b in bars)
    assert len(q("figure.timeline svg g[id^='fault-']")) == 1  # the fault window
    donor = run["donor"]
    marks = q("div.witness.leak mark.leak")
    victims = [p for p in run["plans"] if p is not donor]
    assert len(marks) == len(victims) and len(q("div.witness.leak")) == len(victims)
    for m in marks:
        assert m.is_displayed() and m.text == canary.payload(donor.canaries[0])
        assert m.value_of_css_property("background-color") == "rgba(255, 205, 210, 1)"
        assert donor.rid in m.get_attribute("title")
    shot = tmp_path / "report.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


def test_clean_report_renders_without_leak_marks(tmp_path, browser):
    run = make_run(tmp_path, leak=False)
    q = _open(browser, build(tmp_path)["html"])
    assert q("#summary")[0].get_attribute("data-overall") == "pass"
    assert not q("mark.leak") and not q("div.witness.leak")
    assert len(q("figure.timeline svg g[id^='req-']")) == len(run["plans"])
    assert "PASS" in q("section.scenario table.verdicts tr")[1].text
    assert q("#verdict .badge.big")[0].text == "PASS" and "no leak" in q("#reason")[0].text


def test_findings_lead_the_page_in_the_browser(tmp_path, browser):
    """A run with the self-test, a leak, a known finding and 50 harness tests: the status badge, the
    leaks and the known finding come before the experiments, which come before the tests; the
    self-test shows once, labelled planted; the harness tests are one line."""
    selftest_run(tmp_path)
    leak = make_run(tmp_path, leak=True, name="transfer_delay", test="suites/test_transfer_delay.py::test_delay",
                    test_outcome="failed")
    known_run(tmp_path)
    junit(tmp_path, 50)
    (tmp_path / "progress.jsonl").write_text("".join(
        json.dumps({"ev": "end", "nodeid": f"tests/test_h.py::test_{i}", "outcome": "passed", "duration": 0.01}) + "\n"
        for i in range(50)) + (tmp_path / "progress.jsonl").read_text())
    r = build(tmp_path)
    q = _open(browser, r["html"])
    assert q("#verdict .badge.big")[0].text == "FAIL" and "transfer_delay" in q("#reason")[0].text
    top = {css: q(css)[0].location["y"] for css in ("#verdict", "#leaks", "#known", "section.scenario", "#tests",
                                                      "#harness-tests")}
    assert list(top) == sorted(top, key=top.get), top             # in this order down the page
    victims = [p for p in leak["plans"] if p is not leak["donor"]]
    marks = q("#leaks div.witness.leak mark.leak")
    assert len(marks) == len(victims) and all(m.is_displayed() for m in marks)
    (k,) = q("#known div.known-finding")
    assert k.get_attribute("data-finding") == "test-hang" and HANG_TEST in k.text and "accepted" in k.text
    (planted,) = q("section.scenario[data-planted='1']")
    assert "planted — caught as required" in planted.text and not q("section.scenario[data-planted='1'] .witness.leak")
    assert len(q("#tests tr")) == 3 and "KNOWN" in q("#tests")[0].text
    assert "harness tests: 50 passed, 0 failed" in q("#harness-tests")[0].text
    # nothing fetched from outside the page (the upstream link is a link, not a resource)
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    shot = tmp_path / "findings.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
