"""The defence arm (issue 30): SGLang's own KV defences as checkers (kvchaos/oracles/defences.py), the
profile loader's [defences] arm (kvchaos/cluster/spec.py), the pytest option that turns it on
(kvchaos/plugin/defences.py) and the table fault class x (kvchaos oracle, checksum, kv-canary)
(kvchaos/report/defences.py).

The log fixtures are SGLang 0.5.23's own strings: the checksum lines as decode.py:3331-3351 writes them,
the kv_canary violation blocks as violation_reporter._format_violation printed them (run once in this
repository's venv), the install line as kv_canary/api.py:114 writes it, the server args as
entrypoints/engine.py:1185 logs them, the launch line as kvchaos' launcher writes it."""

from __future__ import annotations

import itertools
import json
import os

import pytest

import kvchaos.oracles.base  # noqa: F401 - imported before the inner runs (pytester drops what they import)
import kvchaos.plugin.defences  # noqa: F401
from kvchaos import oracles, policy
from kvchaos.cluster.spec import DEFENCES_ENV, DEFENCES_NEED_CUDA, ClusterSpec, SpecError, with_defences
from kvchaos.history import History
from kvchaos.oracles import FAIL, PASS, UNKNOWN, Verdict
from kvchaos.oracles.defences import KvCanary, KvChecksum, arm_checkers, observe
from kvchaos.policy import Context, Policy, Registry
from kvchaos.report import defences as report

pytest_plugins = ["pytester"]

FLAGS = "--disaggregation-enable-kv-checksum --kv-canary log"


def launch(role: str, flags: str = FLAGS) -> str:
    return (f"# kvchaos: {role}: /root/.cache/kvchaos/venv-gpu/bin/python -m sglang.launch_server --model-path "
            f"/work/main/kvchaos/probe/model --device cuda --dtype bfloat16 --max-total-tokens 65536 --context-length "
            f"131072 --page-size 64 --host 127.0.0.1 --port 30001 --enable-metrics --mem-fraction-static 0.6 "
            f"--disaggregation-mode {role} --disaggregation-transfer-backend mooncake_tcp {flags}\n")


def server_args(checksum: bool = True, canary: str = "log") -> str:
    return ("[2026-12-10 10:00:01] server_args={'model_path': '/work/main/kvchaos/probe/model', 'tokenizer_path': "
            "'/work/main/kvchaos/probe/model', 'device': 'cuda', 'page_size': 64, 'kv_canary': "
            f"'{canary}', 'kv_canary_real_data': 'none', 'kv_canary_sweep_interval': 0, 'disaggregation_mode': "
            f"'decode', 'disaggregation_enable_kv_checksum': {checksum}, 'disaggregation_bootstrap_port': 8998}}\n")


def installed(role: str, mode: str = "LOG") -> str:
    return (f"[2026-12-10 10:00:09] install_canary: disaggregation_mode=DisaggregationMode.{role.upper()} "
            f"config=CanaryConfig(mode=<CanaryMode.{mode}: '{mode.lower()}'>, ring_capacity=4096, sweep_interval=0, "
            "real_kv_hash_mode=<RealKvHashMode.NONE: 0>, enable_write_input_assert=False, "
            "enable_verify_token_assert=False, stats_print_every_n_steps=0) perturb_config=PerturbConfig() "
            "launch_capacities=CanaryLaunchCapacities() n_buffer_groups=1 buffer_group_kinds=['FULL'] "
            "swa_window_size=0 speculative_num_steps=1\n")


def head(role: str, flags: str = FLAGS, checksum: bool = True, canary: str = "log") -> str:
    out = launch(role, flags) + server_args(checksum, canary)
    if canary in ("log", "raise"):
        out += installed(role, canary.upper())
    return out + "[2026-12-10 10:00:20] The server is fired up and ready to roll!\n"


MISMATCH = ("[2026-12-10 10:01:02] KV checksum mismatch req=r2 bootstrap_room=7311598123 expected=0x5e3a01c2 "
            "got=0x5e3a01c3\n")
