"""The CPU compatibility layer: each patch is needed (fails without) and works (passes with)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvchaos import cpucompat

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
    import sys
    import types

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
