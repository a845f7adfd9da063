"""Build the leak-sensitive probe model: a 2-layer LlamaForCausalLM whose weights are written by
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

A prompt built by :func:`kvchaos.probe.prompt` ends in ``[``, so the reply is
``[C1][C2]...[Ck][`` + EOS. Two canaries with the same first character collide (one of the two is
recited): canaries minted for one request have distinct first characters; a foreign canary
collides with a given own canary with probability 1/32.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from kvchaos.canary import ALPHABET, END, START
from kvchaos.model import build_char_tokenizer, char_vocab

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


def build_weights() -> dict[str, np.ndarray]:
    vocab = char_vocab(VOCAB)
    sym_of_id = {}
    for tok, i in vocab.items():
        sym_of_id[i] = tok if tok in T and tok != "<fill>" else "<fill>"
    eos_id = CONFIG["eos_token_id"]
    sq = np.sqrt(HEAD_DIM)  # cancels the attention's 1/sqrt(head_dim)
    w = {}

    emb = np.zeros((VOCAB, D_MODEL))
    emb[:, BIAS] = 1.0
    for i in range(VOCAB):
        emb[i, TOK + T[sym_of_id[i]]] = 1.0
    w["model.embed_tokens.weight"] = emb

    # ---- layer 1: offset heads
    q = np.zeros((N_HEADS * HEAD_DIM, D_MODEL))
    k = np.zeros_like(q)
    v = np.zeros_like(q)
    o = np.zeros((D_MODEL, N_HEADS * HEAD_DIM))
    om = _inv_freq()
    half = HEAD_DIM // 2
    for h, delta in enumerate(OFFSETS):
        base = h * HEAD_DIM
        for p in range(POS_PAIRS):
            q[base + p, BIAS] = S_OFFSET * np.cos(om[p] * delta) * sq
            q[base + half + p, BIAS] = -S_OFFSET * np.sin(om[p] * delta) * sq
            k[base + p, BIAS] = 1.0
        for t in range(NT):
            v[base + t, TOK + t] = 1.0
            o[P[delta] + t, base + t] = 1.0
    _layer(w, 0, q, k, v, o, norm=np.sqrt(2 / D_MODEL))

    # ---- layer 2: IND (head 0) and SEL (head 1)
    q = np.zeros((N_HEADS * HEAD_DIM, D_MODEL))
    k = np.zeros_like(q)
    v = np.zeros_like(q)
    o = np.zeros((D_MODEL, N_HEADS * HEAD_DIM))
    nope = _nope_dims()
    A = [T[c] for c in ALPHABET]
    AS = A + [T[START]]
    q1, q2, q3 = nope[0:32], nope[32:65], nope[65:98]
    for n, t in enumerate(A):  # current token (payload chars only)
        q[q1[n], TOK + t] = G_IND[0] * sq
        k[q1[n], P[1] + t] = 1.0
    for n, t in enumerate(AS):  # x_{i-1}, x_{i-2} (payload or "[")
        q[q2[n], P[1] + t] = G_IND[1] * sq
        k[q2[n], P[2] + t] = 1.0
        q[q3[n], P[2] + t] = G_IND[2] * sq
        k[q3[n], P[3] + t] = 1.0
    for t in A + [T[END]]:
        v[t, TOK + t] = 1.0
        o[NEXT + t, t] = 1.0
    # sink: at anything but a payload character, IND looks at filler (whose value is zero), so
    # partial bigram/trigram matches cannot leak a character into "[" or "]" positions
    sink = nope[98]
    for s in (START, END, "<fill>"):
        q[sink, TOK + T[s]] = Z_SINK * sq
    k[sink, TOK + T["<fill>"]] = 1.0

    base = HEAD_DIM
    u, order, neg = base + nope[0], [base + d for d in nope[1:33]], base + nope[33]
    q[u, TOK + T[START]] = G_SEL * sq
    k[u, P[1] + T[START]] = 1.0
    # a "[" is never a canary start, even where the offset heads have nothing before it (position 0)
    q[neg, BIAS] = -BETA * sq
    k[neg, TOK + T[START]] = 1.0
    for c, t in enumerate(A):
        q[order[c], BIAS] = -ALPHA * c * sq
        for vlast in range(c, 32):  # mask every c <= last recited first character
            q[order[c], P[11] + A[vlast]] = -BETA * sq
        k[order[c], TOK + t] = 1.0
        v[base + t, TOK + t] = 1.0
        o[NEXT + t, base + t] = 1.0
    _layer(w, 1, q, k, v, o, norm=np.sqrt(6 / D_MODEL))

    w["model.norm.weight"] = np.ones(D_MODEL)
    lm = np.zeros((VOCAB, D_MODEL))
    for s in list(ALPHABET) + [START, END]:
        lm[vocab[s], NEXT + T[s]] = G_OUT
    lm[vocab[START], TOK + T[END]] = B_CLOSE
    lm[eos_id, TOK + T[START]] = B_EOS
    lm[vocab[START], TOK + T["<fill>"]] = B_FILL
    w["lm_head.weight"] = lm
    return {name: a.astype(np.float32) for name, a in w.items()}


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


COMMITTED = Path(__file__).resolve().parent / "model"  # shipped with kvchaos; rebuilt bit-identically by build()


def build(dest: Path) -> Path:
    """Write the probe model (safetensors + config + tokenizer) to ``dest`` atomically."""
    from safetensors.numpy import save_file

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    os.chmod(tmp, 0o755)
    try:
        weights = build_weights()
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
               "rope_scaling": None, **CONFIG}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}, indent=2))
        # chat = the messages' contents concatenated, so /v1/chat/completions sees the probe prompt as is
        build_char_tokenizer(tmp, vocab_size=VOCAB, max_len=MAX_POS,
                             chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
        digest = hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()
        (tmp / "kvchaos-model.json").write_text(json.dumps(
            {"kind": "probe", "recipe": RECIPE, "weights_sha256": digest, "echoes_context": True,
             "canary_format": "[" + "base32x10" + "]", "order": "ascending first payload char"}, indent=2))
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


if __name__ == "__main__":
    import sys

    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else COMMITTED))