PEER = "[2026-12-10 10:01:02 TP1] KV checksum mismatch on a peer rank req=r2 bootstrap_room=7311598123\n"
SKIPPED = ("[2026-12-10 10:01:00] KV checksum skipped: prefill layout signature 0x1f2e differs from this decode's "
           "0x3c4d (TP width, PP stage, or page size); its requests are admitted unverified.\n")
ONE_SIDED = ("[2026-12-10 10:00:30] Decode 127.0.0.1:30002 registered 2 metadata buffers but this prefill has 3; "
             "only the first 2 are transferred, and misaligned if the extra buffer is not the last. An optional "
             "metadata buffer is enabled on one engine only: --disaggregation-enable-kv-checksum, "
             "SGLANG_ENABLE_DISAGG_SAMPLING_MASK, or the DSA top-k buffer.\n")
# violation_reporter._format_violation(row=[0, 1234, 57, 91, 17, 0xdeadbeef, 56, 1], total=1, ...), logged
VIOLATION = ("[2026-12-10 10:01:05] kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=verify_chain_hash "
             "slot_idx=1234 position=57 stored_token=91 expected_token=17 stored_chain_hash=0x00000000deadbeef "
             "expected_aux=0x0000000000000038\n"
             "KV cache canary violation detected (kernel_kind=HEAD_K_FULL, slot_idx=1234, position=57)\n"
             "canary_kind:       per_forward_head_k_full\n"
             "  fail_reasons: verify_chain_hash\n"
             "  stored:   token_id=91   position=57 prev_hash=0x00000000deadbeef\n"
             "  expected: prev_hash=0x0000000000000038\n"
             "  total_violations=1 ring_overflow=False step_when_pumped=88\n")
OVERFLOW = ("[2026-12-10 10:01:03] kv-canary: per-forward verify skipped this step due to overflow (total=1, "
            "capacity=8192); check ServerArgs / pool sizing\n")
TRAFFIC = ('[2026-12-10 10:01:01] Decode batch, #running-req: 2, #token: 396, token usage: 0.01, pre-allocated '
           'usage: 0.00, #prealloc-req: 0, #transfer-req: 0, #retracted-req: 0, cuda graph: True, gen throughput '
           '(token/s): 812.44, #queue-req: 0\n'
           '[2026-12-10 10:01:01] INFO:     127.0.0.1:45882 - "POST /generate HTTP/1.1" 200 OK\n')


def write_log(tmp_path, role: str, before: str, during: str) -> dict:
    p = tmp_path / f"{role}.log"
    p.write_bytes(before.encode() + during.encode())
    return {"path": str(p), "offset": len(before.encode())}


def run(tmp_path, *, device="cuda", before=None, during=None, info=None, rids=("r1", "r2"), status=None,
        bodies=None, arm=True, extra=()) -> History:
    """An experiment's history: the header, the arm's record (logs written under ``tmp_path``), plans,
    replies."""
    before = before or {r: head(r) for r in ("prefill", "decode")}
    during = during or {r: TRAFFIC for r in ("prefill", "decode")}
    info = info if info is not None else {r: {"kv_checksum": True, "kv_canary": "log", "device": device}
                                          for r in ("prefill", "decode")}
    recs = [{"ev": "experiment", "schema": 2, "id": "t-1", "name": "t", "engine": {"name": "sglang", "version": "0.5.23"},
             "layout": {"kv_layout": "mha-p64-bf16", "spec": {"device": device}}}]
    if arm:
        recs.append({"ev": "observed", "defences": {"roles": info, "logs": {
            r: write_log(tmp_path, r, before[r], during[r]) for r in ("prefill", "decode")}}})
    status = status or {}
    bodies = bodies or {}
    for i, rid in enumerate(rids):
        st = status.get(rid, 200)
        recs += [{"ev": "plan", "rid": rid, "tenant": f"t00{i}"},
                 {"ev": "send", "rid": rid, "wall": 1.0 + i},
                 {"ev": "status", "rid": rid, "status": st},
                 {"ev": "body", "rid": rid, **bodies.get(rid, {"text": "ok", "raw": '{"text": "ok"}'})},
                 {"ev": "end", "rid": rid, "outcome": "ok" if st == 200 else "http_error", "status": st, "wall": 2.0 + i}]
    return History(recs + list(extra))


