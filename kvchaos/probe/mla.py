"""The MLA probe: the probe model's algorithm (``kvchaos.probe.build``) as a DeepseekV2ForCausalLM, so
that a leak check runs through an engine's multi-head latent attention path (SGLang: an
``MLATokenToKVPool`` holding one latent per token, absorbed MLA attention).

DeepSeek-V3 attention geometry: kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128,
v_head_dim 128, plain q_proj (q_lora_rank None); hidden 256, 2 dense layers (MLP weights zero),
``MLA_HEADS`` heads. The residual stream is the Llama probe's, dimension for dimension, so the
embedding and unembedding are the same matrices.

How attention is mapped (per layer, c = kv_a_layernorm(latent), 512 wide):

* Position lives only in the decoupled rope part. k_pe (the last 64 outputs of kv_a_proj_with_mqa,
  not normalised, shared by all heads) is the constant 1 from the BIAS dimension on the real part of
  rotary pairs 0..7; each offset head's q_pe carries its phases e^{-iω_p δ} there. DeepSeek rope
  rotates interleaved pairs (2p, 2p+1) — transformers' ``view_as_complex`` and SGLang's
  ``is_neox_style=False`` agree — and rope_theta 1e18 over 64 dims gives pair p the Llama probe's
  frequency 1e36^(-2p/128). Scores S·Σ_p cos(ω_p(Δ-δ)) exactly as in the Llama probe.
* Content lives in the nope parts: k_nope_h = W_kb^h·c and v_h = W_vb^h·c (kv_b_proj). The latent
  holds one-hots of the token's residual blocks — layer 1: TOK (one active entry); layer 2: TOK, P1,
  P2, P3 (four) — so the RMSNorm over 512 scales a token's latent by a constant, which
  kv_a_layernorm.weight = sqrt(active/512) undoes: c is the one-hots themselves. W_kb^h / W_vb^h are
  0/1 selections (each latent entry feeds at most one dimension of a head), so the absorbed
  q_nope·W_kc is exact in bf16 too.
* Like probes (``kvchaos.probe.like``): the same two layers at layer 0 and layer ``n_layers - 1`` with
  a ``kv_lora_rank`` latent; every layer between passes the residual through (:func:`_passthrough`).
* Rope scaling: yarn with factor 1 (SGLang's CPU rope factory only builds deepseek_yarn): the
  inverse frequencies are unchanged and both mscales are 1, so the softmax scale is
  1/sqrt(qk_nope + qk_rope) = 1/sqrt(192); queries carry sqrt(192) to cancel it.
"""

from __future__ import annotations

import numpy as np

from kvchaos.probe.circuit import (
    ALPHA,
    ALPHABET,
    BETA,
    BIAS,
    CONFIG,
    D_MODEL,
    END,
    G_SEL,
    MAX_POS,
    NEXT,
    NT,
    OFFSETS,
    POS_PAIRS,
    START,
    TOK,
    VOCAB,
    Z_SINK,
    P,
    T,
    embedding,
    ind_features,
    offset_phases,
    unembedding,
)

MLA_HEADS = 4
KV_LORA_RANK, QK_ROPE, QK_NOPE, V_HEAD = 512, 64, 128, 128
QK_HEAD = QK_NOPE + QK_ROPE
ROPE_THETA = 1e18  # 1e18^(-2p/64) == 1e36^(-2p/128): the Llama probe's frequencies on 32 pairs
INTERMEDIATE = 8

# latent layout (before kv_a_layernorm): one-hots copied from the residual's blocks
LAT = {TOK: 0, P[1]: NT, P[2]: 2 * NT, P[3]: 3 * NT}
assert 4 * NT <= KV_LORA_RANK

