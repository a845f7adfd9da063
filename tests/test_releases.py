"""kvchaos.releases: the release matrix's bookkeeping. A blind trial is never "no leak", a release is
clean only when every trial measured it clean, thresholds come from the rows (recomputed, never read
back), and the audit's answer for an unmeasured release is UNKNOWN unless measured neighbours agree."""

import json
import re
from types import SimpleNamespace

import pytest

from kvchaos import releases as R
from kvchaos.oracles import Verdict
from kvchaos.workload.plan import RequestPlan


def trial(rel, n, leaked, hung=False, four=False):
    w = {"victim_rid": f"g-{n}-t015", "owner_tenant": "t003", "matched": "ABC"} if leaked else None
    return {"release": rel, "trial": n, "leaked": leaked, "hung": hung, "rejected_4xx": four,
            "answered_200": 4 if leaked else 0, "first_witness": w, "experiment": f"x-{rel}-{n}"}


def table(**verdicts):
    rows = {}
    for rel, v in verdicts.items():
        rel = rel.replace("_", ".")
        t = [trial(rel, i, {"leaks": True, "clean": False, "unknown": None}[v]) for i in (1, 2, 3)]
        rows.update(R.aggregate(t)["releases"])
    return {"releases": rows, "derived": R.derive(rows)}


def test_parse_releases():
    assert R.parse_releases("0.5.23, 0.5.19,0.5.19") == ["0.5.19", "0.5.23"]
    with pytest.raises(ValueError, match="'0.5.x'"):
        R.parse_releases("0.5.19,0.5.x")
    with pytest.raises(ValueError, match="no releases"):
        R.parse_releases(" , ")


def test_a_blind_trial_is_never_counted_clean():
    rows = R.aggregate([trial("0.5.22", 1, False), trial("0.5.22", 2, None), trial("0.5.22", 3, False)])["releases"]
    assert rows["0.5.22"]["verdict"] == R.UNMEASURED and rows["0.5.22"]["unmeasured"] == 1
    rows = R.aggregate([trial("0.5.22", 1, False), trial("0.5.22", 2, True), trial("0.5.22", 3, None)])["releases"]
    assert rows["0.5.22"]["verdict"] == R.LEAKS and rows["0.5.22"]["witness"]["owner_tenant"] == "t003"
    rows = R.aggregate([trial("0.5.23", i, False, hung=True) for i in (1, 2, 3)])["releases"]
    assert rows["0.5.23"]["verdict"] == R.CLEAN and rows["0.5.23"]["hung"] == 3
    # a release asked for whose trials never ran is in the table, unmeasured
    rows = R.aggregate([], releases=["0.5.21"])["releases"]
    assert rows["0.5.21"]["verdict"] == R.UNMEASURED and rows["0.5.21"]["trials"] == 0


def test_first_clean_needs_every_later_release_clean_and_disagreements_with_the_writeup():
    d = table(**{"0_5_19": "leaks", "0_5_20": "leaks", "0_5_21": "clean", "0_5_22": "clean", "0_5_23": "clean"})["derived"]
    assert d["first_clean"] == "0.5.21" and d["leaking"] == ["0.5.19", "0.5.20"]
    assert d["writeup_disagreements"] == ["0.5.21: the write-up's >= 0.5.22 calls it unfixed, measured clean (no leak in 3 trial(s))"]
    d = table(**{"0_5_19": "leaks", "0_5_21": "clean", "0_5_22": "leaks", "0_5_23": "clean"})["derived"]
    assert d["first_clean"] == "0.5.23"
    assert any("0.5.22: the write-up's >= 0.5.22 calls it fixed, measured to leak" in x for x in d["writeup_disagreements"])
    d = table(**{"0_5_22": "clean", "0_5_23": "unknown"})["derived"]
    assert d["first_clean"] is None and d["unmeasured"] == ["0.5.23"]


