# Two commands on a fresh machine:
#   make run    the main job: chaos suites against the embedded CPU cluster, report under reports/
#   make test   the harness's own tests, the default (non-slow) suites and the strict docs build
#   make docs   the documentation (docs/, mkdocs.yml) into site/
VENV ?= $(HOME)/.cache/kvchaos/venv
export KVCHAOS_VENV := $(VENV)
# Python's bytecode cache stays on for every target, whatever the caller's environment says: with
# PYTHONDONTWRITEBYTECODE set, each of the hundreds of Python processes make test starts (pytest, its xdist
# workers, `python -m kvchaos` in the CLI tests, inner pytest runs) compiled this repository's ~26,000 lines
# again and pytest re-wrote the asserts of every kvchaos module: about 2 s of CPU each (bench/RESULTS.md)
unexport PYTHONDONTWRITEBYTECODE
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

LAYOUTS ?= mha-p1-fp32,gqa-p16-bf16,gqa-p64-bf16,mla-p64-bf16

.PHONY: setup run docs test test-two-hosts test-matrix test-unit test-layouts test-like soak fuzz bench clean-reports lint-workflows
setup:
	@bash scripts/setup.sh >/dev/null
	@bash scripts/setup-engine.sh 0.5.19 >/dev/null  # pre-fix release for the GLM-5.3 reproduction

run: setup
	$(PY) -m kvchaos run

# the documentation site; --strict: a broken link, anchor or a page missing from mkdocs.yml's nav fails
docs: setup
	$(PY) -m mkdocs build --strict --quiet --site-dir site

# CI's 30 minutes: the detection matrix runs 1 mutated trial per class here (its clean arms are behind
# -m slow); make test-matrix runs the full 5 mutated + 2 clean (what reports/matrix/ holds)
MATRIX_TRIALS ?= 1
MATRIX_CLEAN_TRIALS ?= 1

# the run seed (kvchaos.workload.seed): 0 is the reviewed plans, so CI's gate is reproducible;
# SEED=random (or any integer) draws other plans and fault parameters — make soak runs fresh ones
SEED ?= 0

# the two-host session's tests: the incident's replay, one fault family (both judged with isolation's
# power: decode recites canaries it only has from KV sent across the namespaces), and the check that the
# engines' files are out of the harness's sight (kvchaos/cluster/netns.py). The smoke suite on two hosts
# (its reference server's start and both tests, ~115 CPU-s of CI's) runs in make test-two-hosts
TWO_HOSTS ?= tests/test_two_hosts_live.py \
	suites/test_transfer_delay.py::test_transfer_delay_with_jitter_keeps_isolation \
	suites/incidents/test_glm53_kv_leak.py::test_replay_leaks_another_tenants_data_with_http_200

# the workflow lint (make lint-workflows, about a second), then the sessions: everything that drives a real
# cluster, one test at a time (the engines want both cores), in the foreground; beside it
# (scripts/beside.py), the harness's tests that need no cluster on 2 xdist workers, and (SPLIT=1, below)
# the cluster tests of the MLA layout, then the two-host topology (prefill and decode in network
# namespaces, every agent fault over TCP); then the strict docs build (a broken link or a page missing
# from the nav is red). All always run; the target fails if any does; Ctrl-C stops them all. Each pytest
# session leaves its own reports/<run-id>/; the output of those beside the cluster session goes to
# reports/beside*.log, printed when they end.
# Beside: they use the cores the cluster session leaves idle (72 % busy alone; bench/RESULTS.md). All hold
# one machine lock (KVCHAOS_MACHINE_LOCK, kvchaos/plugin/xdist.py), so a test that measures time
# (`exclusive`) has the machine to itself. The unit workers run torch on one thread each (OMP_NUM_THREADS=1):
# two threads per worker only spin against the engines on 2 cores.
# BESIDE=0: one session after the other (the cluster-free tests first, on 3 workers), as before.
BESIDE ?= 1
# SPLIT=1 (with BESIDE=1; the default since its second fresh clone, green, once the prefill kill's power
# floor was mended; bench/RESULTS.md): the cluster session's tests on SPLIT_LAYOUT (the incident's MLA
# layout: its own cluster, reference server and the 0.5.19 cluster) in a session of their own beside the
# rest, the two-host session after it; the cluster-free tests beside both. The two selections (-k) are
# complementary, so the same 59 tests run. SPLIT=0: one cluster session, the two-host session after the
# cluster-free tests. SPLIT_K: what goes beside — the layout's tests, the cleanup tests that start
# clusters of their own (test_teardown_real: ~75 s of the longer session; none uses the session's cluster),
# and the two disruptive suites of the default layout, on a cluster of that layout of their own (its start
# ~40 s of the shorter session): the fuzz smoke (its budget, half a minute since 2026-12-08) and the prefill kill (the prefill's
# restart) ran last in the longer session at 41-46 % busy, ~130 s of it after every other session had
# ended (bench/RESULTS.md, 2026-12-07)
SPLIT ?= 1
SPLIT_LAYOUT ?= mla-p64-bf16
SPLIT_K ?= $(SPLIT_LAYOUT) or test_teardown_real or test_fuzz_smoke or test_process_kill
CLUSTER_SESSION = env KVCHAOS_MATRIX_TRIALS=$(MATRIX_TRIALS) KVCHAOS_MATRIX_CLEAN_TRIALS=$(MATRIX_CLEAN_TRIALS) \
	$(PY) -m pytest -m "cluster and not slow and not gpu" -p no:cacheprovider --kvchaos-seed $(SEED) $(PYTEST_ARGS)