def verdicts(h):
    return {c.name: c.check(h) for c in arm_checkers()}


# --------------------------------------------------------------------------- FAIL
def test_a_checksum_mismatch_is_a_fail_naming_the_request(tmp_path):
    h = run(tmp_path, during={"prefill": TRAFFIC, "decode": TRAFFIC + MISMATCH},
            status={"r2": 500},
            bodies={"r2": {"error": "KV checksum mismatch",
                           "raw": '{"object":"error","message":"KV checksum mismatch","type":"500","param":null,"code":500}'}})
    v = KvChecksum().check(h)
    assert v.status == FAIL, v
    (w,) = v.witnesses  # the log line and the reply are one firing
    assert (w["rid"], w["role"], w["bootstrap_room"], w["expected"], w["got"], w["status"]) == \
        ("r2", "decode", "7311598123", "0x5e3a01c2", "0x5e3a01c3", 500)
    assert w["line"].startswith("[2026-12-10 10:01:02] KV checksum mismatch req=r2") and w["offset"] > 0
    assert "r2" in v.summary and "rid=r2" in w.line()
    assert KvCanary().check(h).status == PASS  # the canary did not fire


@pytest.mark.parametrize("status,body", [
    (200, {"text": "", "raw": 'data: {"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": '
                              '"KV checksum mismatch", "status_code": 500, "err_type": null}}}\n\ndata: [DONE]\n\n'}),
    (500, {"error": "KV checksum mismatch"}),  # the driver's parse of the error body
    (500, {"raw": '{"object":"error","message":"KV checksum mismatch","type":"500","param":null,"code":500}'}),
    (500, {"raw": "upstream said: KV checksum mismatch"}),  # however a router wraps it: a 5xx carrying it
])
def test_a_reply_aborted_for_a_mismatch_is_a_fail_without_any_log(tmp_path, status, body):
    h = run(tmp_path, arm=False, status={"r1": status}, bodies={"r1": body})
    v = KvChecksum().check(h)
    assert v.status == FAIL and [w["rid"] for w in v.witnesses] == ["r1"] and v.witnesses[0]["source"] == "reply"


def test_a_reply_that_only_says_the_words_is_not_a_mismatch(tmp_path):
    body = {"text": "KV checksum mismatch", "raw": '{"text": "KV checksum mismatch", "meta_info": {}}'}
    assert KvChecksum().check(run(tmp_path, arm=False, bodies={"r1": body})).status == UNKNOWN


def test_every_tp_rank_logs_the_mismatch_one_witness_per_request(tmp_path):
    h = run(tmp_path, during={"prefill": TRAFFIC, "decode": PEER + MISMATCH + PEER})
    v = KvChecksum().check(h)
    assert v.status == FAIL and len(v.witnesses) == 1 and v.witnesses[0]["expected"] == "0x5e3a01c2"


def test_a_mismatch_of_an_engine_id_no_plan_names_is_still_a_fail(tmp_path):
    line = MISMATCH.replace("req=r2", "req=7f3a9c2e41d04b7a8d55e0c1a2b3c4d5")
    v = KvChecksum().check(run(tmp_path, during={"prefill": TRAFFIC, "decode": line}))
    assert v.status == FAIL and v.witnesses[0]["rid"] is None
    assert v.witnesses[0]["engine_rid"] == "7f3a9c2e41d04b7a8d55e0c1a2b3c4d5"


def test_a_kv_canary_violation_is_a_fail_naming_the_slot(tmp_path):
    h = run(tmp_path, during={"prefill": TRAFFIC + VIOLATION, "decode": TRAFFIC})
    v = KvCanary().check(h)
    assert v.status == FAIL, v
    (w,) = v.witnesses  # the structured line and its header are one violation
    assert (w["role"], w["slot_idx"], w["position"], w["launch_tag"], w["fail_reason"]) == \
        ("prefill", "1234", "57", "HEAD_K_FULL", "verify_chain_hash")
    assert "slot 1234" in v.summary and KvChecksum().check(h).status == PASS


