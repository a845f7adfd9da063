"""The probe model: shipped, reproducible, recites canaries — and the sensitivity check can fail."""

import hashlib
import json
import random
import shutil

import pytest

from kvchaos import canary, cpucompat
from kvchaos.probe import PROBE_KINDS, ensure_probe, max_new_tokens, probe_dir, prompt
from kvchaos.probe.build import COMMITTED, build
from kvchaos.probe.measure import Rate, measure_contamination, measure_echo, sensitive_enough

cpucompat.install()  # transformers imports torchvision, which needs the CPU patch here


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_committed_probe_is_small_and_rebuilds_bit_identical(tmp_path):
    meta = json.loads((COMMITTED / "kvchaos-model.json").read_text())
    assert _sha(COMMITTED / "model.safetensors") == meta["weights_sha256"]
    assert sum(f.stat().st_size for f in COMMITTED.iterdir()) < 5 * 2**20
    rebuilt = build(tmp_path / "probe")
    assert _sha(rebuilt / "model.safetensors") == meta["weights_sha256"]
    assert (rebuilt / "tokenizer.json").read_text() == (COMMITTED / "tokenizer.json").read_text()
    cfg = json.loads((COMMITTED / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["rope_theta"] == 1e36


def _hf_rates(model_dir, n=16, seed=0, dtype="float32", lengths=(80, 400, 3686), forced_from=None):
    """Greedy in transformers (any architecture): own canaries (1-3) in a prompt of each length in
    turn, and a foreign canary in another tenant's text spliced in before the prompt.

    ``forced_from``: prompts of at least that many tokens are decoded by teacher forcing instead of
    ``generate`` — one forward pass over prompt + expected recital, the reply being the expected
    tokens up to and including the first one greedy would not have picked. That is the greedy reply
    up to its first divergence from the expected recital (transformers' DeepseekV2 re-expands the
    whole latent cache at every decode step, ≈0.5 s a token at 3,700 tokens on a busy 2-core box)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    rng = random.Random(seed)
    echo, cont = Rate("echo"), Rate("contamination")

    def greedy(t, recited, max_new):
        ids = tok(t, return_tensors="pt").input_ids
        if forced_from is None or ids.shape[1] < forced_from:
            out = m.generate(ids, max_new_tokens=max_new, do_sample=False)
            return tok.decode(out[0, ids.shape[1]:])
        order = sorted(recited, key=lambda c: canary.ALPHABET.index(c[1]))
        want = tok("".join(order)[1:] + canary.START, return_tensors="pt").input_ids[0]
        want = torch.cat([want, torch.tensor([m.config.eos_token_id])])
        with torch.no_grad():
            picked = m(torch.cat([ids[0], want[:-1]])[None]).logits[0, ids.shape[1] - 1:].argmax(-1)
        wrong = (picked != want).nonzero()
        upto = int(wrong[0]) + 1 if len(wrong) else len(want)
        return tok.decode(picked[:upto])

    for i in range(n):
        own = canary.mint(rng, rng.randint(1, 3))
        text = prompt(rng, lengths[i % len(lengths)], own)
        foreign = canary.mint(rng, 1, avoid_first=[c[1] for c in own])[0]
        f_text = prompt(rng, 80, [foreign])[:-1]
        for r, t, want, recited in ((echo, text, own, own), (cont, f_text + " " + text, [foreign], own + [foreign])):
            reply = greedy(t, recited, max_new_tokens(len(own) + 1))
            r.add(all(canary.payload(c) in reply for c in want), reply)
    return echo, cont


def test_probe_recites_own_and_foreign_canaries_in_transformers():
    echo, cont = _hf_rates(COMMITTED)
    assert echo.rate == 1.0, echo.failures
    assert cont.rate == 1.0, cont.failures
    assert sensitive_enough(echo, cont) == (True, "sensitive")


def test_sensitivity_check_fails_for_the_random_tiny_model():
    from kvchaos.model import ensure_tiny_model

    echo, cont = _hf_rates(ensure_tiny_model(0), n=6)
    ok, why = sensitive_enough(echo, cont)
    assert not ok and "own-canary echo" in why and "foreign-canary sensitivity" in why


# ---- probes per KV layout: gqa (LlamaForCausalLM, 2 KV heads) and mla (DeepseekV2ForCausalLM)

@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    root = tmp_path_factory.mktemp("probes")
    return {kind: build(root / kind, kind) for kind in ("gqa", "mla")}


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_probe_kind_rebuilds_bit_identical(kind, probes, tmp_path):
    again = build(tmp_path / kind, kind)
    assert _sha(again / "model.safetensors") == _sha(probes[kind] / "model.safetensors")
    meta = json.loads((again / "kvchaos-model.json").read_text())
    assert meta["weights_sha256"] == _sha(again / "model.safetensors")
    assert (meta["kind"], meta["probe_kind"], meta["attention"], meta["echoes_context"]) == ("probe", kind, kind, True)
    cfg = json.loads((again / "config.json").read_text())
    if kind == "gqa":
        assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == meta["kv_heads"] == 2
    else:
        assert cfg["architectures"] == ["DeepseekV2ForCausalLM"] and meta["kv_heads"] == 1
        assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"],
                cfg["q_lora_rank"]) == (512, 64, 128, 128, None)
        assert cfg["first_k_dense_replace"] == cfg["num_hidden_layers"] and not cfg["tie_word_embeddings"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (again / name).read_bytes() == (COMMITTED / name).read_bytes()


def test_ensure_probe_builds_once_per_recipe(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAOS_CACHE", str(tmp_path))
    assert PROBE_KINDS == ("mha", "gqa", "mla")
    assert ensure_probe("mha") == COMMITTED
    gqa = ensure_probe("gqa")
    assert gqa == probe_dir("gqa") and gqa.parent == tmp_path / "models" and gqa.name.startswith("probe-gqa-")
    stamp = (gqa / "model.safetensors").stat().st_mtime_ns
    assert ensure_probe("gqa") == gqa and (gqa / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [gqa.name]  # no temp dir left
    with pytest.raises(ValueError, match="'gpa'.*mha, gqa, mla"):
        ensure_probe("gpa")


def test_mla_probe_geometry_in_transformers(probes):
    """yarn with factor 1: transformers keeps the Llama probe's frequencies on pairs 0..7, no
    attention scaling, softmax scale 1/sqrt(192); kv_a_layernorm makes the latent exact one-hots."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from kvchaos.probe import circuit as llama, mla

    m = AutoModelForCausalLM.from_pretrained(probes["mla"], dtype=torch.float32).eval()
    assert type(m).__name__ == "DeepseekV2ForCausalLM"
    rot = m.model.rotary_emb
    assert rot.attention_scaling == 1.0
    assert np.allclose(rot.inv_freq.numpy()[:llama.POS_PAIRS], llama._inv_freq()[:llama.POS_PAIRS], rtol=1e-6)
    assert np.allclose(mla.inv_freq(), llama._inv_freq()[:32])
    for layer in m.model.layers:
        assert layer.self_attn.scaling == pytest.approx(192 ** -0.5)
        assert type(layer.mlp).__name__ == "DeepseekV2MLP"
    ids = torch.arange(4, 100)[None]  # every latent one-hot entry must come out as 1 after the RMSNorm
    with torch.no_grad():
        h = m.model.embed_tokens(ids)
        a = m.model.layers[0].self_attn
        c = a.kv_a_layernorm(a.kv_a_proj_with_mqa(m.model.layers[0].input_layernorm(h))[..., :512])
    assert torch.allclose(c.max(-1).values, torch.ones(1), atol=1e-3) and (c > 0.5).sum(-1).eq(1).all()


@pytest.mark.parametrize("kind,dtype,n", [("gqa", "float32", 3), ("gqa", "bfloat16", 3),
                                          ("mla", "float32", 3), ("mla", "bfloat16", 3)])
def test_probe_kind_recites_own_and_foreign_canaries_in_transformers(kind, dtype, n, probes):
    echo, cont = _hf_rates(probes[kind], n=n, seed=3, dtype=dtype, forced_from=1000 if kind == "mla" else None)
    assert echo.rate == 1.0, echo.failures
    assert cont.rate == 1.0, cont.failures
    assert sensitive_enough(echo, cont) == (True, "sensitive")


def test_sensitivity_check_fails_for_an_mla_probe_without_its_latent(probes, tmp_path):
    """The same DeepseekV2 with the KV latent zeroed (k_pe kept): nothing to copy, so nothing is recited."""
    from safetensors.numpy import load_file, save_file

    broken = tmp_path / "mla-no-latent"
    shutil.copytree(probes["mla"], broken)
    w = load_file(str(broken / "model.safetensors"))
    for i in (0, 1):
        w[f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"][:512] = 0.0
    save_file(w, str(broken / "model.safetensors"), metadata={"format": "pt"})
    echo, cont = _hf_rates(broken, n=4, lengths=(80, 400))
    ok, why = sensitive_enough(echo, cont)
    assert not ok and "own-canary echo" in why and "foreign-canary sensitivity" in why
    assert echo.rate == cont.rate == 0.0


@pytest.mark.cluster
def test_probe_through_the_pd_cluster(cluster):
    url = cluster.endpoints.router
    echo = measure_echo(url, 40, [32, 64, 256, 700, 1200], seed=10, registry=cluster.canaries)
    cont = measure_contamination(url, 40, [128, 512, 1200], seed=11, registry=cluster.canaries)
    assert echo.rate >= 0.99, echo.failures
    # every miss must be the documented first-character collision, and the rate above target
    assert all(f["first_char_collision"] for f in cont.failures), cont.failures
    assert cont.rate >= 0.95, cont.failures


@pytest.mark.slow  # CI time; the same check fails for the tiny model in transformers by default
@pytest.mark.cluster
def test_sensitivity_check_fails_for_the_tiny_model_through_sglang(kvchaos_spec, kvchaos_run_dir, kvchaos_reaper):
    from kvchaos.cluster import SingleServer

    tiny = SingleServer(kvchaos_spec.__class__.load("cpu", model="tiny:0"), kvchaos_run_dir / "tiny",
                        reaper=kvchaos_reaper).start()
    try:
        echo = measure_echo(tiny.url, 16, [64, 400], seed=12)
        cont = measure_contamination(tiny.url, 16, [128, 400], seed=13)
    finally:
        tiny.stop()
    ok, why = sensitive_enough(echo, cont)
    assert not ok, why
    assert echo.rate < 0.5 and cont.rate < 0.5


def test_a_probe_is_served_from_a_copy_whose_positions_reach_a_longer_context(tmp_path, monkeypatch):
    """The incident's million-token context on a probe built for 8192 positions: the launcher serves a
    copy with the same weights and only the position limits raised (SGLang sizes its rotary cache from
    them); a context the probe reaches uses the probe itself."""
    import json
    from pathlib import Path

    from kvchaos.cluster.argv import resolve_model
    from kvchaos.cluster.spec import ClusterSpec
    from kvchaos.probe import reaching

    monkeypatch.setenv("KVCHAOS_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "probe-mla-x"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"weights")
    (src / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, "hidden_size": 256,
                                                 "rope_scaling": {"original_max_position_embeddings": 8192,
                                                                  "factor": 1.0}}))
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8192}))
    (src / "kvchaos-model.json").write_text(json.dumps({"kind": "probe", "weights_sha256": "abc"}))
    assert reaching(src, 8192) == src
    d = reaching(src, 1_048_576)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["max_position_embeddings"] == cfg["rope_scaling"]["original_max_position_embeddings"] == 1_048_576
    assert cfg["rope_scaling"]["factor"] == 1.0 and cfg["hidden_size"] == 256
    assert json.loads((d / "tokenizer_config.json").read_text())["model_max_length"] == 1_048_576
    assert (d / "model.safetensors").read_bytes() == b"weights" and d.parent == tmp_path / "cache" / "models"
    meta = json.loads((d / "kvchaos-model.json").read_text())
    assert meta["weights_sha256"] == "abc" and meta["long_context_of"] == str(src)
    assert reaching(src, 1_048_576) == d and not list(d.parent.glob("*.tmp*"))  # written once, nothing left
    # the launcher: the committed probe at the profile's context is itself; at a million tokens, a copy
    spec = ClusterSpec(model="probe", context_length=4096, pool_tokens=2048)
    assert resolve_model(spec) == str(ensure_probe("mha"))
    long = resolve_model(ClusterSpec(model="probe", context_length=1_048_576, pool_tokens=2048))
    assert long != str(ensure_probe("mha")) and json.loads((Path(long) / "config.json").read_text())[
        "max_position_embeddings"] == 1_048_576