UNIT_SESSION = env OMP_NUM_THREADS=1 $(PY) -m pytest -m "not cluster and not slow and not gpu" -p no:cacheprovider \
	--kvchaos-seed $(SEED) $(PYTEST_ARGS)
TWO_HOST_SESSION = $(PY) -m pytest $(TWO_HOSTS) -m "cluster and not slow and not gpu" -p no:cacheprovider \
	--kvchaos-seed $(SEED) --kvchaos-topology two-hosts --kvchaos-layouts mha-p1-fp32 $(PYTEST_ARGS)
test: setup
	@rc=0; bg=; log=reports/beside.log; log2=reports/beside-$(SPLIT_LAYOUT).log; \
	lock=$${TMPDIR:-/tmp}/kvchaos-xdist-$$(printf %x $$$$).lock; mkdir -p reports; echo $$$$ > $$lock; \
	trap 'for p in $$bg; do kill -INT $$p 2>/dev/null; done; for p in $$bg; do wait $$p; done; rm -f $$lock $$lock.turnstile' EXIT; \
	trap 'exit 130' INT TERM HUP; \
	$(PY) scripts/lint_workflows.py || rc=1; \
	export KVCHAOS_MACHINE_LOCK=$$lock; here=; \
	if [ "$(BESIDE)" = 1 ] && [ "$(SPLIT)" = 1 ]; then \
	  echo "make test: beside the cluster session, the cluster-free tests ($$log), and the tests -k '$(SPLIT_K)' then the two-host session ($$log2)"; \
	  $(PY) scripts/beside.py $(UNIT_SESSION) -n 2 > $$log 2>&1 & bg=$$!; \
	  $(PY) scripts/beside.py $(CLUSTER_SESSION) -k "$(SPLIT_K)" --then $(TWO_HOST_SESSION) > $$log2 2>&1 & bg="$$bg $$!"; \
	  here="not ($(SPLIT_K))"; \
	elif [ "$(BESIDE)" = 1 ]; then \
	  echo "make test: beside the cluster session, the cluster-free tests and then the two-host session; their output is in $$log when they end"; \
	  $(PY) scripts/beside.py $(UNIT_SESSION) -n 2 --then $(TWO_HOST_SESSION) > $$log 2>&1 & bg=$$!; \
	else \
	  $(UNIT_SESSION) -n 3 || rc=1; \
	fi; \
	$(CLUSTER_SESSION) $${here:+-k "$$here"} || rc=1; \
	if [ -n "$$bg" ]; then \
	  echo "make test: the cluster session ended; waiting for the sessions beside it"; \
	  for p in $$bg; do wait $$p || rc=1; done; bg=; \
	  for f in $$log $$log2; do if [ -f $$f ] && [ $$f -nt $$lock ]; then echo "make test: beside the cluster session ($$f):"; cat $$f; fi; done; \
	else \
	  $(TWO_HOST_SESSION) || rc=1; \
	fi; \
	$(PY) -m mkdocs build --strict --quiet --site-dir site || rc=1; \
	exit $$rc