def test_raise_mode_the_violation_in_a_traceback_counts_once(tmp_path):
    tb = ("[2026-12-10 10:01:05] Scheduler hit an exception: Traceback (most recent call last):\n"
          '  File "/sglang/srt/kv_canary/runner/violation_reporter.py", line 67, in log_or_raise_violation\n'
          "RuntimeError: kv_canary violation: launch_tag=TAIL_V_FULL fail_reason=verify_token slot_idx=77 "
          "position=3 stored_token=5 expected_token=5 stored_chain_hash=0x0000000000001234 "
          "expected_aux=0x0000000000000099\n"
          "KV cache canary violation detected (kernel_kind=TAIL_V_FULL, slot_idx=77, position=3)\n")
    v = KvCanary().check(run(tmp_path, during={"prefill": TRAFFIC, "decode": TRAFFIC + tb + tb}))
    assert v.status == FAIL and len(v.witnesses) == 1 and v.witnesses[0]["slot_idx"] == "77"


def test_a_header_line_alone_is_still_a_violation(tmp_path):
    line = "[2026-12-10 10:01:05] KV cache canary violation detected (kernel_kind=HEAD_V_FULL, slot_idx=9, position=2)\n"
    v = KvCanary().check(run(tmp_path, during={"prefill": TRAFFIC, "decode": line}))
    assert v.status == FAIL and v.witnesses[0]["slot_idx"] == "9"


def test_an_engine_error_record_of_a_defence_line_is_a_fail(tmp_path):
    rec = {"ev": "engine_error", "role": "decode", "signature": "kv_checksum_mismatch", "line": MISMATCH.strip(),
           "log": "decode.log"}
    v = KvChecksum().check(run(tmp_path, extra=[rec]))
    assert v.status == FAIL and v.witnesses[0]["rid"] == "r2"


# --------------------------------------------------------------------------- PASS
def test_defences_on_both_roles_and_silent_pass(tmp_path):
    got = verdicts(run(tmp_path))
    assert {n: v.status for n, v in got.items()} == {"kv_checksum": PASS, "kv_canary": PASS}, got
    on = got["kv_canary"].stats["on"]["decode"]
    assert on["on"] is True and any(e.startswith("install_canary") for e in on["evidence"])


def test_a_firing_before_the_experiment_is_not_its_own(tmp_path):
    before = {r: head(r) + MISMATCH + VIOLATION for r in ("prefill", "decode")}
    assert {v.status for v in verdicts(run(tmp_path, before=before)).values()} == {PASS}


# --------------------------------------------------------------------------- UNKNOWN
def test_a_defence_not_enabled_is_unknown(tmp_path):
    before = {"prefill": head("prefill"), "decode": head("decode", flags="", checksum=False, canary="none")}
    info = {"prefill": {"kv_checksum": True, "kv_canary": "log"}, "decode": {"kv_checksum": False, "kv_canary": "none"}}
    for v in verdicts(run(tmp_path, before=before, info=info)).values():
        assert v.status == UNKNOWN and "not demonstrably on on decode" in v.summary, v


def test_evidence_that_disagrees_is_not_on(tmp_path):
    info = {r: {"kv_checksum": True, "kv_canary": "log"} for r in ("prefill", "decode")}
    before = {"prefill": head("prefill"), "decode": head("decode", flags="--kv-canary log", checksum=False)}
    v = KvChecksum().check(run(tmp_path, before=before, info=info))
    assert v.status == UNKNOWN and "decode" in v.summary


def test_a_restart_without_the_flags_during_the_experiment_is_unknown(tmp_path):
    during = {"prefill": TRAFFIC, "decode": TRAFFIC + head("decode", flags="", checksum=False, canary="none") + TRAFFIC}
    for v in verdicts(run(tmp_path, during=during)).values():
        assert v.status == UNKNOWN and "decode" in v.summary, v


