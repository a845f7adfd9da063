"""The CPU compatibility layer: each patch is needed (fails without) and works (passes with)."""

import json
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from kvchaos import cpucompat, releases

REPO = Path(__file__).resolve().parents[1]


def _py(code: str, compat: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVCHAOS_CPU_COMPAT"}
    env["PYTHONPATH"] = f"{REPO / 'kvchaos' / '_boot'}:{REPO}"
    if compat:
        env["KVCHAOS_CPU_COMPAT"] = "1"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd="/")


def test_version_pin_refuses_other_versions_with_a_clear_message():
    with pytest.raises(cpucompat.CompatVersionError) as e:
        cpucompat.check_versions({"pytest": ("0.0.1",)})
    msg = str(e.value)
    assert "pytest==" in msg and "written for 0.0.1" in msg and "make setup" in msg


def test_installed_versions_match_the_pins():
    cpucompat.check_versions()  # the environment built by scripts/setup.sh


def test_rewrite_guards_only_nms_and_qnms():
    src = ('@torch.library.register_fake("torchvision::nms")\ndef a(): pass\n'
           '@torch.library.register_fake("torchvision::qnms")\ndef b(): pass\n'
           '@torch.library.register_fake("torchvision::other")\ndef c(): pass\n')
    out = cpucompat._rewrite_tv_meta(src)
    assert out.count("if torchvision.extension._has_ops() else") == 2
    assert '@torch.library.register_fake("torchvision::other")' in out


def test_torchvision_import_needs_the_patch():
    bad = _py("import torchvision", compat=False)
    assert bad.returncode != 0 and "torchvision::nms does not exist" in bad.stderr
    ok = _py("import torchvision; from kvchaos import cpucompat; print(cpucompat.APPLIED)", compat=True)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "torchvision-meta-guard" in ok.stdout


def test_mooncake_sender_and_vllm_stand_in():
    code = (
        "from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender as S\n"
        "print('host_idx', S.supports_host_tensor_indices)\n"
        "from vllm._custom_ops import rotary_embedding\n"
        "try:\n    rotary_embedding()\nexcept RuntimeError as e:\n    print('raises', 'CPU stand-in' in str(e))\n"
        "from kvchaos import cpucompat; print(cpucompat.APPLIED)\n"
    )
    ok = _py(code, compat=True)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "host_idx False" in ok.stdout and "raises True" in ok.stdout
    assert "mooncake-no-host-tensor-indices" in ok.stdout and "stand-in:vllm._custom_ops" in ok.stdout
    plain = _py("import vllm", compat=False)
    assert plain.returncode != 0  # there is no real vllm here: the stand-in is what makes it importable


def test_nixl_patch_maps_vram_to_dram_and_clears_strided_descs(monkeypatch):
    """The NIXL patch (measured: UCX rejects host memory labelled VRAM, and strided descriptor lists
    are not found for it): str "VRAM" arguments become "DRAM", arrays pass untouched, the per-block
    descriptor fallback is forced. Checked on stand-ins for nixl's agent and sglang's conn module."""
    import numpy as np

    from kvchaos import cpucompat

    calls = []

    class FakeAgent:
        def register_memory(self, addrs, mem_type=None):
            calls.append(("register_memory", addrs, mem_type))

        def prep_xfer_dlist(self, peer, descs, mem_type):
            calls.append(("prep_xfer_dlist", descs, mem_type))

    api = types.ModuleType("nixl._api")
    api.nixl_agent = FakeAgent
    pkg = types.ModuleType("nixl")
    pkg._api = api
    monkeypatch.setitem(sys.modules, "nixl", pkg)
    monkeypatch.setitem(sys.modules, "nixl._api", api)
    conn = types.ModuleType("sglang.srt.disaggregation.nixl.conn")

    class NixlKVManager:
        _use_strided_descs = True

    conn.NixlKVManager = NixlKVManager
    cpucompat._patch_nixl_conn(conn)
    a = FakeAgent()
    arr = np.arange(10).reshape(2, 5)
    a.prep_xfer_dlist("peer", arr, "VRAM")
    a.register_memory([1, 2], mem_type="VRAM")
    a.prep_xfer_dlist("peer", arr, "DRAM")
    assert calls[0][0] == "prep_xfer_dlist" and calls[0][1] is arr and calls[0][2] == "DRAM"
    assert calls[1] == ("register_memory", [1, 2], "DRAM")
    assert calls[2][2] == "DRAM"
    assert NixlKVManager._use_strided_descs is False


