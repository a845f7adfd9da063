"""like: probes — a probe model with a real model's KV-cache geometry (kvchaos.probe.like).

The engine's KV pool for a like probe must be byte for byte the named model's (SGLang's own ModelConfig
and pool classes say so, against the arithmetic), the probe must still recite its own and foreign (stale)
canaries through every layer, and bad configs and names must be refused naming what is wrong.
"""

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvchaos import canary, cpucompat
from kvchaos.cluster import ClusterSpec
from kvchaos.cluster.argv import resolve_model, server_argv
from kvchaos.cluster.layouts import Layout, LayoutError, apply, attention_of_model, of_spec, parse, parse_list
from kvchaos.cluster.spec import SpecError
from kvchaos.probe import TRIGGER, ensure_probe, like, max_new_tokens, probe_dir, prompt, recipe_digest
from kvchaos.probe.build import build
from kvchaos.probe.measure import sensitive_enough

cpucompat.install()  # transformers and SGLang import torchvision, which needs the CPU patch here

REPO = Path(__file__).resolve().parents[1]
LLAMA, DEEPSEEK = "like:llama-3.1-8b", "like:deepseek-v3"
PAGE = 64
# the arithmetic of the named models' KV per token in bf16 (2 bytes an element)
LLAMA_BF16_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V x 32 layers x 8 KV heads x head_dim 128 = 131072
DEEPSEEK_BF16_TOKEN = 61 * (512 + 64) * 2  # 61 layers x (kv_lora_rank 512 + rope 64) = 70272
# weights of the hand-written probes before like probes existed (their builders were generalised around them)
GQA_SHA = "64a3069f56b0ffb9f9ba94aa3a639567b93f65c9483721b83ce21c1b2b5d527f"
MLA_SHA = "dfe6cce938cb4dc4d75ae1999db56d27e02ee45e6d67e99a8715ed11c193636a"