def test_a_restart_that_turned_it_on_midway_does_not_cover_the_experiment(tmp_path):
    before = {"prefill": head("prefill"), "decode": head("decode", flags="", checksum=False, canary="none")}
    during = {"prefill": TRAFFIC, "decode": TRAFFIC + head("decode") + TRAFFIC}
    info = {r: {"error": "ConnectTimeout"} for r in ("prefill", "decode")}  # only the log says
    for v in verdicts(run(tmp_path, before=before, during=during, info=info)).values():
        assert v.status == UNKNOWN and "not demonstrably on on decode" in v.summary, v


@pytest.mark.parametrize("fired", [False, True])
def test_cpu_is_unknown_with_the_reason_never_pass(tmp_path, fired):
    during = {"prefill": TRAFFIC, "decode": TRAFFIC + (MISMATCH + VIOLATION if fired else "")}
    for v in verdicts(run(tmp_path, device="cpu", during=during)).values():
        assert v.status != PASS
        if not fired:
            assert v.status == UNKNOWN and "need CUDA devices" in v.summary
            assert "on cpu the defence arm cannot run" in v.summary and DEFENCES_NEED_CUDA in v.summary


def test_without_the_arm_record_it_is_unknown(tmp_path):
    for v in verdicts(run(tmp_path, arm=False)).values():
        assert v.status == UNKNOWN and "--kvchaos-defences" in v.summary


def test_a_defence_that_skipped_requests_cannot_pass(tmp_path):
    v = KvChecksum().check(run(tmp_path, during={"prefill": ONE_SIDED, "decode": TRAFFIC + SKIPPED}))
    assert v.status == UNKNOWN and "registered 2 metadata buffers" in v.summary and "1 more" in v.summary
    assert any("KV checksum skipped" in g for g in v.stats["gaps"])
    v = KvCanary().check(run(tmp_path, during={"prefill": TRAFFIC, "decode": OVERFLOW}))
    assert v.status == UNKNOWN and "verify skipped" in v.summary


def test_nothing_served_checks_nothing(tmp_path):
    v = KvChecksum().check(run(tmp_path, status={"r1": 503, "r2": 503}))
    assert v.status == UNKNOWN and "no request was served" in v.summary


# --------------------------------------------------------------------------- garbage and partial lines
def test_garbage_and_partial_lines(tmp_path):
    junk = "\x00\xff garbage ]]] kv_canary\n[2026-12-10 10:01:0\nKV checksum mismatch req=\nkv-canary: per-forward\n"
    h = run(tmp_path, during={"prefill": junk + TRAFFIC, "decode": junk + TRAFFIC})
    got = verdicts(h)
    assert {v.status for v in got.values()} == {PASS}, got
    # undecodable bytes, then a line still being written (no newline yet): not read
    log = tmp_path / "decode.log"
    log.write_bytes(log.read_bytes() + b"\xc3\x28\xa0\xa1 odd bytes\n" + MISMATCH.encode().rstrip(b"\n"))
    assert KvChecksum().check(h).status == PASS
    log.write_bytes(log.read_bytes() + b"\n")  # once whole, it is read
    v = KvChecksum().check(h)
    assert v.status == FAIL and v.witnesses[0]["rid"] == "r2"


def test_a_mismatch_line_cut_short_still_names_its_request(tmp_path):
    cut = "[2026-12-10 10:01:02] KV checksum mismatch req=r1 bootstrap_ro\n"
    v = KvChecksum().check(run(tmp_path, during={"prefill": TRAFFIC, "decode": cut}))
    assert v.status == FAIL and v.witnesses[0]["rid"] == "r1" and v.witnesses[0]["bootstrap_room"] is None


def test_a_violation_line_cut_short_is_still_a_violation(tmp_path):
    cut = "[2026-12-10 10:01:05] kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=verify_chain_hash slot_idx=12\n"
    v = KvCanary().check(run(tmp_path, during={"prefill": TRAFFIC, "decode": cut}))
    assert v.status == FAIL and v.witnesses[0]["slot_idx"] == "12" and v.witnesses[0]["position"] is None