def test_assess_answers_from_measurement():
    t = table(**{"0_5_19": "leaks", "0_5_21": "leaks", "0_5_22": "clean", "0_5_23": "clean", "0_5_24": "unknown"})
    st = {v: R.assess(v, t)[0] for v in ("0.5.19", "0.5.20", "0.5.18", "0.5.22", "0.5.23", "0.5.24", "0.5.25", "0.6.0")}
    assert st == {"0.5.19": R.LEAKS, "0.5.20": R.LEAKS,   # between two leaking releases
                  "0.5.18": R.LEAKS,                       # older than the oldest, which leaks
                  "0.5.22": R.CLEAN, "0.5.23": R.CLEAN,
                  "0.5.24": R.UNMEASURED,                  # its trials were blind
                  "0.5.25": R.UNMEASURED, "0.6.0": R.UNMEASURED}  # newer than anything measured
    assert "run kvchaos bisect --releases 0.6.0" in R.assess("0.6.0", t)[1]
    assert "t003" in R.assess("0.5.19", t)[1]  # the witness is in the message
    assert R.assess("0.5.23", None)[0] == R.UNMEASURED
    t2 = table(**{"0_5_19": "leaks", "0_5_23": "clean"})
    assert R.assess("0.5.21", t2)[0] == R.UNMEASURED  # neighbours disagree: no interpolation
    with pytest.raises(ValueError):
        R.assess("main", t2)


def test_load_table_recomputes_derived_and_rejects_bad_rows(tmp_path):
    t = table(**{"0_5_19": "leaks", "0_5_23": "clean"})
    t["derived"] = {"first_clean": "0.5.19"}  # a hand-edited threshold is not trusted
    p = tmp_path / "t.json"
    p.write_text(json.dumps(t))
    assert R.load_table(p)["derived"]["first_clean"] == "0.5.23"
    t["releases"]["0.5.23"]["verdict"] = "fine"
    p.write_text(json.dumps(t))
    with pytest.raises(R.ReleaseError, match="0.5.23: verdict 'fine'"):
        R.load_table(p)
    p.write_text("{")
    with pytest.raises(R.ReleaseError, match="not JSON"):
        R.load_table(p)
    assert R.load_table(tmp_path / "absent.json") is None


def test_trial_record_reads_the_experiment(tmp_path):
    plans, victim = R.glm53_plans(53)
    big = [p for p in plans if p.oversized]
    assert victim == "t015" and [p.n_tokens for p in big] == list(R.OVERSIZED)
    assert all(p.tenant != victim for p in plans if not p.oversized)
    ends = [{"ev": "end", "rid": p.rid, "outcome": "ok", "status": 200, "latency_s": 0.5} for p in plans]
    ends[-1] = {"ev": "end", "rid": plans[-1].rid, "outcome": "timeout", "latency_s": 30.0}
    ev = [{"ev": "experiment", "engine": {"roles": {"prefill": "0.5.19", "decode": "0.5.19"}}}] + ends + [
        {"ev": "agent", "agent_ev": "write_end", "rid": big[0].rid, "pages": 1}]
    wit = {"victim_rid": big[0].rid, "victim_tenant": victim, "owner_tenant": "t002", "owner_rid": "g53-000003-t002",
           "matched": "ABCDEFGHIJ", "origin": "this log"}
    ex = SimpleNamespace(events=ev, id="x1", path=tmp_path / "r" / "events.jsonl", run_dir=tmp_path,
                         verdicts=[Verdict("isolation", "fail", "leak", [wit]), Verdict("sensitivity", "pass", "ok")])
    ex.by = {v.oracle: v for v in ex.verdicts}
    rec = R.trial_record(ex, plans, victim, "0.5.19", 1, 53, {"status": "caught"})
    assert rec["leaked"] is True and rec["cross_tenant_witnesses"] == 1 and rec["first_witness"]["owner_tenant"] == "t002"
    assert rec["answered_200"] == 4 and not rec["hung"] and not rec["rejected_4xx"]
    assert rec["oversized"][big[0].rid]["kv_pages_sent"] == 1 and rec["events"] == "r/events.jsonl"
    assert rec["bystanders"] == {"n": 80, "timeouts": 1, "ok": 79} and rec["selftest"] == "caught"
    ex.verdicts[0] = Verdict("isolation", "unknown", "not enough echo")
    ex.by = {v.oracle: v for v in ex.verdicts}
    assert R.trial_record(ex, plans, victim, "0.5.19", 1, 53)["leaked"] is None  # blind: not "no leak"
    assert isinstance(plans[0], RequestPlan)


