"""scripts/gpu_device.py: its plan (--dry, run as a subprocess here, on a machine without a GPU), its
refusal to run without one, and the parsers that turn its steps' output into figures."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_device.py"
LIKE = ("like:llama-3.1-8b-p64-bf16", "like:deepseek-v3-p64-bf16")


def run(*args, path: str | None = None):
    env = {**os.environ, "PATH": path} if path is not None else None
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=env)


def load():
    spec = importlib.util.spec_from_file_location("gpu_device", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_dry_prints_the_plan_under_ten_minutes_and_exits_0():
    r = run("--dry", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    names = [s["name"] for s in plan["steps"]]
    assert names == ["host", "install", "versions", "readiness", "matrix"]
    assert plan["total_limit_s"] == sum(s["limit_s"] for s in plan["steps"]) <= 600 - 15
    steps = {s["name"]: s for s in plan["steps"]}
    install = " ".join(steps["install"]["argv"])
    for pin in ("sglang==0.5.23", "sglang-router==0.3.2", "mooncake-transfer-engine==0.3.13.post1",
                "-r env/requirements-harness.txt", "--no-deps -e ."):
        assert pin in install
    assert "non-cuda" not in install and "torch==" not in install  # CUDA wheels, from sglang's own metadata
    assert steps["readiness"]["argv"] == ["bash", "scripts/gpu-check.sh"]
    # every layout of the GPU profile, then the like: ones (or left out, with a warning, until they parse)
    expect = ["mha-p64-bf16", "gqa-p64-bf16", "mla-p64-bf16", *LIKE]
    assert plan["layouts"] + plan["layouts_left_out"] == expect
    assert steps["readiness"]["env"]["KVCHAOS_GPU_LAYOUTS"] == ",".join(plan["layouts"])
    for lay in plan["layouts_left_out"]:
        assert lay in LIKE and any(lay in w and "does not parse" in w for w in plan["warnings"])
    # one matrix class per layout, each a class the suite has, selected by -k
    pairs = steps["matrix"]["pairs"]
    assert [lay for lay, _c in pairs] == plan["layouts"] and len({c for _l, c in pairs}) == len(pairs)
    k = steps["matrix"]["argv"][steps["matrix"]["argv"].index("-k") + 1]
    assert all(f"({lay} and {cls})" in k for lay, cls in pairs)
    assert steps["matrix"]["env"]["KVCHAOS_MATRIX_TRIALS"] == "1" and "KVCHAOS_DEFENCES" not in steps["matrix"]["env"]


def test_dry_text_names_each_step_its_command_and_limit():
    r = run("--dry")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("gpu_device plan: 5 steps, limits summing to ")
    for name, limit in (("host", 10), ("install", 210), ("versions", 25), ("readiness", 150), ("matrix", 170)):
        assert any(ln.split()[:3] == [name, str(limit), "s"] for ln in lines), (name, r.stdout)
    assert "scripts/gpu-check.sh" in r.stdout and "suites/test_detection_matrix.py" in r.stdout


def test_the_defence_arm_adds_its_step_and_turns_the_arm_on():
    r = run("--dry", "--json", "--defences")
    assert r.returncode == 0, r.stderr
    steps = {s["name"]: s for s in json.loads(r.stdout)["steps"]}
    assert steps["matrix"]["env"]["KVCHAOS_DEFENCES"] == "1"
    assert "kvchaos.plugin.defences" in steps["matrix"]["argv"]
    assert steps["defences"]["argv"][1:4] == ["-m", "kvchaos.report.defences", "{matrix_run_dir}"]


def test_strict_layouts_turns_the_warning_into_a_refusal():
    plan = json.loads(run("--dry", "--json").stdout)
    r = run("--dry", "--strict-layouts")
    if plan["layouts_left_out"]:  # like: names this checkout does not parse yet
        assert r.returncode == 2 and "refused" in r.stderr and "does not parse" in r.stderr
    else:
        assert r.returncode == 0, r.stderr
    r = run("--dry", "--json", "--no-layout-check")
    assert r.returncode == 0 and json.loads(r.stdout)["layouts"][-2:] == list(LIKE)


@pytest.mark.parametrize("args,why", [
    (("--limit", "install=500"), "sum to"),
    (("--limit", "install"), "STEP=SECONDS"),
    (("--limit", "nothing=5"), "STEP=SECONDS"),
    (("--layouts", "mha-p64-bf16,not-a-layout"), "does not parse"),
    (("--layouts", ""), "no layouts"),
    (("--wheelhouse", "/nonexistent/wheels"), "not a directory"),
])
def test_bad_input_is_refused(args, why):
    r = run("--dry", *args)
    assert r.returncode == 2 and why in r.stderr, r.stderr


def test_it_refuses_to_run_without_a_gpu(tmp_path):
    r = run(path=str(tmp_path))  # no nvidia-smi on PATH
    assert r.returncode == 2
    assert "refused: no CUDA device on this machine (nvidia-smi not found)" in r.stderr and "--dry" in r.stderr
    assert r.stdout == ""  # nothing ran


def test_it_imports_nothing_but_the_standard_library():
    code = ("import sys, importlib.util; before = set(sys.modules); "
            f"spec = importlib.util.spec_from_file_location('g', {str(SCRIPT)!r}); m = importlib.util.module_from_spec(spec); "
            "spec.loader.exec_module(m); new = {n.split('.')[0] for n in set(sys.modules) - before}; "
            "bad = sorted(n for n in new if n not in sys.stdlib_module_names and not n.startswith('_')); print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)


# --------------------------------------------------------------------------- figures
def test_readiness_lines_become_figures():
    g = load()
    text = ("gpu-check: {\"torch\": \"2.14.1\"}\n"
            "gpu-check: mha-p64-bf16  PASS  smoke=pass  bench=pass  echo=100.0%(50/50) foreign=96.0%(48/50) "
            "stale=33.3%(5/15)  (141 s)\n"
            "gpu-check: like:deepseek-v3-p64-bf16  FAIL  smoke=FAIL(4)  bench=FAIL(1)  no rates (see "
            "reports/gpu-check-1/like:deepseek-v3-p64-bf16/probe.log)  (12 s)\n"
            "gpu-check summary (reports/gpu-check-20261210-100000, backend mooncake_tcp)\n")
    f = g.parse_readiness(text)
    assert f["out_dir"] == "reports/gpu-check-20261210-100000" and f["backend"] == "mooncake_tcp"
    assert f["layouts"]["mha-p64-bf16"] == {"status": "PASS", "smoke": "pass", "bench": "pass", "seconds": 141,
                                            "rates": {"echo": {"rate": 1.0, "hits": 50, "trials": 50},
                                                      "foreign": {"rate": 0.96, "hits": 48, "trials": 50},
                                                      "stale": {"rate": 0.333, "hits": 5, "trials": 15}}}
    assert f["layouts"]["like:deepseek-v3-p64-bf16"]["smoke"] == "FAIL(4)"
    assert f["layouts"]["like:deepseek-v3-p64-bf16"]["rates"] == {}


def test_junit_host_and_versions_become_figures(tmp_path):
    g = load()
    (tmp_path / "junit.xml").write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="0" failures="1" skipped="0" tests="2">'
        '<testcase classname="suites.test_detection_matrix" name="test_mutation_is_detected[mha-p64-bf16-reject_admitted]" '
        'time="61.2"/><testcase classname="x" name="test_mutation_is_detected[gqa-p64-bf16-early_free]" time="3.0">'
        '<failure message="missed">x</failure></testcase></testsuite></testsuites>')
    j = g.parse_junit(tmp_path / "junit.xml")
    assert (j["tests"], j["failures"]) == (2, 1)
    assert [c["outcome"] for c in j["cases"]] == ["passed", "failure"]
    assert "error" in g.parse_junit(tmp_path / "missing.xml")
    assert g.parse_host("NVIDIA H100 80GB HBM3, 81559 MiB, 550.54.15\n") == \
        {"gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory": "81559 MiB", "driver": "550.54.15"}]}
    assert g.parse_versions('noise\n{"torch": "2.14.1", "sglang": "0.5.23"}\n') == {"torch": "2.14.1", "sglang": "0.5.23"}
    assert g.parse_versions("Traceback: no torch\n") == {}


def test_a_step_past_its_limit_is_stopped_and_recorded(tmp_path):
    g = load()
    step = {"name": "readiness", "argv": [sys.executable, "-c", "import time; print('started', flush=True); "
                                          "time.sleep(60)"], "env": {}, "limit_s": 7}
    rec = g.run_step(step, tmp_path)
    assert rec["timed_out"] and rec["exit"] != 0 and rec["wall_s"] <= 7 and "started" in rec["tail"]
    rec = g.run_step({**step, "argv": [sys.executable, "-c", "print('ok')"], "limit_s": 30}, tmp_path)
    assert (rec["exit"], rec["timed_out"], rec["tail"].strip()) == (0, False, "ok")
