"""The leak-sensitive probe model's circuit: a 2-layer LlamaForCausalLM whose weights are written by
hand so that, greedy, it recites every canary (``kvchaos.canary``) it can attend to.

Standard architecture (LlamaForCausalLM, RoPE, RMSNorm, SwiGLU MLP set to zero), loaded as-is by
transformers and SGLang, with a character-level tokenizer saved beside it. The construction is
deterministic (no training, no randomness): rebuilding gives bit-identical weights, checked by the
sha256 in ``kvchaos-model.json``.

How it works (d_model 256, 4 heads of dim 128, rope_theta 1e36):

* rope_theta 1e36 makes rotary pairs 13..63 rotate by < 1e-3 rad over 8192 positions: those
  dimensions are position-free, so content matching works for KV read at any position, including
  stale pages read at positions other than the ones they were written at. Pairs 0..7 carry
  position.
* Layer 1 — four fixed-offset heads (δ = 1, 2, 3, 11). Each attends to exactly the token δ back
  (score S·Σ_p cos(ω_p(Δ-δ)), margin 0.5·S against every other offset up to 8192) and writes its
  identity into the residual: P1, P2, P3, P11.
* Layer 2, head IND (trigram induction): at a payload character x_i it attends to the position j
  whose three predecessors equal (x_{i-2}, x_{i-1}, x_i) — weights 40/20/20, so a full trigram
  match beats any bigram match by 20 — and emits token j. This copies a canary to its ``]``.
* ``]`` → ``[`` is a bigram in the unembedding.
* Layer 2, head SEL (selection): at ``[`` it attends to canary starts (positions preceded by ``[``)
  and picks the smallest first character greater than the first character of the canary it just
  recited (read by the δ=11 head): score 300 − 6·c − 400·[c ≤ last]. So canaries come out in
  ascending order of first character, each once. When none is left, attention falls on filler,
  the head's output vanishes and the ``[`` → EOS bigram ends the reply.

Kinds (one per KV layout; :func:`kvchaos.probe.ensure_probe`): ``mha`` — this model, committed in
``model/``; ``gqa`` — the same weights regrouped for 2 key/value heads (layer 1's offset heads all
have the same key and value, so both KV heads carry them; layer 2 puts IND on query head 0 → KV head
0 and SEL on query head 2 → KV head 1); ``mla`` — the same algorithm in DeepseekV2ForCausalLM
(``kvchaos.probe.mla``); ``like:<name>`` — a real model's KV geometry (``kvchaos.probe.like``): the same
circuit in layer 0 and the last layer of ``n_layers``, ``kv_heads`` KV heads for ``q_heads`` query heads
(:func:`build_weights`), every layer between passing the residual through (:func:`_passthrough`).

A prompt built by :func:`kvchaos.probe.prompt` ends in ``[``, so the reply is
``[C1][C2]...[Ck][`` + EOS. Two canaries with the same first character collide (one of the two is
recited): canaries minted for one request have distinct first characters; a foreign canary
collides with a given own canary with probability 1/32.
"""

from __future__ import annotations

import numpy as np

from kvchaos.canary import ALPHABET, END, START
from kvchaos.model import char_vocab

RECIPE = 1
D_MODEL, N_HEADS, HEAD_DIM = 256, 4, 128
VOCAB = 128
ROPE_THETA = 1e36
MAX_POS = 8192
NOPE_FROM = 13  # rotary pairs >= this are position-free (< 1e-3 rad over MAX_POS)
POS_PAIRS = 8   # rotary pairs used by the offset heads
OFFSETS = (1, 2, 3, 11)
S_OFFSET = 80.0
G_IND = (40.0, 20.0, 20.0)
G_SEL, ALPHA, BETA = 300.0, 6.0, 400.0
Z_SINK = 100.0
G_OUT, B_CLOSE, B_EOS, B_FILL = 10.0, 10.0, 3.0, 3.0