def test_render_names_every_release_and_the_writeup():
    t = table(**{"0_5_19": "leaks", "0_5_21": "clean"})
    t["workload"] = R.aggregate([])["workload"]
    md = R.render_markdown(t, "kvchaos bisect --releases 0.5.19,0.5.21 --trials 3")
    assert "| 0.5.19 | **leaks** | 3/3 |" in md and "| 0.5.21 | **clean** | 0/3 |" in md
    assert "recommends >= 0.5.22" in md and "0.5.21: the write-up's" in md


def test_deployments_shape_the_spec_and_name_the_table(tmp_path):
    base = {"prefill_args": ["--x"], "decode_args": ["--y"]}
    inc = R.deployment_spec(base, "incident")
    assert inc["prefill_args"] == ["--x", "--max-total-tokens", str(R.PREFILL_POOL)] and inc["decode_args"] == ["--y"]
    at = R.deployment_spec(base, "auto-truncate")
    assert at["prefill_args"][-1] == at["decode_args"][-1] == "--allow-auto-truncate"
    with pytest.raises(ValueError, match="deployment 'x'"):
        R.deployment_spec(base, "x")
    assert R.table_file("incident", tmp_path).name == "release_table.json"
    assert R.table_file("auto-truncate", tmp_path).name == "release_table-auto-truncate.json"
    # trials of another deployment never mix into a table
    t = [dict(trial("0.5.23", 1, True), deployment="auto-truncate"), trial("0.5.23", 2, False)]
    assert R.aggregate(t)["releases"]["0.5.23"]["verdict"] == R.CLEAN
    at_table = R.aggregate(t, deployment="auto-truncate")
    assert at_table["releases"]["0.5.23"]["verdict"] == R.LEAKS
    assert "the incident deployed with --allow-auto-truncate" in R.assess("0.5.23", at_table)[1]


def test_the_code_readings_prediction_is_shown_only_for_the_deployment_it_read():
    reading = {"releases": {"0.5.23": {"predicted_behaviour": "reject_4xx"}}}
    t = [dict(trial("0.5.23", 1, True), deployment="auto-truncate"), trial("0.5.23", 1, False)]
    assert R.aggregate(t, reading)["releases"]["0.5.23"]["code_prediction"] == "reject_4xx"
    assert R.aggregate(t, reading, deployment="auto-truncate")["releases"]["0.5.23"]["code_prediction"] is None


def test_record_trial_appends_and_rebuilds_its_deployments_table(tmp_path):
    assert R.load_trials(tmp_path) == []
    R.record_trial(dict(trial("0.5.19", 1, True), deployment="incident"), tmp_path)
    t = R.record_trial(dict(trial("0.5.19", 1, False), deployment="auto-truncate"), tmp_path)
    assert len(R.load_trials(tmp_path)) == 2 and t["releases"]["0.5.19"]["verdict"] == R.CLEAN
    assert json.loads((tmp_path / "release_table.json").read_text())["releases"]["0.5.19"]["verdict"] == R.LEAKS
    assert (tmp_path / "release_table-auto-truncate.md").exists()