@pytest.mark.parametrize("logs", [
    {"decode": "not a table", "prefill": {"path": None}},
    {"decode": {"path": "/nonexistent/kvchaos/decode.log", "offset": 0}},
    {"decode": {"path": "REPLACED", "offset": 10 ** 9}},  # the log was replaced: shorter than the offset
    {"decode": {"path": "/x", "error": "PermissionError: denied"}},
    {"decode": {"path": "REPLACED", "offset": "12"}, "prefill": {"path": "REPLACED", "offset": -1}},
])
def test_an_unreadable_arm_record_is_unknown_never_a_crash(tmp_path, logs):
    h = run(tmp_path)
    rec = next(e for e in h.records if e.get("ev") == "observed")
    real = rec["defences"]["logs"]["prefill"]
    logs = {r: ({**x, "path": real["path"]} if isinstance(x, dict) and x.get("path") == "REPLACED" else x)
            for r, x in logs.items()}
    rec["defences"]["logs"] = logs
    h = History(h.records)
    for v in verdicts(h).values():
        assert v.status == UNKNOWN and not v.stats.get("crashed"), v
        assert "was not read" in v.summary


# --------------------------------------------------------------------------- what the arm records
class FakeCluster:
    def __init__(self, tmp_path, fail_role=None):
        self.tmp_path, self.fail_role = tmp_path, fail_role
        for r in ("prefill", "decode"):
            (tmp_path / f"{r}.log").write_text(head(r))

    def server_info(self, role):
        if role == self.fail_role:
            raise ConnectionError("refused")
        # the answer is nested in some releases: the fields are found anywhere in it
        return {"version": "0.5.23", "internal_states": [{}], "server": {"disaggregation_enable_kv_checksum": True,
                                                                         "kv_canary": "log", "device": "cuda"}}

    def log_paths(self):
        return {r: str(self.tmp_path / f"{r}.log") for r in ("prefill", "decode", "router")}


def test_observe_records_settings_and_log_positions(tmp_path):
    got = observe(FakeCluster(tmp_path, fail_role="prefill"))
    assert got["roles"]["decode"] == {"kv_checksum": True, "kv_canary": "log", "device": "cuda"}
    assert "ConnectionError" in got["roles"]["prefill"]["error"]
    assert set(got["logs"]) == {"prefill", "decode"}
    assert got["logs"]["decode"]["offset"] == len(head("decode").encode())
    assert observe(object()) == {"roles": {r: {"error": "AttributeError: 'object' object has no attribute "
                                                        "'server_info'"} for r in ("prefill", "decode")}, "logs": {}}


# --------------------------------------------------------------------------- the policy
def test_a_leak_checker_that_never_runs_by_default():
    for c in (KvChecksum, KvCanary):
        assert c.leak is True and c.log_only is False
        assert policy.is_leak_checker(c.name)
    assert not {"kv_checksum", "kv_canary"} & {c.name for c in policy.always_run()}
    assert not {"kv_checksum", "kv_canary"} & set(oracles.default_checkers().names)


STATUS_SETS = list(itertools.product((PASS, FAIL, UNKNOWN), repeat=2))


@pytest.mark.parametrize("base,required", [
    ([Verdict("isolation", FAIL, "leak", [{"victim_rid": "a"}])], {}),
    ([Verdict("isolation", UNKNOWN, "no power")], {}),
    ([Verdict("liveness", FAIL, "stuck", [{"rid": "a"}]), Verdict("isolation", PASS, "")], {"liveness": PASS}),
])
def test_adding_the_defences_never_turns_red_green(base, required):
    p = Policy(registry=Registry.load())
    ctx = Context(None)
    claimed = {v.oracle for v in base}
    before = p.judge(base, ctx, required=required, claimed=claimed)
    assert before.red
    for cs, cn in STATUS_SETS:
        extra = [Verdict("kv_checksum", cs, "x", [{"rid": "a"}] if cs == FAIL else []),
                 Verdict("kv_canary", cn, "y", [{"slot_idx": 1}] if cn == FAIL else [])]
        after = p.judge(base + extra, ctx, required=required, claimed=claimed)  # added by the arm: unclaimed
        assert after.red and policy.RANK[after.status] >= policy.RANK[before.status], (cs, cn)


