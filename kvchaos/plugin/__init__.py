"""The kvchaos pytest plugin (entry point ``kvchaos``): a session-scoped real cluster for chaos suites.

One plugin made of modules by concern, the way ``_pytest`` is: registering this package (the pytest11
entry point) registers each module below (``pytest_plugins``, which pytest honours in a plugin module)
and adds the kvchaos hooks (:mod:`kvchaos.plugin.hookspecs`; docs/reference/hooks.md). Session state
lives in ``config.stash`` / ``item.stash`` under the modules' ``pytest.StashKey``s.

  options      the ``--kvchaos-*`` options and markers; profile, backend and layout option parsing
               (``--kvchaos-probe-like``: a model's KV geometry as a ``like:`` layout)
  rundir       run id and seed, run.json, progress.jsonl, the report at session end, terminal summary
  progress     the progress lines rundir registers (tests done and left, ETA, each experiment's verdicts
               as judged)
  known        the KNOWN outcome, findings.json, the rerun rule
  xdist        the machine lock under pytest-xdist
  parametrize  one session cluster per backend / layout, test order, the CUDA probe for ``gpu`` tests
  fixtures     every fixture
  defences     ``--kvchaos-defences``: the GPU profile's defence arm (the engine's own KV checksum and
               kv-canary on both roles, their checkers on every experiment, their table in the report)

Options
  --kvchaos-profile NAME|PATH   cluster profile (default: cpu)
  --kvchaos-attach  router=URL,prefill=URL,decode=URL   use running servers instead of launching
                    [,prefill_agent=tcp://H:P,decode_agent=tcp://H:P]  their agent gateways
                                (KVCHAOS_AGENT_TOKEN); process faults via KVCHAOS_K8S_* (faults/k8s.py)
  --kvchaos-agent-channel unix|tcp   how the harness reaches a launched cluster's agents
  --kvchaos-topology one-host|two-hosts   two-hosts: prefill and decode in network namespaces
  --kvchaos-reference URL       reference single server for differential checks in attach mode
  --kvchaos-model   tiny:SEED|DIR   override the profile's model
  --kvchaos-reports DIR         where run directories go (default: ./reports)
  --kvchaos-backends A,B        run the cluster tests once per KV transfer backend (mooncake_tcp,nixl)
  --kvchaos-layouts A,B         run the suites once per KV layout (kvchaos.cluster.layouts: mha-p1-fp32,
                                gqa-p64-bf16, mla-p64-bf16, ...), one session cluster each; without it the
                                profile's [suites] layouts apply to tests marked every_layout only
  --kvchaos-releases A,B        releases the release matrix runs the unmodified incident on (marker bisect)
  --kvchaos-trials N            trials per release (default 3; a fresh cluster each)
  --kvchaos-deployment D        incident | auto-truncate: how the release matrix deploys each release
  --kvchaos-accept-known        known engine findings matched for the running version are KNOWN, not red
                                (default: the profile's [policy] accept_known)
  --kvchaos-strict              fail the run when a listed finding did not reproduce ("fixed?")
  --kvchaos-blind-model         declare a model that cannot echo canaries (isolation not claimed)
  --kvchaos-findings PATH       known-findings registry [kvchaos/findings.toml]
  --kvchaos-progress auto|on|off  progress lines: tests done and left, the test running, an ETA from
                                earlier runs' durations, each experiment's verdicts as judged [auto]

Fixtures
  kvchaos_spec      the ClusterSpec in force
  cluster           session-scoped launched (or attached) prefill/decode/router cluster
  reference_server  session-scoped single (non-disaggregated) server of the same model
  kvchaos_run_dir   reports/<run-id>/ for this session
  faults            per-test FaultKit (agent / net / proc injectors) writing
                    reports/<run-id>/events/<test>.jsonl; healed after the test even on failure,
                    and the test errors if anything is still armed afterwards
  experiment        factory of kvchaos.experiment.Experiment bound to this test (id, run dir, policy,
                    cluster, faults); every experiment a test runs must be judged
  kvchaos_policy    the session's verdict policy (kvchaos.policy.Policy)

Outcomes: a test whose only departures from its required verdicts are accepted known findings is
KNOWN (terminal ``K``, JUnit skipped with the finding ids, progress ``known``), never passed; the
session writes findings.json (known findings seen, listed findings that did not reproduce).

The cluster fixture runs the planted-leak self-test (kvchaos.selftest) once per session: a
cluster on which a planted leak goes unseen errors every test that uses it; one on which the model
cannot show a leak (self-test ``unknown``) makes every isolation verdict UNKNOWN (red) unless a
blind model is declared.

Markers
  gpu   needs CUDA; skipped with the reason when no CUDA device is visible
  slow  long sweeps; deselected by the default ``make test`` (run with ``-m slow``)
  every_layout  runs on every layout of the profile's ``[suites] layouts`` in a default run (smoke,
        incident, detection matrix); ``every_layout(own=False)``: on the profile's other layouts only in
        a default run (CI time); other tests run on the profile's own layout unless
        ``--kvchaos-layouts`` names layouts (then every suite runs on each)
  layouts(*names)  the only layouts this test applies to
"""

from __future__ import annotations

from kvchaos.plugin import hookspecs

pytest_plugins = [
    "kvchaos.plugin.options",
    "kvchaos.plugin.xdist",
    "kvchaos.plugin.rundir",
    "kvchaos.plugin.known",
    "kvchaos.plugin.parametrize",
    "kvchaos.plugin.fixtures",
    "kvchaos.plugin.defences",
]


def pytest_addhooks(pluginmanager):
    """The kvchaos hooks, added before the modules that call them are registered."""
    pluginmanager.add_hookspecs(hookspecs)