ROPE = {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": MAX_POS,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def hf_config(n_layers: int = 2, kv_lora_rank: int = KV_LORA_RANK) -> dict:
    """config.json of the MLA probe, or (``n_layers``, ``kv_lora_rank``) of an MLA like probe."""
    return {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "torch_dtype": "float32",
        "vocab_size": VOCAB, "hidden_size": D_MODEL, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": n_layers, "num_attention_heads": MLA_HEADS, "num_key_value_heads": MLA_HEADS,
        "kv_lora_rank": kv_lora_rank, "q_lora_rank": None, "qk_rope_head_dim": QK_ROPE,
        "qk_nope_head_dim": QK_NOPE, "v_head_dim": V_HEAD,
        # every layer dense: the experts exist in the config only
        "first_k_dense_replace": n_layers, "moe_layer_freq": 1, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "moe_intermediate_size": INTERMEDIATE, "n_group": 1, "topk_group": 1,
        "topk_method": "greedy", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "max_position_embeddings": MAX_POS, "rope_theta": ROPE_THETA,
        # transformers 5 reads rope_parameters, older readers rope_scaling; SGLang takes either
        "rope_parameters": {**ROPE, "rope_theta": ROPE_THETA}, "rope_scaling": dict(ROPE),
        "rms_norm_eps": CONFIG["rms_norm_eps"], "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "attention_bias": False, "hidden_act": "silu",
    }


def inv_freq() -> np.ndarray:
    return ROPE_THETA ** (-np.arange(0, QK_ROPE, 2, dtype=np.float64) / QK_ROPE)


def _lat(r: int) -> int:
    """Latent index of residual dimension r (a TOK/P1/P2/P3 one-hot entry)."""
    block = max(b for b in LAT if b <= r)
    assert r - block < NT
    return LAT[block] + r - block


def build_weights(n_layers: int = 2, kv_lora_rank: int = KV_LORA_RANK) -> dict[str, np.ndarray]:
    """The MLA probe's weights, or (``n_layers``, ``kv_lora_rank``) an MLA like probe's: the circuit in
    layer 0 and layer ``n_layers - 1``, :func:`_passthrough` layers between."""
    if n_layers < 2 or kv_lora_rank < 4 * NT:
        raise ValueError(f"{n_layers} layers, kv_lora_rank {kv_lora_rank}: the circuit needs 2 layers and a "
                         f"latent of >= {4 * NT} (four one-hots)")
    r, last = kv_lora_rank, n_layers - 1
    sq = np.sqrt(QK_HEAD)  # cancels the attention's 1/sqrt(qk_nope + qk_rope)
    A = [T[c] for c in ALPHABET]
    w = {"model.embed_tokens.weight": embedding()}

    # ---- layer 1: offset heads, position through the rope part only
    q, kva, kvb, o = _zeros(r)
    om = inv_freq()
    for t in range(NT):
        kva[LAT[TOK] + t, TOK + t] = 1.0
    for p in range(POS_PAIRS):
        kva[r + 2 * p, BIAS] = 1.0  # k_pe = 1 + 0i on pairs 0..7
    for h, delta in enumerate(OFFSETS):
        qpe = h * QK_HEAD + QK_NOPE
        for p, (re, im) in enumerate(offset_phases(om, delta, sq)):
            q[qpe + 2 * p, BIAS] = re
            q[qpe + 2 * p + 1, BIAS] = im
        for t in range(NT):
            kvb[h * (QK_NOPE + V_HEAD) + QK_NOPE + t, LAT[TOK] + t] = 1.0
            o[P[delta] + t, h * V_HEAD + t] = 1.0
    _layer(w, 0, q, kva, kvb, o, norm=np.sqrt(2 / D_MODEL), active=1)
    for i in range(1, last):
        _passthrough(w, i, r)

    # ---- layer 2: IND (head 0) and SEL (head 1), content only (q_pe = 0)
    q, kva, kvb, o = _zeros(r)
    for block in LAT:
        for t in range(NT):
            kva[_lat(block + t), block + t] = 1.0
    k0, v0 = 0, QK_NOPE  # head 0's key rows / value rows in kv_b_proj
    feats = ind_features()
    for d, (qs, ks, g) in enumerate(feats):
        q[d, qs] = g * sq
        kvb[k0 + d, _lat(ks)] = 1.0
    sink = len(feats)
    for s in (START, END, "<fill>"):
        q[sink, TOK + T[s]] = Z_SINK * sq
    kvb[k0 + sink, _lat(TOK + T["<fill>"])] = 1.0
    assert sink < QK_NOPE
    for t in A + [T[END]]:
        kvb[v0 + t, _lat(TOK + t)] = 1.0
        o[NEXT + t, t] = 1.0

    qb, k1, v1, ob = QK_HEAD, QK_NOPE + V_HEAD, 2 * QK_NOPE + V_HEAD, V_HEAD  # head 1
    u, order, neg = 0, list(range(1, 33)), 33
    q[qb + u, TOK + T[START]] = G_SEL * sq
    kvb[k1 + u, _lat(P[1] + T[START])] = 1.0
    q[qb + neg, BIAS] = -BETA * sq
    kvb[k1 + neg, _lat(TOK + T[START])] = 1.0
    for c, t in enumerate(A):
        q[qb + order[c], BIAS] = -ALPHA * c * sq
        for vlast in range(c, 32):
            q[qb + order[c], P[11] + A[vlast]] = -BETA * sq
        kvb[k1 + order[c], _lat(TOK + t)] = 1.0
        kvb[v1 + t, _lat(TOK + t)] = 1.0
        o[NEXT + t, ob + t] = 1.0
    _layer(w, last, q, kva, kvb, o, norm=np.sqrt(6 / D_MODEL), active=4)

    w["model.norm.weight"] = np.ones(D_MODEL)
    w["lm_head.weight"] = unembedding()
    return {name: a.astype(np.float32) for name, a in w.items()}


def _zeros(r: int = KV_LORA_RANK):
    H = MLA_HEADS
    return (np.zeros((H * QK_HEAD, D_MODEL)), np.zeros((r + QK_ROPE, D_MODEL)),
            np.zeros((H * (QK_NOPE + V_HEAD), r)), np.zeros((D_MODEL, H * V_HEAD)))


def _passthrough(w, i, r):
    """A layer between the circuit's two (like probes): o_proj and MLP zero, so the residual passes
    through unchanged. Its latent is the token one-hot (exact after kv_a_layernorm), its k_pe layer 0's
    constant, every head's q_nope, k_nope and value copy the token one-hot: the layer's KV pages hold
    the token, deterministically. Its input norm makes the residual's six one-hots unit entries."""
    q, kva, kvb, o = _zeros(r)
    for t in range(NT):
        kva[LAT[TOK] + t, TOK + t] = 1.0
    for p in range(POS_PAIRS):
        kva[r + 2 * p, BIAS] = 1.0
    for h in range(MLA_HEADS):
        for t in range(NT):
            q[h * QK_HEAD + t, TOK + t] = 1.0
            kvb[h * (QK_NOPE + V_HEAD) + t, LAT[TOK] + t] = 1.0
            kvb[h * (QK_NOPE + V_HEAD) + QK_NOPE + t, LAT[TOK] + t] = 1.0
    _layer(w, i, q, kva, kvb, o, norm=np.sqrt(6 / D_MODEL), active=1)


def _layer(w, i, q, kva, kvb, o, norm, active):
    pre = f"model.layers.{i}."
    r = kvb.shape[1]  # kv_lora_rank
    w[pre + "self_attn.q_proj.weight"] = q
    w[pre + "self_attn.kv_a_proj_with_mqa.weight"] = kva
    # `active` one-hot entries of 1 have RMS sqrt(active/r): scale them back to 1
    w[pre + "self_attn.kv_a_layernorm.weight"] = np.full(r, np.sqrt(active / r))
    w[pre + "self_attn.kv_b_proj.weight"] = kvb
    w[pre + "self_attn.o_proj.weight"] = o
    w[pre + "mlp.gate_proj.weight"] = np.zeros((INTERMEDIATE, D_MODEL))
    w[pre + "mlp.up_proj.weight"] = np.zeros((INTERMEDIATE, D_MODEL))
    w[pre + "mlp.down_proj.weight"] = np.zeros((D_MODEL, INTERMEDIATE))
    w[pre + "input_layernorm.weight"] = np.full(D_MODEL, norm)
    w[pre + "post_attention_layernorm.weight"] = np.ones(D_MODEL)
