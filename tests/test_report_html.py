"""report.html opened in headless Chromium (Debian's chromium + chromedriver, installed by
scripts/setup.sh, driven by selenium): the elements a reader needs must render — summary, verdict
tables, the timeline and latency plots with one bar per request and the fault window, every leak
witness with the leaked text highlighted — and the page must load nothing from outside itself."""

import re
import shutil

import pytest

from kvchaos import canary
from kvchaos.report import build
from tests.test_report import make_run

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