def _sha(p):
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def _config(name: str) -> dict:
    return json.loads((like.LIKE_DIR / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """Both committed like probes, built through ensure_probe into a cache of this module's own."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCHAOS_CACHE", str(cache))
        yield {kind: ensure_probe(kind) for kind in (LLAMA, DEEPSEEK)}


@pytest.fixture
def registered(tmp_path):
    """Register configs written to tmp_path for one test; forgotten afterwards (process and environment)."""
    names = []

    def reg(name: str, cfg: dict) -> Path:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        like.register(path)
        names.append(name)
        return path

    before = os.environ.get(like.ENV)
    yield reg
    for n in names:
        like.unregister(n)
    if before is None:
        os.environ.pop(like.ENV, None)
    else:
        os.environ[like.ENV] = before


# ---------------------------------------------------------------- geometry: as SGLang derives it

def test_committed_configs_are_the_named_models_geometry_only():
    assert like.committed_names() == ["deepseek-v3", "llama-3.1-8b"]
    for name in like.committed_names():
        cfg = _config(name)
        assert "geometry only" in cfg["_kvchaos"].lower()
        assert not (like.LIKE_DIR / f"{name}.safetensors").exists()
    g = like.geometry("llama-3.1-8b")
    assert (g.architecture, g.attention, g.layers, g.kv_heads, g.head_dim, g.dtype, g.num_attention_heads) == (
        "LlamaForCausalLM", "gqa", 32, 8, 128, "bfloat16", 32)
    assert g.bytes_per_token() == LLAMA_BF16_TOKEN and g.bytes_per_page(PAGE) == PAGE * LLAMA_BF16_TOKEN
    assert g.bytes_per_token("fp8_e4m3") == LLAMA_BF16_TOKEN // 2 and g.probe_heads == 8
    d = like.geometry("deepseek-v3")
    assert (d.architecture, d.attention, d.layers, d.kv_heads, d.kv_lora_rank, d.qk_rope_head_dim, d.dtype,
            d.num_attention_heads) == ("DeepseekV3ForCausalLM", "mla", 61, 1, 512, 64, "bfloat16", 128)
    assert d.bytes_per_token() == DEEPSEEK_BF16_TOKEN and d.bytes_per_page(PAGE) == PAGE * DEEPSEEK_BF16_TOKEN
    assert d.request_bytes(512, PAGE) == 8 * PAGE * DEEPSEEK_BF16_TOKEN and d.request_bytes(513, PAGE) == 9 * PAGE * DEEPSEEK_BF16_TOKEN


def test_like_constants_match_the_circuit_builders():
    from kvchaos.probe import circuit, mla

    assert like.CIRCUIT_HEAD_DIM == circuit.HEAD_DIM and like.OFFSET_HEADS == len(circuit.OFFSETS)
    assert like.MIN_KV_LORA_RANK == 4 * circuit.NT == max(mla.LAT.values()) + circuit.NT
    assert like.MLA_ROPE_HEAD_DIM == mla.QK_ROPE and like.MLA_PROBE_HEADS == mla.MLA_HEADS


def _sglang_pool(mc, dtype, page, size):
    """The KV pool SGLang builds for a ModelConfig (tp 1), on cpu."""
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if mc.attention_arch == AttentionArch.MLA:
        return MLATokenToKVPool(size=size, page_size=page, dtype=dtype, kv_lora_rank=mc.kv_lora_rank,
                                qk_rope_head_dim=mc.qk_rope_head_dim, layer_num=mc.num_attention_layers,
                                device="cpu", enable_memory_saver=False)
    return MHATokenToKVPool(size=size, page_size=page, dtype=dtype, head_num=mc.get_num_kv_heads(1),
                            head_dim=mc.head_dim, v_head_dim=mc.v_head_dim, layer_num=mc.num_attention_layers,
                            device="cpu", enable_memory_saver=False)


@pytest.mark.parametrize("kind, per_token", [(LLAMA, LLAMA_BF16_TOKEN), (DEEPSEEK, DEEPSEEK_BF16_TOKEN)])
def test_engine_kv_pool_of_a_like_probe_is_the_named_models(kind, per_token, probes, tmp_path):
    """SGLang's ModelConfig of the built probe and of the named model's config give the same KV geometry,
    and the pool SGLang builds from the probe's holds the named model's bytes per token and per page (what a
    PD transfer moves: the pool's registered item lengths), bf16, page 64."""
    import torch
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    name = like.name_of_kind(kind)
    real = tmp_path / name
    real.mkdir()
    shutil.copyfile(like.LIKE_DIR / f"{name}.json", real / "config.json")
    got, want = ModelConfig(str(probes[kind])), ModelConfig(str(real))
    fields = ["attention_arch", "num_attention_layers"]
    fields += (["kv_lora_rank", "qk_rope_head_dim"] if want.attention_arch == AttentionArch.MLA else
               ["head_dim", "v_head_dim"])
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    if want.attention_arch != AttentionArch.MLA:  # MLA keeps one latent per token, whatever the heads
        assert got.get_num_kv_heads(1) == want.get_num_kv_heads(1) == 8
    assert str(want.dtype) == f"torch.{like.geometry(name).dtype}"  # what --dtype auto serves for the real model
    size = 2 * PAGE
    pool = _sglang_pool(got, torch.bfloat16, PAGE, size)
    _, _, item_lens = pool.get_contiguous_buf_infos()  # one item = one page of one buffer (per layer; K and V)
    assert sum(item_lens) == PAGE * per_token == like.geometry(name).bytes_per_page(PAGE)
    held = pool.get_kv_size_bytes()  # MHA: (K bytes, V bytes); MLA: the latents' bytes
    kv_bytes = sum(map(int, held)) if isinstance(held, tuple) else int(held)
    assert kv_bytes == (size + PAGE) * per_token  # SGLang pads one page (slot 0 takes padded tokens' writes)


# ---------------------------------------------------------------- the probes: built, recite

def test_like_probes_are_built_once_with_their_geometry_recorded(probes):
    llama, ds = probes[LLAMA], probes[DEEPSEEK]
    assert llama == probe_dir(LLAMA) and llama.name == f"probe-like-llama-3.1-8b-{recipe_digest(LLAMA)}"
    stamp = (llama / "model.safetensors").stat().st_mtime_ns
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCHAOS_CACHE", str(llama.parent.parent))
        assert ensure_probe(LLAMA) == llama and (llama / "model.safetensors").stat().st_mtime_ns == stamp
    for path, kind, arch, att, layers in ((llama, LLAMA, "LlamaForCausalLM", "gqa", 32),
                                          (ds, DEEPSEEK, "DeepseekV2ForCausalLM", "mla", 61)):
        meta = json.loads((path / "kvchaos-model.json").read_text())
        cfg = json.loads((path / "config.json").read_text())
        assert meta["weights_sha256"] == _sha(path / "model.safetensors")
        assert (meta["probe_kind"], meta["attention"], meta["architecture"], meta["echoes_context"]) == (kind, att, arch, True)
        assert meta["like"]["name"] == like.name_of_kind(kind)
        assert meta["like"]["config"] == f"kvchaos/probe/like/{like.name_of_kind(kind)}.json"
        assert meta["like"]["geometry"] == like.geometry(like.name_of_kind(kind)).to_dict()
        assert cfg["num_hidden_layers"] == layers and cfg["hidden_size"] == 256 and cfg["architectures"] == [arch]
    cfg = json.loads((llama / "config.json").read_text())
    assert (cfg["num_key_value_heads"], cfg["num_attention_heads"], cfg["head_dim"]) == (8, 8, 128)
    cfg = json.loads((ds / "config.json").read_text())
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["first_k_dense_replace"]) == (512, 64, 61)


def test_like_probe_layers_between_the_circuit_pass_the_residual_through(probes):
    from safetensors.numpy import load_file

    w = load_file(str(probes[LLAMA] / "model.safetensors"))
    for i in range(1, 31):
        pre = f"model.layers.{i}."
        assert not w[pre + "self_attn.o_proj.weight"].any() and not w[pre + "mlp.down_proj.weight"].any()
        assert w[pre + "self_attn.k_proj.weight"].reshape(8, 128, 256).any(axis=(1, 2)).all()  # every KV head
        assert w[pre + "self_attn.v_proj.weight"].reshape(8, 128, 256).any(axis=(1, 2)).all()
    for i in (0, 31):  # the circuit: every KV head carries something, unused ones the token
        assert w[f"model.layers.{i}.self_attn.o_proj.weight"].any()
        assert w[f"model.layers.{i}.self_attn.v_proj.weight"].reshape(8, 128, 256).any(axis=(1, 2)).all()
    w = load_file(str(probes[DEEPSEEK] / "model.safetensors"))
    for i in range(1, 60):
        pre = f"model.layers.{i}."
        assert not w[pre + "self_attn.o_proj.weight"].any() and not w[pre + "mlp.down_proj.weight"].any()
        assert w[pre + "self_attn.kv_a_proj_with_mqa.weight"][:512].any()
    assert w["model.layers.60.self_attn.o_proj.weight"].any()


def test_like_builders_keep_the_hand_written_probes_bytes(registered, tmp_path):
    """A like config of the gqa / mla probes' own geometry builds exactly their weights, which are still
    what they were before the builders took layer counts, KV heads and latent widths."""
    base = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 128, "hidden_size": 256, "torch_dtype": "float32"}
    registered("as-gqa", base)
    registered("as-mla", {**_config("deepseek-v3"), "num_hidden_layers": 2})
    for kind, sha in (("gqa", GQA_SHA), ("mla", MLA_SHA), ("like:as-gqa", GQA_SHA), ("like:as-mla", MLA_SHA)):
        assert _sha(build(tmp_path / kind.replace(":", "-"), kind) / "model.safetensors") == sha, kind


def _stale_reply(model_dir, dtype, seed):
    """The incident in transformers: a victim's KV cache over its prompt, where a stretch of filler is
    overwritten (every layer) by a donor's KV of its canary, written at other positions for another
    request; then the trigger. Returns (own, foreign, reply with the stale KV, reply without)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    rng = random.Random(seed)
    own = canary.mint(rng, 1)[0]
    foreign = canary.mint(rng, 1, avoid_first=[own[1]])[0]
    head = canary.filler(rng, 12) + " " + own + " "
    victim = head + canary.filler(rng, 60) + canary.filler(rng, 20) + TRIGGER
    donor = prompt(rng, 200, [foreign])
    at_d = donor.index(foreign) - 1  # the donor's " [XXXXXXXXXX] " stretch
    at_v = len(head) + 20  # lands inside the victim's filler, far from its tail
    span = canary.LENGTH + 2
    order = sorted([own, foreign], key=lambda c: canary.ALPHABET.index(c[1]))
    ids = tok(victim, return_tensors="pt").input_ids

    def reply(splice: bool, want: list[str]) -> str:
        with torch.no_grad():
            cache = m(ids[:, :-1], use_cache=True).past_key_values
            if splice:
                dcache = m(tok(donor, return_tensors="pt").input_ids, use_cache=True).past_key_values
                for layer, dl in zip(cache.layers, dcache.layers):
                    layer.keys[:, :, at_v:at_v + span] = dl.keys[:, :, at_d:at_d + span]
                    layer.values[:, :, at_v:at_v + span] = dl.values[:, :, at_d:at_d + span]
            expect = tok("".join(want)[1:] + canary.START, return_tensors="pt").input_ids[0]
            forced = torch.cat([ids[0, -1:], expect])[None]  # teacher forcing: the reply up to its first divergence
            picked = m(forced, past_key_values=cache, use_cache=True).logits[0].argmax(-1)
        expect = torch.cat([expect, torch.tensor([m.config.eos_token_id])])
        wrong = (picked != expect).nonzero()
        return tok.decode(picked[: int(wrong[0]) + 1 if len(wrong) else len(expect)])

    return own, foreign, reply(True, order), reply(False, [own])


# behind -m slow for CI's time: ~150 core-seconds of bf16 forward passes through the Llama- and
# DeepSeek-shaped probes, whose layouts make test's cluster sessions never run. make test-like runs it
# before its like: clusters, each of which its own planted-leak self-test gates (a probe that no longer
# recites leaves that run UNKNOWN, never green)
@pytest.mark.slow
@pytest.mark.parametrize("kind", [LLAMA, DEEPSEEK])
def test_like_probes_recite_own_foreign_and_stale_canaries_in_transformers(kind, probes):
    from tests.test_probe_model import _hf_rates  # the hand-written probes' own check, teacher-forced

    echo, cont = _hf_rates(probes[kind], n=3, seed=5, dtype="bfloat16", lengths=(80, 240), forced_from=0)
    assert echo.rate == 1.0, echo.failures
    assert cont.rate == 1.0, cont.failures
    assert sensitive_enough(echo, cont) == (True, "sensitive")
    own, foreign, stale, clean = _stale_reply(probes[kind], "bfloat16", seed=7)
    assert canary.payload(own) in stale and canary.payload(foreign) in stale, (own, foreign, stale)
    assert canary.payload(own) in clean and canary.payload(foreign) not in clean, (own, foreign, clean)


def test_local_model_replies_are_greedy_whatever_the_draft(tmp_path):
    """The transformers runner of the probe benchmark (kvchaos.probe.measure.LocalModel) answers as greedy
    generate does: in one pass when the model recites as drafted, through generate when it does not."""
    from kvchaos.probe.build import COMMITTED
    from kvchaos.probe.measure import LocalModel, main

    m = LocalModel(COMMITTED, "float32")
    rng = random.Random(11)
    texts = [prompt(rng, n, canary.mint(rng, k)) for n, k in ((60, 1), (120, 2), (200, 3))]
    budget = max_new_tokens(3)

    def greedy(text):
        ids = m.tok(text, return_tensors="pt").input_ids
        out = m.model.generate(ids, max_new_tokens=budget, do_sample=False, eos_token_id=m.eos,
                               pad_token_id=m.eos)[0, ids.shape[1]:].tolist()
        return out[:-1] if out[-1] == m.eos else out

    want = [greedy(t) for t in texts]
    assert [m.generate(t, budget)["output_ids"] for t in texts] == want and (m.drafted, m.continued) == (3, 0)
    m.draft = lambda text: m.tok("ZZZZ").input_ids  # a draft the model never follows
    assert [m.generate(t, budget)["output_ids"] for t in texts] == want and (m.drafted, m.continued) == (3, 3)
    out = tmp_path / "rates.json"
    assert main(["--model", str(COMMITTED), "--dtype", "float32", "--echo", "3", "--contamination", "3",
                 "--lengths", "64,128", "--json", str(out)]) == 0
    rates = json.loads(out.read_text())
    assert rates["echo"]["rate"] == rates["contamination"]["rate"] == 1.0 and rates["sensitive"]


# ---------------------------------------------------------------- refused by name

@pytest.mark.parametrize("base, patch, field", [
    ("llama-3.1-8b", {"num_hidden_layers": None}, "'num_hidden_layers' is missing"),
    ("llama-3.1-8b", {"num_hidden_layers": 1}, "'num_hidden_layers'=1 must be >= 2"),
    ("llama-3.1-8b", {"num_key_value_heads": 1}, "'num_key_value_heads'=1: the recital circuit needs 2 KV heads"),
    ("llama-3.1-8b", {"num_key_value_heads": 5}, "'num_attention_heads'=32 is not a multiple of num_key_value_heads=5"),
    ("llama-3.1-8b", {"hidden_size": 2048}, "head_dim 64 (hidden_size 2048 // num_attention_heads 32)"),
    ("llama-3.1-8b", {"head_dim": 256}, "head_dim 256 (field 'head_dim')"),
    ("llama-3.1-8b", {"architectures": ["GPT2LMHeadModel"]}, "'architectures' names 'GPT2LMHeadModel'"),
    ("llama-3.1-8b", {"architectures": None}, "'architectures' is missing"),
    ("llama-3.1-8b", {"torch_dtype": "int8"}, "'torch_dtype'='int8'"),
    ("llama-3.1-8b", {"num_attention_heads": "32"}, "'num_attention_heads'='32' must be an integer"),
    ("llama-3.1-8b", {"sliding_window": 4096}, "'sliding_window'=4096"),
    ("llama-3.1-8b", {"v_head_dim": 64}, "'v_head_dim'=64"),
    ("deepseek-v3", {"kv_lora_rank": None}, "multi-head latent attention but field 'kv_lora_rank' is missing"),
    ("deepseek-v3", {"kv_lora_rank": 64}, "'kv_lora_rank'=64 must be >= 140"),
    ("deepseek-v3", {"qk_rope_head_dim": 32}, "'qk_rope_head_dim'=32: the MLA recital circuit needs 64"),
    ("deepseek-v3", {"qk_nope_head_dim": None}, "'qk_nope_head_dim' is missing"),
    ("deepseek-v3", {"index_topk": 2048}, "'index_topk' is set: DSA sparse attention"),
])
def test_bad_configs_are_refused_naming_file_and_field(base, patch, field, tmp_path):
    cfg = {k: v for k, v in {**_config(base), **patch}.items() if v is not None}
    path = tmp_path / "bad-model.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(like.LikeError) as e:
        like.load_path(path)
    assert str(path) in str(e.value) and field in str(e.value), str(e.value)


def test_unreadable_configs_and_names_are_refused(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(like.LikeError, match=r"broken\.json: not JSON"):
        like.load_path(broken)
    with pytest.raises(like.LikeError, match=r"missing\.json: no like config there"):
        like.load_path(tmp_path / "missing.json")
    with pytest.raises(like.LikeError, match="rename it"):
        like.name_of_path(tmp_path / "My Model.json")
    with pytest.raises(like.LikeError, match="'nosuch': no config of that name .*deepseek-v3, llama-3.1-8b"):
        like.geometry("nosuch")
    with pytest.raises(ValueError, match="'gpa'.*mha, gqa, mla and like:<name>"):
        probe_dir("gpa")


def test_a_registered_name_may_not_stand_for_another_geometry(registered, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "llama-3.1-8b.json").write_text(json.dumps({**_config("llama-3.1-8b"), "num_hidden_layers": 16}))
    with pytest.raises(like.LikeError, match="already stands for .*llama-3.1-8b.json, with another geometry"):
        like.register(other / "llama-3.1-8b.json")
    path = registered("my-llama", {**_config("llama-3.1-8b"), "num_hidden_layers": 16})
    assert like.geometry("my-llama").layers == 16 and str(path) in os.environ[like.ENV].split(os.pathsep)
    with pytest.raises(like.LikeError, match="another geometry"):
        (other / "my-llama.json").write_text(json.dumps(_config("llama-3.1-8b")))
        like.register(other / "my-llama.json")


@pytest.mark.parametrize("bad, why", [
    ("like:nosuch-p64-bf16", "'nosuch': no config of that name"),
    ("like:llama-3.1-8b-p0-bf16", "page size must be >= 1"),
    ("like:llama-3.1-8b-p64-int8", "dtype 'int8' is not one of ('fp32', 'bf16', 'fp16', 'fp8')"),
    ("like:llama-3.1-8b", "expected like:<config name>-p<page size>-<dtype>"),
    ("like:Llama-p64-bf16", "expected like:<config name>-p<page size>-<dtype>"),
    ("mha-p64-fp8", "fp8 is a like: layout's"),
])
def test_bad_like_layout_names_are_refused(bad, why):
    with pytest.raises(LayoutError, match=why.replace("(", r"\(").replace(")", r"\)")):
        parse_list(bad)


# ---------------------------------------------------------------- layouts, specs, argv

def test_like_layouts_set_the_probe_and_consumers_see_gqa_or_mla():
    lay = parse("like:llama-3.1-8b-p64-bf16")
    assert lay == Layout("gqa", 64, "bf16", like="llama-3.1-8b") and lay.name == "like:llama-3.1-8b-p64-bf16"
    assert lay.overrides() == {"model": "probe:like:llama-3.1-8b", "page_size": 64, "dtype": "bfloat16",
                               "kv_cache_dtype": "auto"}
    assert parse("like:deepseek-v3-p64-bf16").attention == "mla"
    base = ClusterSpec.load("cpu")
    for name, att in (("like:llama-3.1-8b-p64-bf16", "gqa"), ("like:deepseek-v3-p64-bf16", "mla")):
        spec = ClusterSpec.from_dict(apply(base.to_dict(), parse(name)))
        assert spec.layout == name and spec.name == f"cpu-{name}" and of_spec(spec) == name
        assert attention_of_model(spec.model) == att
        assert server_argv(spec, "/m", "prefill", 1, 2).count("--kv-cache-dtype") == 0
    assert attention_of_model("probe:mla") == "mla" and attention_of_model("probe") == "mha"
    assert attention_of_model("/some/dir") is None
    with pytest.raises(LayoutError, match="'nosuch'"):
        attention_of_model("probe:like:nosuch")
    with pytest.raises(SpecError, match="model='probe:like:nosuch': like probe 'nosuch': no config"):
        ClusterSpec.load("cpu", model="probe:like:nosuch")


def test_resolve_model_builds_the_like_probe(probes):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCHAOS_CACHE", str(probes[LLAMA].parent.parent))
        spec = ClusterSpec.from_dict(apply(ClusterSpec.load("cpu").to_dict(), parse("like:llama-3.1-8b-p64-bf16")))
        assert resolve_model(spec) == str(probes[LLAMA])


def test_fp8_kv_cache_is_refused_on_cpu_and_passed_on_cuda():
    fp8 = parse("like:llama-3.1-8b-p64-fp8")
    assert fp8.overrides()["dtype"] == "bfloat16" and fp8.overrides()["kv_cache_dtype"] == "fp8_e4m3"
    with pytest.raises(SpecError, match="kv cache dtype fp8_e4m3 is not supported on cpu by SGLang with "
                                        "attention backend torch_native"):
        ClusterSpec.from_dict(apply(ClusterSpec.load("cpu").to_dict(), fp8))
    with pytest.raises(SpecError, match="not supported on cpu by SGLang with an MLA model"):
        ClusterSpec.from_dict({**apply(ClusterSpec.load("cpu").to_dict(), parse("like:deepseek-v3-p64-fp8")),
                               "common_args": ["--attention-backend", "intel_amx"]})
    gpu = ClusterSpec.from_dict(apply(ClusterSpec.load("gpu").to_dict(), fp8))
    assert gpu.layout == "like:llama-3.1-8b-p64-fp8" and gpu.kv_cache_dtype == "fp8_e4m3"
    argv = server_argv(gpu, "/m", "decode", 1)
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    plain = ClusterSpec.from_dict(apply(gpu.to_dict(), parse("mla-p64-bf16")))  # back to the model's dtype
    assert plain.kv_cache_dtype == "auto" and "--kv-cache-dtype" not in server_argv(plain, "/m", "decode", 1)


# ---------------------------------------------------------------- the pytest option

def _collect(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCHAOS_")}
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-m", "not slow", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return r, [x for x in r.stdout.splitlines() if "::" in x]


class _Config:
    """What kvchaos.plugin.options reads of a pytest config: options and the stash."""

    def __init__(self, **opts):
        self.opts, self.stash = opts, pytest.Stash()

    def getoption(self, name):
        return self.opts.get(name.lstrip("-").replace("-", "_"))


def test_probe_like_option_registers_the_config_and_selects_its_layout(tmp_path):
    from kvchaos.plugin import options

    cfg = tmp_path / "my-model.json"
    cfg.write_text(json.dumps({**_config("llama-3.1-8b"), "num_hidden_layers": 4}))
    profile = tmp_path / "paged.toml"
    profile.write_text((REPO / "kvchaos/profiles/cpu.toml").read_text().replace("page_size = 1", "page_size = 64"))
    before = os.environ.get(like.ENV)
    try:
        # the profile's page size, the config's dtype; named explicitly: every suite runs on it
        got = options.layouts(_Config(kvchaos_probe_like=str(cfg), kvchaos_profile=str(profile)))
        assert got == (["like:my-model-p64-bf16"], True)
        assert like.geometry("my-model").layers == 4 and str(cfg) in os.environ[like.ENV]  # children resolve it too
        got = options.layouts(_Config(kvchaos_probe_like=str(cfg), kvchaos_profile="cpu"))
        assert got == (["like:my-model-p1-bf16"], True)
    finally:
        like.unregister("my-model")
        if before is not None:
            os.environ[like.ENV] = before
    # a session started with the option runs its suites there; with --kvchaos-layouts the option only registers
    r, ids = _collect("suites/test_smoke.py", "--kvchaos-probe-like", str(cfg),
                      "--kvchaos-layouts", "mha-p1-fp32,like:my-model-p64-bf16")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert ids and {i.rsplit("[", 1)[1] for i in ids} == {"mha-p1-fp32]", "like:my-model-p64-bf16]"}, ids


@pytest.mark.parametrize("patch, args, msg", [
    ({"num_key_value_heads": 1}, [], "--kvchaos-probe-like: "),
    ({}, ["--kvchaos-model", "tiny:0"], "cannot be combined with --kvchaos-model"),
])
def test_bad_probe_like_options_stop_the_run_with_the_reason(patch, args, msg, tmp_path):
    cfg = tmp_path / "my-model.json"
    cfg.write_text(json.dumps({**_config("llama-3.1-8b"), **patch}))
    r, _ = _collect("suites/test_smoke.py", "--kvchaos-probe-like", str(cfg), *args)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and msg in out, out[-2000:]
    if patch:
        assert str(cfg) in out and "'num_key_value_heads'=1" in out, out[-2000:]