# residual layout
TOKSET = list(ALPHABET) + [START, END, "<fill>"]  # 35 symbols; every token is exactly one of them
T = {s: i for i, s in enumerate(TOKSET)}
NT = len(TOKSET)
BIAS = 0
TOK = 1
P = {1: TOK + NT, 2: TOK + 2 * NT, 3: TOK + 3 * NT, 11: TOK + 4 * NT}
NEXT = TOK + 5 * NT  # 35 dims: A (32), "[", "]", EOS
NEXT_EOS = T["<fill>"]  # reuse the 35th slot of NEXT for EOS
assert NEXT + NT <= D_MODEL

KV_HEADS = {"mha": N_HEADS, "gqa": 2}  # Llama kinds: key/value heads (GQA: q heads 0,1 -> kv 0; 2,3 -> kv 1)

CONFIG = dict(
    vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=8, num_hidden_layers=2,
    num_attention_heads=N_HEADS, num_key_value_heads=N_HEADS, head_dim=HEAD_DIM,
    max_position_embeddings=MAX_POS, rope_theta=ROPE_THETA, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    attention_bias=False, mlp_bias=False, hidden_act="silu",
)


def _inv_freq() -> np.ndarray:
    return ROPE_THETA ** (-np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)


def _nope_dims() -> list[int]:
    half = HEAD_DIM // 2
    return list(range(NOPE_FROM, half)) + list(range(half + NOPE_FROM, HEAD_DIM))


def config(kind: str = "mha", *, kv_heads: int | None = None, q_heads: int = N_HEADS, n_layers: int = 2) -> dict:
    """The Llama config of a Llama-architecture probe kind ("mha" or "gqa"), or of a like probe's
    geometry (``kv_heads``, ``q_heads``, ``n_layers``; key order as CONFIG's)."""
    return {**CONFIG, "num_key_value_heads": KV_HEADS[kind] if kv_heads is None else kv_heads,
            "num_attention_heads": q_heads, "num_hidden_layers": n_layers}


def sym_of_id() -> dict[int, str]:
    """Token id -> residual symbol (every id is exactly one of TOKSET)."""
    return {i: tok if tok in T and tok != "<fill>" else "<fill>" for tok, i in char_vocab(VOCAB).items()}


def embedding() -> np.ndarray:
    emb = np.zeros((VOCAB, D_MODEL))
    emb[:, BIAS] = 1.0
    for i, s in sym_of_id().items():
        emb[i, TOK + T[s]] = 1.0
    return emb


def unembedding() -> np.ndarray:
    vocab = char_vocab(VOCAB)
    lm = np.zeros((VOCAB, D_MODEL))
    for s in list(ALPHABET) + [START, END]:
        lm[vocab[s], NEXT + T[s]] = G_OUT
    lm[vocab[START], TOK + T[END]] = B_CLOSE
    lm[CONFIG["eos_token_id"], TOK + T[START]] = B_EOS
    lm[vocab[START], TOK + T["<fill>"]] = B_FILL
    return lm


def offset_phases(om: np.ndarray, delta: int, sq: float) -> list[tuple[float, float]]:
    """Per rotary pair p < POS_PAIRS, the (real, imaginary) query part of the offset-δ head whose
    key is the constant 1 + 0i: score S_OFFSET·Σ_p cos(ω_p(Δ - δ)) at distance Δ (times ``sq``,
    which cancels the attention's softmax scale)."""
    return [(S_OFFSET * np.cos(om[p] * delta) * sq, -S_OFFSET * np.sin(om[p] * delta) * sq)
            for p in range(POS_PAIRS)]


def ind_features():
    """Layer 2 IND head, one entry per content feature: (query residual dim, key residual dim,
    weight) — the query's (x_i, x_{i-1}, x_{i-2}) against the key's (x_{j-1}, x_{j-2}, x_{j-3})."""
    A = [T[c] for c in ALPHABET]
    AS = A + [T[START]]
    f = [(TOK + t, P[1] + t, G_IND[0]) for t in A]  # current token (payload chars only)
    f += [(P[1] + t, P[2] + t, G_IND[1]) for t in AS]  # x_{i-1} (payload or "[")
    f += [(P[2] + t, P[3] + t, G_IND[2]) for t in AS]  # x_{i-2}
    return f