# .github/workflows/ (ci.yml, nightly-gpu.yml): YAML, check-jsonschema's vendored GitHub workflow schema,
# expressions, bash -n of each run: script; offline. One line per problem, naming the file
lint-workflows: setup
	$(PY) scripts/lint_workflows.py

test-two-hosts: setup  # every default suite on the two-host topology (its SIGKILL check: PYTEST_ARGS="-m slow")
	$(PY) -m pytest suites tests/test_two_hosts_live.py -m "cluster and not slow and not gpu" -p no:cacheprovider \
	  --kvchaos-seed $(SEED) --kvchaos-topology two-hosts $(PYTEST_ARGS)

test-matrix: setup  # the detection matrix at 5 mutated + 2 clean trials per class, on the profile's layouts
	KVCHAOS_MATRIX_TRIALS=5 KVCHAOS_MATRIX_CLEAN_TRIALS=2 \
	  $(PY) -m pytest suites/test_detection_matrix.py -m "not gpu" -p no:cacheprovider --kvchaos-seed $(SEED) $(PYTEST_ARGS)

test-layouts: setup  # every default suite on every KV layout, one cluster each (hours on 2 cores)
	$(PY) -m pytest suites -m "not slow and not gpu" -p no:cacheprovider --kvchaos-layouts $(LAYOUTS) $(PYTEST_ARGS)

# test-like: the production-shaped probes (reports/layouts/): smoke, the GLM-5.3 replay and one detection-matrix
# class (mutated + clean) on each like: layout, one cluster each; their time bounds run at the layout's pace
# (docs/reference/layouts-and-backends.md). About 40 min (Llama-shaped) and 100 min (DeepSeek-shaped) on 2 cores.
LIKE_RUNS ?= like:llama-3.1-8b-p64-bf16=reject_admitted like:deepseek-v3-p64-bf16=early_free
test-like: setup
	$(PY) -m pytest tests/test_probe_like.py -m slow -k like_probes_recite -p no:cacheprovider $(PYTEST_ARGS)
	@for run in $(LIKE_RUNS); do \
	  KVCHAOS_MATRIX_TRIALS=1 KVCHAOS_MATRIX_CLEAN_TRIALS=1 $(PY) -m pytest -p no:cacheprovider -o testpaths= \
	    suites/test_smoke.py suites/incidents/test_glm53_kv_leak.py suites/test_detection_matrix.py \
	    --kvchaos-layouts "$${run%%=*}" --kvchaos-seed $(SEED) $(PYTEST_ARGS) \
	    -k "test_pd_output_token_identical or test_decode_generated or test_replay_leaks or $${run#*=}" || exit 1; \
	done

K ?= 3
soak: setup  # the default suites K times, each with a fresh seed: outcome counts per test, flakes, engine failure rates
	$(PY) -m kvchaos soak --times $(K)

# the search (kvchaos fuzz): guided, then random with the same budget and seed, printed side by side;
# its 1-minute smoke, suites/test_fuzz_smoke.py, runs in make test. FUZZ_ARGS="--engine-version 0.5.19" etc.
FUZZ_BUDGET ?= 30m
FUZZ_SEED ?= 1
fuzz: setup
	$(PY) -m kvchaos fuzz --strategy both --budget $(FUZZ_BUDGET) --seed $(FUZZ_SEED) $(FUZZ_ARGS)

test-unit: setup
	$(PY) -m pytest tests -m "not cluster" -p no:cacheprovider $(PYTEST_ARGS)

bench: setup  # each prints its ratios; figures and commands are kept in bench/RESULTS.md
	$(PY) bench/cold_start.py
	$(PY) bench/reset_cost.py
	$(PY) bench/driver_throughput.py
	$(PY) bench/canary_scan.py
	$(PY) bench/proxy_overhead.py
	$(PY) bench/http_calls.py
	$(PY) bench/repro_cold.py

clean-reports:
	rm -rf reports/[0-9]*