def test_every_engine_recipe_is_a_pinned_sglang():
    """scripts/setup-engine.sh builds environments for other SGLang releases; each must be one the
    compat layer was read for, else its servers refuse to start (CompatVersionError)."""
    r = subprocess.run(["bash", str(REPO / "scripts" / "setup-engine.sh"), "0.0.0"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "known:" in r.stderr, r.stderr
    known = r.stderr.split("known:", 1)[1].strip().rstrip(")").split(", ")
    assert sorted(known) == sorted(cpucompat.PINNED["sglang"]), (known, cpucompat.PINNED["sglang"])


_MLA_HANDLER = """
import sys, types
from kvchaos import cpucompat
if sys.argv[1] == "off":
    cpucompat.POST_IMPORT.pop("sglang.srt.models.deepseek_common.attention_backend_handler")
cpucompat.install()
from sglang.srt.models.deepseek_common import attention_backend_handler as h
from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod
fn = h.AttentionBackendRegistry.get_handler("torch_native")
print("handler", fn.__name__)
mode = types.SimpleNamespace(is_extend_without_speculative=lambda: True, is_decode=lambda: False)
fresh_prefill = types.SimpleNamespace(forward_mode=mode, extend_prefix_lens_cpu=[0])
print("method", fn(types.SimpleNamespace(), fresh_prefill) == AttnForwardMethod.MLA, cpucompat.APPLIED)
"""


@pytest.mark.parametrize("patch", ["on", "off"])
def test_mla_torch_native_handler(patch):
    """Without patch 5 an MLA model on torch_native gets the triton handler, which sends a fresh
    prefill down the plain MHA path over the latent buffer (the live MLA layout suites prove the
    patched path end to end); with it, every pass takes the absorbed MLA path."""
    env = {k: v for k, v in os.environ.items() if k != "KVCHAOS_CPU_COMPAT"}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-c", _MLA_HANDLER, patch], env=env, capture_output=True,
                       text=True, timeout=300, cwd="/")
    if patch == "off":
        assert "handler handle_attention_triton" in r.stdout, (r.stdout, r.stderr[-2000:])
        return
    assert r.returncode == 0, r.stderr[-2000:]
    assert "handler handle_attention_torch_native" in r.stdout
    assert "method True" in r.stdout and "mla-torch-native-absorbed" in r.stdout


# ------------------------------------------------------------------ patch 6: paged allocation
_PAGED = r'''
import json, sys, types
from kvchaos import cpucompat
if sys.argv[1] == "off":
    cpucompat.POST_IMPORT.pop("sglang.srt.mem_cache.allocator.paged", None)
cpucompat.install()
import sglang, torch
from sglang.srt.disaggregation.decode import alloc_for_decode_prealloc
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

PS, SIZE = 16, 1024  # 64 pages; page 0 is SGLang's padding page
out = {"version": sglang.__version__, "steps": []}


def T(v):
    return torch.tensor(v, dtype=torch.int64)


def allocator(need_sort):  # need_sort: as PD decode; without: as prefill
    kv = MHATokenToKVPool(SIZE, PS, torch.float32, 1, 4, 1, "cpu", False, enable_alt_stream=False)
    return PagedTokenToKVPoolAllocator(SIZE, PS, torch.float32, "cpu", kv, need_sort)


def record(name, a, kind, reqs, fn):
    free = a.free_pages.tolist()
    r = fn()
    out["steps"].append({"name": name, "kind": kind, "reqs": reqs, "free_before": free,
                         "out": None if r is None else r.tolist()})
    return r


def prealloc(a, name, n):  # decode's own pre-allocation of a transferred prompt (alloc_extend at page > 1)
    req = types.SimpleNamespace(kv=types.SimpleNamespace())
    return record(name, a, "extend", [[0, n, -1]], lambda: alloc_for_decode_prealloc(
        a, req=req, fill_len=n, delta_len=n, prefix_len=0, total_prefix_len=0, prefix_indices=None,
        uses_swa_tail=False, swa_tail_len=0))


def extend(a, name, reqs):  # [prefix_len, seq_len, last_loc] per request
    pre, seq, last = (T([r[i] for r in reqs]) for i in range(3))
    return record(name, a, "extend", reqs, lambda: a.alloc_extend(
        pre, pre.clone(), seq, seq.clone(), last, int((seq - pre).sum())))


def decode(a, name, reqs):  # [seq_len with the new token, last_loc] per request
    seq, last = T([r[0] for r in reqs]), T([r[1] for r in reqs])
    return record(name, a, "decode", reqs, lambda: a.alloc_decode(seq, seq.clone(), last))


a = allocator(True)
x = prealloc(a, "prealloc_100", 100)  # 6 whole pages + 4 tokens of a 7th
x2 = extend(a, "continue_partial_page", [[100, 140, int(x[-1])]])  # 12 in x's page, 1 whole, 12 in a new one
y = prealloc(a, "prealloc_32", 32)
b = extend(a, "batch", [[140, 141, int(x2[-1])], [0, 33, -1], [32, 50, int(y[-1])], [0, 16, -1]])
e, f, g = (prealloc(a, f"prealloc_{n}", n) for n in (48, 20, 32))
decode(a, "decode_batch", [[49, int(e[-1])], [21, int(f[-1])], [33, int(g[-1])], [142, int(b[0])]])
extend(a, "pool_short_extend", [[0, SIZE, -1]])

full = allocator(False)
z = full.alloc(SIZE)  # every page
decode(full, "pool_empty_decode_new_page", [[17, int(z[15])]])
decode(full, "pool_empty_decode_in_page", [[18, int(z[16])]])
extend(full, "pool_empty_extend_in_page", [[17, 20, int(z[16])]])

s = allocator(False)  # a scrambled free list: pages are taken in its order, not by number
p = [s.alloc(32) for _ in range(4)]  # pages 1-2, 3-4, 5-6, 7-8
for i in (2, 0, 3):
    s.free(p[i])  # free list: 7 8 1 2 5 6 9 ...
r = extend(s, "scrambled_batch", [[0, 40, -1], [0, 17, -1], [32, 36, int(p[1][-1])]])
q, w = s.alloc(16), s.alloc(32)  # pages 9 and 10-11
decode(s, "scrambled_decode", [[41, int(r[39])], [17, int(q[-1])], [18, int(r[56])], [33, int(w[-1])],
                               [37, int(r[-1])]])
out["applied"] = cpucompat.APPLIED
print("RESULT " + json.dumps(out))
'''

# the two steps on the scrambled free list, by hand: request by request in batch order, whole pages
# from the head of the free list (7 8 1 2 5 6 9 ...), a partial last page is the request's last new one
_SCRAMBLED = {
    "scrambled_batch": [*range(7 * 16, 9 * 16), *range(16, 24),  # 40 tokens: pages 7, 8 whole, 8 in page 1
                        *range(2 * 16, 3 * 16), 5 * 16,  # 17 tokens: page 2 whole, 1 in page 5
                        *range(6 * 16, 6 * 16 + 4)],  # prefix 32 (pages 3-4, page-aligned): 4 in page 6
    # free list then 12 13 ...: 41 and 18 and 37 continue in-page; 17 and 33 open pages 12 and 13
    "scrambled_decode": [24, 12 * 16, 81, 13 * 16, 100],
}


def _engine_python(version: str) -> Path:
    return Path(releases.env_python(version))  # where scripts/setup-engine.sh builds it; nothing built here


def _paged(python, patch: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVCHAOS_CPU_COMPAT", "KVCHAOS_AGENT")}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([str(python), "-c", _PAGED, patch], env=env, capture_output=True, text=True, timeout=300,
                       cwd="/")
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    return r, (json.loads(line[len("RESULT "):]) if line else None)


def _reference(kind, reqs, free, ps=16):
    """alloc_extend_kernel / alloc_decode_kernel's semantics in plain Python."""
    if kind == "decode":
        need = sum((seq - 1) % ps == 0 for seq, _ in reqs)
    else:
        need = sum(-(-seq // ps) - -(-pre // ps) for pre, seq, _ in reqs)
    if need > len(free):
        return None  # the pool is short: the allocator returns None
    out, k = [], 0
    for req in reqs:
        if kind == "decode":
            seq, last = req
            if (seq - 1) % ps == 0:
                out.append(free[k] * ps)
                k += 1
            else:
                out.append(last + 1)
            continue
        pre, seq, last = req
        n1 = min(seq, -(-pre // ps) * ps) - pre  # the rest of the prefix's partial page
        out += [last + 1 + j for j in range(n1)]
        pos = pre + n1
        while pos < seq:  # then whole new pages, the last possibly partial, from the free list in order
            take = min(ps, seq - pos)
            out += [free[k] * ps + j for j in range(take)]
            k, pos = k + 1, pos + take
    assert k == need
    return out


def _check_semantics(res):
    steps = {s["name"]: s for s in res["steps"]}
    for s in res["steps"]:
        assert s["out"] == _reference(s["kind"], s["reqs"], s["free_before"]), s
    for name, want in _SCRAMBLED.items():
        assert steps[name]["out"] == want, (name, steps[name]["out"])
    assert steps["pool_short_extend"]["out"] is None and steps["pool_empty_decode_new_page"]["out"] is None
    assert steps["pool_empty_decode_in_page"]["out"] == [steps["pool_empty_decode_in_page"]["reqs"][0][1] + 1]
    # no slot handed out twice on the decode-like allocator (all its requests are alive at the end)
    live = [i for s in res["steps"] if s["out"] and not s["name"].startswith(("pool_", "scrambled"))
            for i in s["out"]]
    assert len(live) == len(set(live)) and 0 not in {i // 16 for i in live}
    # new pages are whole pages: every page a step opened starts at its first slot and is filled in order
    x = steps["prealloc_100"]["out"]
    assert x[:96] == [p * 16 + j for p in range(1, 7) for j in range(16)] and x[96:] == [112, 113, 114, 115]
    assert steps["continue_partial_page"]["out"] == [*range(116, 128), *range(128, 144), *range(144, 156)]


@pytest.fixture(scope="module")
def paged_reference(tmp_path_factory):
    """0.5.23 (this environment) on CPU: its own non-Triton path (``alloc_extend_naive`` /
    ``alloc_decode_naive``), patch 6 a no-op. Computed once per session (the module's tests may run on
    both xdist workers)."""
    from tests.util import once_per_session

    def reference():
        r, res = _paged(sys.executable, "on")
        assert res, r.stderr[-3000:]
        return res

    res = once_per_session(tmp_path_factory, "paged-reference-0.5.23", reference)
    assert "paged-alloc-torch" not in res["applied"], res["applied"]
    return res


def test_paged_allocation_reference_is_the_kernel_semantics(paged_reference):
    _check_semantics(paged_reference)


def test_paged_allocation_on_0519_needs_patch_6(paged_reference):
    """0.5.19's paged allocator launches Triton unconditionally: decode's pre-allocation of the first
    prompt dies on CPU without patch 6; with it, every step gives the slots 0.5.23 gives (and the
    kernels' semantics by hand)."""
    py = _engine_python("0.5.19")
    if not py.exists():
        pytest.skip(f"no sglang 0.5.19 environment at {py} (scripts/setup-engine.sh 0.5.19 builds it)")
    bad, res = _paged(py, "off")
    assert bad.returncode != 0 and res is None and "0 active drivers" in bad.stderr, bad.stderr[-2000:]
    ok, res = _paged(py, "on")
    assert ok.returncode == 0 and res, ok.stderr[-3000:]
    assert res["version"] == "0.5.19" and "paged-alloc-torch" in res["applied"]
    _check_semantics(res)
    assert res["steps"] == paged_reference["steps"]


# behind -m slow for CI's 30 minutes (test_paged_allocation_on_0519_needs_patch_6 stays: the patch's own case)
@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.5.20", "0.5.21", "0.5.22"])
def test_paged_allocation_on_the_releases_between(version, paged_reference):
    """0.5.20 and 0.5.21 launch Triton unconditionally too (patched); 0.5.22 gates it like 0.5.23
    (patch 6 a no-op). Either way the slots equal 0.5.23's."""
    py = _engine_python(version)
    if not py.exists():
        pytest.skip(f"no sglang {version} environment at {py} (scripts/setup-engine.sh {version} builds it)")
    r, res = _paged(py, "on")
    assert r.returncode == 0 and res, r.stderr[-3000:]
    assert res["version"] == version
    assert ("paged-alloc-torch" in res["applied"]) == (version in ("0.5.20", "0.5.21")), res["applied"]
    assert res["steps"] == paged_reference["steps"]


def _fake_scheduler_module():
    mod = types.ModuleType("sglang.srt.managers.scheduler")

    class Poller:
        def __init__(self):
            self.polls = []

        def poll(self, ms):
            self.polls.append(ms)

    class Scheduler:
        def __init__(self, sleeper=True):
            self.idle_sleeper = types.SimpleNamespace(poller=Poller()) if sleeper else None
            self.fully_idle, self.passes = False, 0

        def on_idle(self):
            self.passes += 1

        def is_fully_idle(self):
            return self.fully_idle

    mod.Scheduler = Scheduler
    return mod


def test_parked_scheduler_polls_instead_of_spinning(monkeypatch):
    """Patch 7: a pass with work parked (not fully idle) waits on the idle sleeper's sockets for the
    configured milliseconds; a fully idle pass (already asleep in IdleSleeper) and a scheduler without
    an idle sleeper (no --sleep-on-idle) are untouched; applied once however often the module loads."""
    monkeypatch.setattr(cpucompat, "APPLIED", [])
    monkeypatch.setenv("KVCHAOS_PARKED_POLL_MS", "2")
    mod = _fake_scheduler_module()
    cpucompat._patch_scheduler(mod)
    cpucompat._patch_scheduler(mod)
    s = mod.Scheduler()
    s.on_idle()
    assert s.passes == 1 and s.idle_sleeper.poller.polls == [2]
    s.fully_idle = True
    s.on_idle()
    assert s.passes == 2 and s.idle_sleeper.poller.polls == [2]
    bare = mod.Scheduler(sleeper=False)
    bare.on_idle()
    assert bare.passes == 1
    assert cpucompat.APPLIED == ["scheduler-parked-poll-2ms"]


@pytest.mark.parametrize("value", ["", "0"])
def test_parked_poll_off_leaves_the_scheduler_alone(monkeypatch, value):
    monkeypatch.setenv("KVCHAOS_PARKED_POLL_MS", value)
    mod = _fake_scheduler_module()
    orig = mod.Scheduler.on_idle
    cpucompat._patch_scheduler(mod)
    assert mod.Scheduler.on_idle is orig


@pytest.mark.parametrize("value", ["1.5", "soon", "-1", "5000"])
def test_parked_poll_bad_value_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("KVCHAOS_PARKED_POLL_MS", value)
    with pytest.raises(cpucompat.CompatVersionError, match=f"KVCHAOS_PARKED_POLL_MS={value!r}"):
        cpucompat.parked_poll_ms()


def test_parked_poll_and_transfer_wait_wrap_the_real_engine(monkeypatch):
    """On the installed SGLang (one interpreter for both: each import of sglang costs ~10 CPU-s):
    patch 7 — the scheduler module loads through it, and what it wraps is there (on_idle,
    is_fully_idle, an IdleSleeper whose poller it waits on); patch 8 — the transfer engine module loads
    through it, and the method it wraps is the one conn.py's _transfer_data calls."""
    monkeypatch.setenv("KVCHAOS_PARKED_POLL_MS", "1")
    monkeypatch.setenv("KVCHAOS_TRANSFER_WAIT_NICE", "19")
    code = ("import inspect\nimport zmq\nfrom sglang.srt.managers import scheduler as m\n"
            "from sglang.srt.managers.scheduler_components.idle_sleeper import IdleSleeper\n"
            "s = zmq.Context().socket(zmq.PULL)\n"
            "print('wrapped', getattr(m.Scheduler.on_idle, '_kvchaos_parked_poll', None),"
            " hasattr(m.Scheduler, 'is_fully_idle'), hasattr(IdleSleeper([s]), 'poller'))\n"
            "from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as te\n"
            "from sglang.srt.disaggregation.mooncake import conn\n"
            "print('niced', getattr(te.MooncakeTransferEngine.batch_transfer_sync, '_kvchaos_nice', None),"
            " 'self.engine.batch_transfer_sync(' in inspect.getsource(conn.MooncakeKVManager._transfer_data))\n"
            "from kvchaos import cpucompat; print(cpucompat.APPLIED)\n")
    ok = _py(code, compat=True)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "wrapped 1 True True" in ok.stdout and "scheduler-parked-poll-1ms" in ok.stdout
    assert "niced 19 True" in ok.stdout and "mooncake-transfer-wait-nice-19" in ok.stdout


def _fake_mooncake_engine_module(calls):
    mod = types.ModuleType("fake_mooncake_transfer_engine")

    class MooncakeTransferEngine:
        def batch_transfer_sync(self, session_id, buffers, peer_buffer_addresses, lengths):
            calls.append((session_id, threading.get_native_id(),
                          os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
            return -1 if session_id == "bad" else 0

    mod.MooncakeTransferEngine = MooncakeTransferEngine
    return mod


def test_transfer_wait_runs_its_calling_thread_niced(monkeypatch):
    """Patch 8: the thread that calls batch_transfer_sync runs at the configured niceness from its first
    call on (the spin inside Mooncake waits at that priority); its arguments and result pass through; a
    thread that never called it keeps its priority; applied once however often the module loads."""
    monkeypatch.setattr(cpucompat, "APPLIED", [])
    monkeypatch.setenv("KVCHAOS_TRANSFER_WAIT_NICE", "19")
    calls = []
    mod = _fake_mooncake_engine_module(calls)
    cpucompat._patch_mooncake_engine(mod)
    cpucompat._patch_mooncake_engine(mod)
    out, main_prio = {}, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def worker():
        e = mod.MooncakeTransferEngine()
        out["first"] = e.batch_transfer_sync("s", [1], [2], [3])
        out["bad"] = e.batch_transfer_sync("bad", [1], [2], [3])

    t = threading.Thread(target=worker)
    t.start()
    t.join(10)
    assert out == {"first": 0, "bad": -1}
    assert [c[0] for c in calls] == ["s", "bad"] and {c[2] for c in calls} == {19}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_prio
    assert cpucompat.APPLIED == ["mooncake-transfer-wait-nice-19"]


@pytest.mark.parametrize("value", ["", "0"])
def test_transfer_wait_nice_off_leaves_the_engine_alone(monkeypatch, value):
    monkeypatch.setenv("KVCHAOS_TRANSFER_WAIT_NICE", value)
    mod = _fake_mooncake_engine_module([])
    orig = mod.MooncakeTransferEngine.batch_transfer_sync
    cpucompat._patch_mooncake_engine(mod)
    assert mod.MooncakeTransferEngine.batch_transfer_sync is orig


@pytest.mark.parametrize("value", ["-5", "20", "low"])
def test_transfer_wait_nice_bad_value_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("KVCHAOS_TRANSFER_WAIT_NICE", value)
    with pytest.raises(cpucompat.CompatVersionError, match=f"KVCHAOS_TRANSFER_WAIT_NICE={value!r}"):
        cpucompat.transfer_wait_nice()