def test_an_unclaimed_defence_fail_is_red_its_unknown_only_shown():
    p = Policy(registry=Registry.load())
    ok = [Verdict("isolation", PASS, "")]
    j = p.judge(ok + [Verdict("kv_checksum", FAIL, "x", [{"rid": "a"}])], Context(None), claimed={"isolation"})
    assert j.status == FAIL
    j = p.judge(ok + [Verdict("kv_canary", UNKNOWN, "cpu")], Context(None), claimed={"isolation"})
    assert j.status == PASS and j.items[1].note.startswith("not claimed")
    # a planted experiment (the detection matrix): only what it requires counts
    j = p.judge([Verdict("isolation", FAIL, "x", [{"victim_rid": "a"}]), Verdict("kv_checksum", FAIL, "x", [{}])],
                Context(None), required={"isolation": FAIL}, planted="detection matrix: short_transfer armed",
                claimed={"isolation"})
    assert j.status == PASS


# --------------------------------------------------------------------------- the profile's arm
def test_the_loader_applies_the_arm_once_on_cuda_only(monkeypatch):
    monkeypatch.delenv(DEFENCES_ENV, raising=False)
    plain = ClusterSpec.load("gpu")
    assert "--disaggregation-enable-kv-checksum" not in plain.prefill_args + plain.decode_args + plain.common_args
    on = ClusterSpec.load("gpu", defences=True)
    for args in (on.prefill_args, on.decode_args):
        assert args == ["--disaggregation-enable-kv-checksum", "--kv-canary", "log"]
    again = ClusterSpec.from_dict(with_defences(on.to_dict(), {"decode_args": on.decode_args}))
    assert again.decode_args == on.decode_args  # applied twice adds nothing
    assert "--kv-canary" not in on.common_args  # the single reference server runs without them
    monkeypatch.setenv(DEFENCES_ENV, "1")
    assert ClusterSpec.load("gpu").decode_args == on.decode_args
    with pytest.raises(SpecError, match="need CUDA devices") as e:
        ClusterSpec.load("cpu")
    assert "on cpu the defence arm cannot run" in str(e.value) and "device='cpu'" in str(e.value)
    assert ClusterSpec.load("cpu", defences=False).device == "cpu"
    with pytest.raises(SpecError, match=r"needs a \[defences\] table"):
        with_defences({"device": "cuda"}, None, "p.toml")
    with pytest.raises(SpecError, match="unknown key"):
        with_defences({"device": "cuda"}, {"router_args": []}, "p.toml")


ARGS = ("-p", "no:cacheprovider", "-o", "testpaths=", "-o", "addopts=", "-p", "kvchaos.plugin.defences")
INNER = """
import os
from kvchaos.cluster.spec import ClusterSpec

def test_arm(kvchaos_policy, kvchaos_base_spec):
    assert os.environ.get("KVCHAOS_DEFENCES") == "1"
    assert "--disaggregation-enable-kv-checksum" in kvchaos_base_spec.decode_args
    assert {"kv_checksum", "kv_canary"} <= set(kvchaos_policy.checks([])[0].names)
"""


def test_the_option_is_refused_by_name_on_cpu(pytester, monkeypatch):
    monkeypatch.delenv(DEFENCES_ENV, raising=False)
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    r = pytester.runpytest_inprocess(*ARGS, "--kvchaos-profile", "cpu", "--kvchaos-defences")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*--kvchaos-defences*device='cpu'*need CUDA devices*on cpu the defence arm cannot run*"])
    assert DEFENCES_ENV not in os.environ