# --------------------------------------------------------------------------- the incident at its own numbers
def test_the_incident_scale_is_the_incidents_pool_and_context_and_its_prompts_fall_between():
    s = R.SCALES["incident"]
    s.check()
    assert (s.prefill_pool, s.context) == (681_280, 1_048_576)
    plans, victim = R.scaled_plans(s, seed=3)
    big = [p for p in plans if p.oversized]
    assert [p.n_tokens for p in big] == list(s.oversized) and all(p.tenant == victim for p in big)
    assert all(s.prefill_pool < p.n_tokens < s.context for p in big)
    assert all(len(p.prompt) == p.n_tokens and len(p.canaries) == 3 for p in big)
    assert len(plans) == s.background + len(big) and all(p.tenant != victim for p in plans[:s.background])
    assert all(p.max_new_tokens == 12 + 2 for p in big)  # one recited canary: the evidence
    spec = R.scaled_spec({"prefill_args": ["--x"], "decode_args": [], "startup_timeout_s": 300.0}, s)
    assert spec["context_length"] == s.context and spec["pool_tokens"] == s.decode_pool
    # the last --max-total-tokens wins: prefill gets the incident's pool, decode one that admits the victims
    assert spec["prefill_args"][:3] == ["--x", "--max-total-tokens", "681280"]
    assert spec["decode_args"][:2] == ["--max-total-tokens", str(s.decode_pool)]
    assert "--max-running-requests" in spec["prefill_args"] and spec["startup_timeout_s"] >= 600
    mm = s.memory_model(2304)
    assert mm["prefill_pool_bytes"] == 681_280 * 2304 and mm["req_to_token_bytes_per_role"] == 16 * 1_048_576 * 4


@pytest.mark.parametrize("change, why", [
    ({"oversized": (600_000,)}, "must be over prefill's pool"),
    ({"oversized": (1_100_000,)}, "must be under the context"),
    ({"decode_pool": 690_000}, "must admit 690000 + its reservation"),
    ({"background": 10}, "the victim would be reserved untouched pages"),
])
def test_a_scale_that_cannot_show_the_incident_is_refused_naming_why(change, why):
    import dataclasses

    s = dataclasses.replace(R.SCALES["incident"], **change)
    with pytest.raises(ValueError, match=re.escape(why)):
        s.check()


def test_peak_rss_follows_a_roles_process_tree():
    import os

    with R.PeakRss({"me": os.getpid(), "gone": 2 ** 22 + 12345}, every_s=0.05) as m:
        blob = bytearray(64 << 20)  # 64 MiB more while it watches
        import time

        time.sleep(0.3)
        del blob
    d = m.to_dict()
    assert d["peak_bytes"]["me"] >= 64 << 20 and d["peak_bytes"]["gone"] == 0
    assert d["peak_total_bytes"] >= d["peak_bytes"]["me"]


def test_a_dry_run_names_the_release_interpreter_and_builds_nothing(monkeypatch, tmp_path):
    """``pytest suites --kvchaos-dry`` (tests/test_seed.py) reaches the release matrix's fixture: it must not
    install three sglang releases on a fresh machine to start no engine."""
    def no_build(*a, **k):
        raise AssertionError(f"a dry run built an environment: {a}")

    monkeypatch.setattr(R.subprocess, "run", no_build)
    monkeypatch.setenv("KVCHAOS_DRY", "1")
    monkeypatch.setenv("HOME", str(tmp_path))  # scripts/setup-engine.sh's defaults, under $HOME/.cache/kvchaos
    for var in ("KVCHAOS_VENV", "KVCHAOS_ENGINE_VENV"):
        monkeypatch.delenv(var, raising=False)
    cache = tmp_path / ".cache" / "kvchaos"
    assert R.engine_python("0.5.21") == str(cache / "venv-sglang-0.5.21" / "bin" / "python")
    assert R.engine_python(R.MAIN_RELEASE) == str(cache / "venv" / "bin" / "python")
    monkeypatch.setenv("KVCHAOS_VENV", str(tmp_path / "main"))  # the script's MAIN and DEST overrides
    monkeypatch.setenv("KVCHAOS_ENGINE_VENV", str(tmp_path / "e"))
    assert R.engine_python(R.MAIN_RELEASE) == str(tmp_path / "main" / "bin" / "python")
    assert R.engine_python("0.5.19") == str(tmp_path / "e" / "bin" / "python")
    with pytest.raises(ValueError, match="not a release version"):
        R.engine_python("latest")
    monkeypatch.delenv("KVCHAOS_DRY")
    with pytest.raises(AssertionError, match="built an environment"):  # a real run still builds it
        R.engine_python("0.5.21")
