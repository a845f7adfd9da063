"""KV layouts as an axis: names, what they set on a spec, and which tests run on which layout."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvchaos.cluster import ClusterSpec
from kvchaos.cluster.layouts import Layout, LayoutError, apply, of_spec, parse, parse_list
from kvchaos.cluster.spec import SpecError

REPO = Path(__file__).resolve().parents[1]


def test_names_parse_and_round_trip():
    lay = parse("mla-p64-bf16")
    assert lay == Layout("mla", 64, "bf16") and lay.name == "mla-p64-bf16"
    assert lay.overrides() == {"model": "probe:mla", "page_size": 64, "dtype": "bfloat16"}
    assert parse("mha-p1-fp32").model == "probe"  # the committed probe
    assert [x.name for x in parse_list("gqa-p16-bf16, gqa-p16-bf16,mha-p1-fp32")] == ["gqa-p16-bf16", "mha-p1-fp32"]


@pytest.mark.parametrize("bad, why", [("mla64bf16", "expected <attention>-p<page size>-<dtype>"),
                                      ("xyz-p1-fp32", "attention 'xyz'"), ("mha-p0-fp32", "page size must be >= 1"),
                                      ("mha-p1-fp8", "dtype 'fp8'"), (" , ", "name at least one layout")])
def test_bad_names_are_refused_naming_the_problem(bad, why):
    with pytest.raises(LayoutError, match=why.replace("(", r"\(").replace(")", r"\)")):
        parse_list(bad)


def test_a_layout_sets_model_page_and_dtype_and_the_spec_names_it():
    base = ClusterSpec.load("cpu")
    assert base.layout == "mha-p1-fp32"
    spec = ClusterSpec.from_dict(apply(base.to_dict(), parse("gqa-p64-bf16")))
    assert (spec.model, spec.page_size, spec.dtype, spec.name) == ("probe:gqa", 64, "bfloat16", "cpu-gqa-p64-bf16")
    assert spec.layout == "gqa-p64-bf16"
    with pytest.raises(LayoutError, match="not a multiple of page size 48"):
        apply({**base.to_dict(), "pool_tokens": 2048}, parse("mha-p48-fp32"))
    assert of_spec(ClusterSpec.load("cpu", model="tiny:0")) == "tiny-p1-fp32"
    with pytest.raises(SpecError, match="probe kind 'xyz'"):
        ClusterSpec.load("cpu", model="probe:xyz")


def _collect(*args, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVCHAOS_")}
    e.update(env or {})
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-m", "not slow", *args], cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    return r, [x for x in r.stdout.splitlines() if "::" in x]


def test_default_run_puts_only_every_layout_tests_on_the_profiles_other_layouts():
    r, ids = _collect("suites/test_smoke.py", "suites/test_transfer_delay.py", "suites/test_detection_matrix.py")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # every_layout(own=False): the matrix goes on the profile's other layouts only
    matrix = [i for i in ids if "test_detection_matrix" in i]
    assert matrix and all("[mla-p64-bf16-" in i for i in matrix), matrix
    ids = [i for i in ids if "test_detection_matrix" not in i]
    smoke = [i for i in ids if "test_smoke" in i and "token_identical" in i]
    assert [i.split("[")[1] for i in smoke] == ["mha-p1-fp32]", "mla-p64-bf16]"]
    delay = [i for i in ids if "test_transfer_delay" in i]
    assert delay and all(i.endswith("[mha-p1-fp32]") for i in delay)
    # one cluster per layout: every test of a layout before the next layout's
    layouts = [i.split("[")[1] for i in ids]
    assert layouts == sorted(layouts, key=["mha-p1-fp32]", "mla-p64-bf16]"].index)


def test_named_layouts_run_every_suite_on_each_and_harness_tests_on_the_first():
    r, ids = _collect("suites/test_transfer_delay.py", "tests/test_probe_model.py",
                      "--kvchaos-layouts", "gqa-p16-bf16,mla-p64-bf16")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    delay = [i for i in ids if "test_transfer_delay" in i]
    assert len([i for i in delay if i.endswith("[mla-p64-bf16]")]) == len(delay) // 2 > 0
    live = [i for i in ids if "through_the_pd_cluster" in i]
    assert live == ["tests/test_probe_model.py::test_probe_through_the_pd_cluster[gqa-p16-bf16]"]
    # named layouts: every_layout(own=False) tests run on each named layout, the first included
    r, ids = _collect("suites/test_detection_matrix.py", "--kvchaos-layouts", "mha-p1-fp32,mla-p64-bf16")
    assert any("[mha-p1-fp32-" in i for i in ids) and any("[mla-p64-bf16-" in i for i in ids), ids


def test_a_layouts_exclusive_tests_run_after_its_others_and_before_its_disruptive_ones():
    r, ids = _collect("suites/test_prefix_cache.py", "suites/test_process_kill.py", "suites/test_smoke.py")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    mha = [i for i in ids if i.endswith("[mha-p1-fp32]")]
    timing = [i for i, x in enumerate(mha) if "test_timing_does_not_tell" in x]
    kill = [i for i, x in enumerate(mha) if "test_process_kill" in x]
    assert timing and kill, mha
    # collected in file order the timing test sits between the prefix-cache tests; sorted, every other test
    # comes first, the disruptive ones after it
    assert timing == [len(mha) - len(kill) - 1] and kill == list(range(len(mha) - len(kill), len(mha))), mha


@pytest.mark.parametrize("args, msg", [
    (["--kvchaos-layouts", "mla-p64-int4"], "dtype 'int4'"),
    (["--kvchaos-layouts", "mla-p64-bf16", "--kvchaos-model", "tiny:0"], "cannot be combined with --kvchaos-model"),
])
def test_bad_layout_options_stop_the_run_with_the_reason(args, msg):
    r, _ = _collect("suites/test_smoke.py", *args)
    assert r.returncode != 0 and msg in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]


def test_a_like_layout_on_cpu_sets_the_pace_of_its_layers_and_a_gpu_or_plain_layout_does_not():
    """On CPU a like: probe computes every layer (like:llama-3.1-8b: 32, like:deepseek-v3: 61), so its
    time bounds stretch by its layers over the probes' 2; on a GPU, and for the 2-layer layouts, they do
    not. A profile's own pace multiplies in; nothing exceeds PACE_MAX."""
    from kvchaos.cluster.layouts import PACE_MAX, pace
    base = ClusterSpec.load("cpu").to_dict()
    assert ClusterSpec.from_dict(apply(base, parse("like:llama-3.1-8b-p64-bf16"))).pace == 16
    assert ClusterSpec.from_dict(apply(base, parse("like:deepseek-v3-p64-bf16"))).pace == 30.5
    assert ClusterSpec.from_dict(apply(base, parse("mla-p64-bf16"))).pace == 1
    assert pace(parse("like:llama-3.1-8b-p64-bf16"), "cuda") == 1
    assert apply({**base, "pace": 2.0}, parse("like:llama-3.1-8b-p64-bf16"))["pace"] == 32
    assert apply({**base, "pace": 8.0}, parse("like:deepseek-v3-p64-bf16"))["pace"] == PACE_MAX
    assert apply({**base, "pace": 2.0}, parse("gqa-p16-bf16"))["pace"] == 2


@pytest.mark.parametrize("bad", [0.5, 0, 65, float("nan"), "2", True])
def test_a_pace_outside_one_to_pace_max_is_refused_naming_it(bad):
    with pytest.raises(SpecError, match="pace=.* must be a number"):
        ClusterSpec.load("cpu", pace=bad)