def test_the_option_adds_the_checkers_and_the_args(pytester, monkeypatch):
    monkeypatch.delenv(DEFENCES_ENV, raising=False)
    pytester.makepyfile(test_arm=INNER)
    r = pytester.runpytest_inprocess(*ARGS, "--kvchaos-profile", "gpu", "--kvchaos-defences",
                                     "--kvchaos-reports", "reports", "-k", "test_arm")
    r.assert_outcomes(passed=1)
    assert DEFENCES_ENV not in os.environ  # restored when the session ends
    r = pytester.runpytest_inprocess(*ARGS, "--kvchaos-profile", "gpu", "--kvchaos-reports", "reports")
    r.assert_outcomes(failed=1)  # without the option: no arm


# --------------------------------------------------------------------------- the table
def rec(name, verdicts, planted=None):
    return {"name": name, "planted": planted, "verdicts": verdicts}


def test_the_table_fault_class_by_checker():
    records = [
        rec("matrix_short_transfer_mut_0", {"isolation": FAIL, "kv_checksum": FAIL, "kv_canary": PASS},
            "detection matrix: short_transfer armed"),
        rec("matrix_short_transfer_mut_1", {"isolation": FAIL, "kv_checksum": FAIL, "kv_canary": PASS},
            "detection matrix: short_transfer armed"),
        rec("matrix_early_free_mut_0", {"kv_lifecycle": FAIL, "isolation": UNKNOWN, "kv_checksum": PASS,
                                        "kv_canary": FAIL}, "detection matrix: early_free armed"),
        rec("matrix_early_free_mut_1", {"kv_lifecycle": PASS, "isolation": UNKNOWN, "kv_checksum": UNKNOWN,
                                        "kv_canary": PASS}, "detection matrix: early_free armed"),
        rec("matrix_salt_ignored_clean_0", {"cache_isolation": PASS, "kv_checksum": PASS, "kv_canary": UNKNOWN}),
        rec("smoke_3", [{"oracle": "isolation", "status": PASS}, {"oracle": "kv_checksum", "status": UNKNOWN}]),
    ]
    records[0]["kv_layout"], records[1]["kv_layout"] = "mla-p64-bf16", "like:deepseek-v3-p64-bf16"
    rows = {r["class"]: r for r in report.table(records)}
    assert rows["short_transfer"]["layouts"] == ["like:deepseek-v3-p64-bf16", "mla-p64-bf16"]
    assert [r["class"] for r in report.table(records)] == ["short_transfer", "early_free", "salt_ignored (clean)",
                                                           "smoke"]
    assert (rows["short_transfer"]["kvchaos"], rows["short_transfer"]["kv_checksum"],
            rows["short_transfer"]["kv_canary"]) == ("caught (2/2)", "caught (2/2)", "not caught (0/2)")
    assert (rows["early_free"]["kvchaos"], rows["early_free"]["kv_checksum"], rows["early_free"]["kv_canary"]) == \
        ("caught 1/2", "not caught 1/2, unknown 1/2", "caught 1/2")
    assert (rows["salt_ignored (clean)"]["kvchaos"], rows["salt_ignored (clean)"]["kv_canary"]) == \
        ("not caught", "unknown")
    assert rows["smoke"]["kv_canary"] == "unknown"  # not judged by it
    text = report.render(report.table(records))
    assert text.splitlines()[0] == "| fault class | experiments | kvchaos oracle | checksum | kv-canary |"
    assert "| short_transfer | 2 | caught (2/2) | caught (2/2) | not caught (0/2) |" in text


def test_the_report_section_reads_the_run(tmp_path):
    assert report.section(tmp_path) is None
    lines = [json.dumps(rec("clean_control", {"isolation": PASS})), "{not json", ""]
    (tmp_path / "experiments.jsonl").write_text("\n".join(lines))
    assert report.section(tmp_path) is None  # no experiment judged by a defence
    lines.append(json.dumps(rec("matrix_double_alloc_mut_0", {"isolation": FAIL, "kv_checksum": FAIL,
                                                              "kv_canary": "unknown"})))
    (tmp_path / "experiments.jsonl").write_text("\n".join(lines))
    s = report.section(tmp_path)
    assert s["title"].startswith("SGLang's own defences") and "<td>double_alloc</td>" in s["html"]
    assert report.main([str(tmp_path), "--json"]) == 0