def check_heads(kv_heads: int, q_heads: int, n_layers: int) -> None:
    """What the circuit needs of a head and layer layout (ValueError naming it)."""
    if kv_heads < 2 or q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads on {kv_heads} KV heads: the circuit needs >= 2 KV heads "
                         "(IND and SEL read different keys) and whole groups of query heads")
    if q_heads < len(OFFSETS):
        raise ValueError(f"{q_heads} query heads: layer 0 needs {len(OFFSETS)} offset heads")
    if n_layers < 2:
        raise ValueError(f"{n_layers} layers: the circuit sits in layer 0 and the last layer")


def build_weights(kind: str = "mha", *, kv_heads: int | None = None, q_heads: int = N_HEADS,
                  n_layers: int = 2, fill_idle: bool = False) -> dict[str, np.ndarray]:
    """The weights of a Llama-architecture kind, or (``kv_heads``, ``q_heads``, ``n_layers``) of a like
    probe: the circuit in layer 0 and layer ``n_layers - 1``, :func:`_passthrough` layers between.
    ``fill_idle`` (like probes): KV heads the circuit leaves unused carry copies of the token one-hot
    instead of zeros (their query heads are zero; the hand-written kinds keep their zeros)."""
    kv_heads = KV_HEADS[kind] if kv_heads is None else kv_heads
    check_heads(kv_heads, q_heads, n_layers)
    group = q_heads // kv_heads  # query heads per key/value head
    last = n_layers - 1
    sq = np.sqrt(HEAD_DIM)  # cancels the attention's 1/sqrt(head_dim)
    w = {}
    w["model.embed_tokens.weight"] = embedding()

    # ---- layer 1: offset heads; every head's key (BIAS on the rotary pairs) and value (TOK) are
    # the same, so with fewer key/value heads each carries that same key and value
    q = np.zeros((q_heads * HEAD_DIM, D_MODEL))
    k = np.zeros((kv_heads * HEAD_DIM, D_MODEL))
    v = np.zeros_like(k)
    o = np.zeros((D_MODEL, q_heads * HEAD_DIM))
    om = _inv_freq()
    half = HEAD_DIM // 2
    for h, delta in enumerate(OFFSETS):
        base, kbase = h * HEAD_DIM, (h // group) * HEAD_DIM
        for p, (re, im) in enumerate(offset_phases(om, delta, sq)):
            q[base + p, BIAS] = re
            q[base + half + p, BIAS] = im
            k[kbase + p, BIAS] = 1.0
        for t in range(NT):
            v[kbase + t, TOK + t] = 1.0
            o[P[delta] + t, base + t] = 1.0
    if fill_idle:
        _fill_idle(k, v, {h // group for h in range(len(OFFSETS))})
    _layer(w, 0, q, k, v, o, norm=np.sqrt(2 / D_MODEL))
    for i in range(1, last):
        _passthrough(w, i, q_heads, kv_heads)

    # ---- layer 2: IND (query head 0, kv head 0) and SEL (the first query head of kv head 1)
    q = np.zeros((q_heads * HEAD_DIM, D_MODEL))
    k = np.zeros((kv_heads * HEAD_DIM, D_MODEL))
    v = np.zeros_like(k)
    o = np.zeros((D_MODEL, q_heads * HEAD_DIM))
    nope = _nope_dims()
    A = [T[c] for c in ALPHABET]
    for d, (qs, ks, g) in zip(nope, ind_features()):
        q[d, qs] = g * sq
        k[d, ks] = 1.0
    for t in A + [T[END]]:
        v[t, TOK + t] = 1.0
        o[NEXT + t, t] = 1.0
    # sink: at anything but a payload character, IND looks at filler (whose value is zero), so
    # partial bigram/trigram matches cannot leak a character into "[" or "]" positions
    sink = nope[98]
    for s in (START, END, "<fill>"):
        q[sink, TOK + T[s]] = Z_SINK * sq
    k[sink, TOK + T["<fill>"]] = 1.0

    qb, kb = group * HEAD_DIM, HEAD_DIM  # SEL: query head `group` reads kv head 1
    u, order, neg = nope[0], nope[1:33], nope[33]
    q[qb + u, TOK + T[START]] = G_SEL * sq
    k[kb + u, P[1] + T[START]] = 1.0
    # a "[" is never a canary start, even where the offset heads have nothing before it (position 0)
    q[qb + neg, BIAS] = -BETA * sq
    k[kb + neg, TOK + T[START]] = 1.0
    for c, t in enumerate(A):
        q[qb + order[c], BIAS] = -ALPHA * c * sq
        for vlast in range(c, 32):  # mask every c <= last recited first character
            q[qb + order[c], P[11] + A[vlast]] = -BETA * sq
        k[kb + order[c], TOK + t] = 1.0
        v[kb + t, TOK + t] = 1.0
        o[NEXT + t, qb + t] = 1.0
    if fill_idle:
        _fill_idle(k, v, {0, 1})
    _layer(w, last, q, k, v, o, norm=np.sqrt(6 / D_MODEL))

    w["model.norm.weight"] = np.ones(D_MODEL)
    w["lm_head.weight"] = unembedding()
    return {name: a.astype(np.float32) for name, a in w.items()}


def _fill_idle(k, v, used: set[int]) -> None:
    """KV heads no query head of the circuit reads: key and value copy the token one-hot (so their
    pages are not all zeros; their query heads are zero and their output columns too)."""
    for h in range(k.shape[0] // HEAD_DIM):
        if h not in used:
            for t in range(NT):
                k[h * HEAD_DIM + NOPE_FROM + t, TOK + t] = 1.0  # position-free dims, like the circuit's content
                v[h * HEAD_DIM + t, TOK + t] = 1.0


def _passthrough(w, i, q_heads, kv_heads):
    """A layer between the circuit's two (like probes): attention output and MLP zero, so the residual
    passes through unchanged; every head's query, key and value copy the token one-hot (the layer's KV
    pages hold the token, deterministically). Its input norm makes the residual's six one-hots (BIAS, TOK,
    P1, P2, P3, P11) unit entries."""
    q = np.zeros((q_heads * HEAD_DIM, D_MODEL))
    k = np.zeros((kv_heads * HEAD_DIM, D_MODEL))
    v = np.zeros_like(k)
    for h in range(q_heads):
        for t in range(NT):
            q[h * HEAD_DIM + NOPE_FROM + t, TOK + t] = 1.0
    _fill_idle(k, v, set())
    _layer(w, i, q, k, v, np.zeros((D_MODEL, q_heads * HEAD_DIM)), norm=np.sqrt(6 / D_MODEL))


def _layer(w, i, q, k, v, o, norm):
    pre = f"model.layers.{i}."
    w[pre + "self_attn.q_proj.weight"] = q
    w[pre + "self_attn.k_proj.weight"] = k
    w[pre + "self_attn.v_proj.weight"] = v
    w[pre + "self_attn.o_proj.weight"] = o
    inter = CONFIG["intermediate_size"]
    w[pre + "mlp.gate_proj.weight"] = np.zeros((inter, D_MODEL))
    w[pre + "mlp.up_proj.weight"] = np.zeros((inter, D_MODEL))
    w[pre + "mlp.down_proj.weight"] = np.zeros((D_MODEL, inter))
    w[pre + "input_layernorm.weight"] = np.full(D_MODEL, norm)
    w[pre + "post_attention_layernorm.weight"] = np.ones(D_MODEL)
