"""Options of the kvchaos plugin (``--kvchaos-*``), its markers, and the parsing of the options that
shape a run: the profile path, ``--kvchaos-backends`` and ``--kvchaos-layouts`` (with the profile's
``[suites] layouts`` and ``--kvchaos-probe-like``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvchaos.cluster.layouts import SHORT, LayoutError, parse_list
from kvchaos.cluster.spec import PROFILE_DIR, TRANSFER_BACKENDS, ClusterSpec, SpecError
from kvchaos.probe import like

# (layout names, named explicitly): parsed once per session
LAYOUTS = pytest.StashKey[tuple]()


def pytest_addoption(parser):
    g = parser.getgroup("kvchaos")
    g.addoption("--kvchaos-profile", default=os.environ.get("KVCHAOS_PROFILE", "cpu"),
                help="cluster profile name (kvchaos/profiles) or TOML path [cpu]")
    g.addoption("--kvchaos-agent-channel", default=os.environ.get("KVCHAOS_AGENT_CHANNEL"), choices=("unix", "tcp"),
                help="how the harness reaches the in-engine agents of a launched cluster: unix (their control "
                     "directory) or tcp (each server's gateway with a token; no engine-side file read) "
                     "[the profile's agent_channel]")
    g.addoption("--kvchaos-topology", default=os.environ.get("KVCHAOS_TOPOLOGY"), choices=("one-host", "two-hosts"),
                help="two-hosts: prefill and decode each in a network namespace of its own, the agents over "
                     "TCP, engine-side files out of the harness's view (kvchaos.cluster.netns) [the profile's]")
    g.addoption("--kvchaos-attach", default=os.environ.get("KVCHAOS_ATTACH"),
                help="attach to running servers: router=URL,prefill=URL,decode=URL")
    g.addoption("--kvchaos-reference", default=os.environ.get("KVCHAOS_REFERENCE"),
                help="URL of a single (non-disaggregated) reference server, for attach mode")
    g.addoption("--kvchaos-model", default=os.environ.get("KVCHAOS_MODEL"),
                help="model override: tiny:SEED or a model directory")
    g.addoption("--kvchaos-reports", default=os.environ.get("KVCHAOS_REPORTS", "reports"),
                help="directory for run reports [reports]")
    g.addoption("--kvchaos-accept-known", action="store_true",
                default=os.environ.get("KVCHAOS_ACCEPT_KNOWN", "") not in ("", "0"),
                help="a verdict matching a known engine finding (kvchaos/findings.toml) for the running engine "
                     "version is KNOWN, not red [the profile's [policy] accept_known]")
    g.addoption("--kvchaos-strict", action="store_true", default=os.environ.get("KVCHAOS_STRICT", "") not in ("", "0"),
                help="fail the run when a listed finding did not reproduce on the engine version it lists")
    g.addoption("--kvchaos-findings", default=os.environ.get("KVCHAOS_FINDINGS"),
                help="known-findings registry TOML [kvchaos/findings.toml]")
    g.addoption("--kvchaos-blind-model", action="store_true",
                default=os.environ.get("KVCHAOS_BLIND_MODEL", "") not in ("", "0"),
                help="declare a model that cannot echo canaries: isolation is not claimed (UNKNOWN, reported, not red)")
    g.addoption("--kvchaos-releases", default=os.environ.get("KVCHAOS_RELEASES", "0.5.19,0.5.20,0.5.21,0.5.22,0.5.23"),
                help="SGLang releases the release matrix (suites/incidents/test_release_matrix.py, marker "
                     "bisect) runs the unmodified incident on, each in its own environment")
    g.addoption("--kvchaos-deployment", default=os.environ.get("KVCHAOS_DEPLOYMENT", "incident"),
                help="how the release matrix deploys each release: incident (prefill pool < context) or "
                     "auto-truncate (the same with --allow-auto-truncate on both roles)")
    g.addoption("--kvchaos-trials", type=int, default=int(os.environ.get("KVCHAOS_TRIALS", "3")),
                help="trials per release in the release matrix (a fresh cluster each)")
    g.addoption("--kvchaos-layouts", default=os.environ.get("KVCHAOS_LAYOUTS"),
                help="comma-separated KV layouts to run the suites over, one cluster each (e.g. "
                     "mha-p1-fp32,gqa-p64-bf16,mla-p64-bf16) [the profile's [suites] layouts, for tests "
                     "marked every_layout]")
    g.addoption("--kvchaos-probe-like", default=os.environ.get(like.ENV), metavar="PATH/config.json",
                help="a model config (Hugging Face config.json; geometry only): register it as like:<its stem> and run "
                     "on layout like:<stem>-p<the profile's page size>-<the config's dtype>, a probe with that "
                     "model's KV-cache geometry (kvchaos.probe.like); with --kvchaos-layouts it only registers the "
                     "config, for the like:<stem>-... layouts named there. Several: separated by "
                     f"{os.pathsep!r}, a layout each [{like.ENV}]")
    g.addoption("--kvchaos-seed", default=os.environ.get("KVCHAOS_SEED"),
                help="the run's seed: every suite's workload and every fault's randomness derive from it "
                     "(kvchaos.workload.seed; 0 = the reviewed plans) [a fresh random one, printed and recorded]")
    g.addoption("--kvchaos-dry", action="store_true", default=False,
                help="record each test's first experiment's plans (digest, seed) in <run dir>/plans.jsonl and "
                     "send nothing: no cluster is started (kvchaos digests compares two dry runs)")
    g.addoption("--kvchaos-shrink", default=None, metavar="EXPERIMENT",
                help="once the experiment of this name is judged FAIL, shrink it to a minimal scenario that still "
                     "fails the same way (kvchaos.shrink): <run dir>/shrink/<name>/ (kvchaos shrink starts this)")
    g.addoption("--kvchaos-shrink-budget-s", type=float, default=1200.0, help="shrink: wall-clock bound [1200]")
    g.addoption("--kvchaos-shrink-steps", type=int, default=40, help="shrink: at most this many attempts [40]")
    g.addoption("--kvchaos-shrink-checker", default=None,
                help="shrink: the checker whose FAIL to keep [the first leak checker that failed]")
    g.addoption("--kvchaos-progress", default=os.environ.get("KVCHAOS_PROGRESS", "auto"), metavar="auto|on|off",
                help="progress lines on the terminal: tests done and left, the test running, an ETA from earlier "
                     "runs' durations, each experiment as it opens and its verdicts as it closes. auto: a test's "
                     "line when 10 s have passed since the last one or the test took 10 s or more last time; on: "
                     "every test's; off: none (progress.jsonl is written either way) [auto]")
    g.addoption("--kvchaos-backends", default=os.environ.get("KVCHAOS_BACKENDS"),
                help="comma-separated KV transfer backends to run the suites over, one cluster each "
                     "(e.g. mooncake_tcp,nixl) [the profile's]")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped with the reason when none is visible)")
    config.addinivalue_line("markers", "slow: long sweeps, deselected by default (-m slow)")
    config.addinivalue_line("markers", "cluster: uses the real cluster")
    config.addinivalue_line("markers", "bisect: the release matrix (kvchaos bisect): one cluster per release and trial")
    config.addinivalue_line("markers", "disruptive: leaves the engine busy on purpose; run at the end of the session")
    config.addinivalue_line("markers", "every_layout(own=True): runs on every layout of the profile's [suites] "
                            "layouts in a default run (without --kvchaos-layouts); own=False: on the others only")
    config.addinivalue_line("markers", "layouts(*names): the only KV layouts this test applies to")
    config.addinivalue_line("markers", "exclusive: measures time; under pytest-xdist no other worker runs a test "
                            "meanwhile (kvchaos.machine_lock); runs after the others on its cluster, before the "
                            "disruptive ones")
    config.addinivalue_line("markers", "backends(*names): the KV transfer backends this test applies to "
                            "(default: every backend for suites/, the first one for the harness's own tests)")


def backends(config) -> list[str]:
    """The KV transfer backends ``--kvchaos-backends`` names ([]: the profile's)."""
    raw = config.getoption("--kvchaos-backends")
    if not raw:
        return []
    names = list(dict.fromkeys(x.strip() for x in raw.split(",") if x.strip()))
    bad = [n for n in names if n not in TRANSFER_BACKENDS]
    if bad or not names:
        raise pytest.UsageError(f"--kvchaos-backends {raw!r}: unknown backend(s) {bad}; one of {TRANSFER_BACKENDS}")
    return names


def profile_path(config) -> Path:
    prof = config.getoption("--kvchaos-profile")
    return Path(prof) if prof.endswith(".toml") else PROFILE_DIR / f"{prof}.toml"


def _profile_layouts(config) -> str:
    """The profile's ``[suites] layouts`` ("" for a model of one's own or an attached cluster)."""
    import tomllib

    path = profile_path(config)
    try:
        table = tomllib.loads(path.read_text()).get("suites", {}) if path.exists() else {}
    except tomllib.TOMLDecodeError as e:
        raise pytest.UsageError(f"profile {path}: invalid TOML: {e}") from None
    # a model of one's own, or an attached cluster, has the layout it has
    if config.getoption("--kvchaos-model") or config.getoption("--kvchaos-attach"):
        return ""
    return ",".join(table.get("layouts", []))


def probe_like(config) -> str | None:
    """Register ``--kvchaos-probe-like``'s configs (``kvchaos.probe.like.register``: this process and the
    ones it starts resolve ``like:<stem>``) and return the layouts they select, comma-separated:
    ``like:<stem>-p<the profile's page size>-<the config's dtype>``; None without the option."""
    raw = config.getoption("--kvchaos-probe-like")
    paths = [x.strip() for x in (raw or "").split(os.pathsep) if x.strip()]
    if not paths:
        return None
    if config.getoption("--kvchaos-model") or config.getoption("--kvchaos-attach"):
        raise pytest.UsageError("--kvchaos-probe-like runs a probe with a model's KV geometry on a cluster it launches: "
                                "it cannot be combined with --kvchaos-model or --kvchaos-attach")
    try:
        geos = [like.register(p) for p in paths]
        page = ClusterSpec.load(config.getoption("--kvchaos-profile")).page_size
    except (like.LikeError, SpecError) as e:
        raise pytest.UsageError(f"--kvchaos-probe-like: {e}") from None
    return ",".join(f"{like.PREFIX}{g.name}-p{page}-{SHORT[g.dtype]}" for g in geos)


def layouts(config) -> tuple[list[str], bool]:
    """(layout names, named explicitly). The first is the one every test runs on; explicitly named
    layouts run every suite on each; the profile's ``[suites] layouts`` only the every_layout tests.
    ``--kvchaos-probe-like`` alone names its layout explicitly (every suite runs on it)."""
    cached = config.stash.get(LAYOUTS, None)
    if cached is not None:
        return cached

    like_layout = probe_like(config)
    raw = config.getoption("--kvchaos-layouts")
    explicit = bool(raw)
    if not raw and like_layout:
        raw, explicit = like_layout, True
    elif not raw:
        raw = _profile_layouts(config)
    elif config.getoption("--kvchaos-model") or config.getoption("--kvchaos-attach"):
        raise pytest.UsageError("--kvchaos-layouts picks each layout's probe model and launches a cluster for it: "
                                "it cannot be combined with --kvchaos-model or --kvchaos-attach")
    try:
        names = [x.name for x in parse_list(raw)] if raw else []
    except LayoutError as e:
        raise pytest.UsageError(f"--kvchaos-layouts: {e}") from None
    config.stash[LAYOUTS] = (names, explicit)
    return names, explicit
