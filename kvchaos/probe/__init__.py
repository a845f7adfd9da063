"""The leak-sensitive probe model and the prompts it answers (the circuit: ``kvchaos.probe.circuit``).

One probe per KV layout (:func:`ensure_probe`): ``mha`` (the committed LlamaForCausalLM, 4 KV heads),
``gqa`` (the same with 2 KV heads), ``mla`` (DeepseekV2ForCausalLM, ``kvchaos.probe.mla``) and
``like:<name>`` (a real model's KV-cache geometry, ``kvchaos.probe.like``). All recite the canaries in
their context the same way and share one tokenizer.
"""

from __future__ import annotations

import random
from pathlib import Path

from kvchaos import canary
from kvchaos.model import cache_root
from kvchaos.probe.kinds import COMMITTED, PROBE_KINDS, _check_kind, recipe_digest  # noqa: F401 (re-exported)

TRIGGER = canary.START  # a probe prompt ends in "[": the model then recites the canaries it sees
MIN_TAIL = 12  # filler characters between the last canary and the trigger (the δ=11 head must see filler)
MIN_HEAD = 12  # filler characters before the first canary (offset heads have no history there)


def prompt(rng: random.Random, n_tokens: int, canaries: list[str]) -> str:
    """A prompt of exactly ``n_tokens`` characters (= tokens for the char-level tokenizer): filler
    with ``canaries`` at random non-overlapping places (never adjacent, never in the first
    ``MIN_HEAD`` or last ``MIN_TAIL`` characters), ending in the trigger."""
    body = n_tokens - 1 - MIN_TAIL - MIN_HEAD
    need = sum(len(c) + 2 for c in canaries)
    if need > body:
        raise ValueError(f"{len(canaries)} canaries need more than {n_tokens} tokens (minimum {need + 1 + MIN_TAIL + MIN_HEAD})")
    free = body - need
    cuts = sorted(rng.randrange(free + 1) for _ in canaries)
    parts, prev = [canary.filler(rng, MIN_HEAD)], 0
    for c, cut in zip(canaries, cuts):
        parts.append(canary.filler(rng, cut - prev))
        parts.append(" " + c + " ")  # canaries never touch each other
        prev = cut
    parts.append(canary.filler(rng, free - prev))
    text = "".join(parts)
    text += canary.filler(rng, MIN_TAIL) + TRIGGER
    assert len(text) == n_tokens, (len(text), n_tokens)
    return text


FOREIGN_HEADROOM = 2  # canaries a reply has room for beyond its own


def max_new_tokens(n_canaries: int) -> int:
    """The reply budget of a request carrying ``n_canaries``: its own recital, room for
    :data:`FOREIGN_HEADROOM` foreign canaries, and the closing ``[``. The probe recites in order of
    first character, so a foreign canary can come after every own one: without the headroom a leak
    that sorts last would be cut off by the budget."""
    return (n_canaries + FOREIGN_HEADROOM) * canary.LENGTH + 2


def probe_dir(kind: str) -> Path:
    """Where ``ensure_probe(kind)`` keeps a built probe (pure path computation; a like kind reads its config)."""
    _check_kind(kind)
    if kind == "mha":
        return COMMITTED
    slug = kind.replace(":", "-")  # like:<name> -> probe-like-<name>-<digest>
    return cache_root() / "models" / f"probe-{slug}-{recipe_digest(kind)}"


def ensure_probe(kind: str = "mha") -> Path:
    """The probe model directory for ``kind``: "mha" is the committed model; "gqa", "mla" and
    "like:<name>" are built deterministically on first use (numpy + safetensors, atomic: temp dir +
    rename)."""
    dest = probe_dir(kind)
    if kind == "mha" or ((dest / "kvchaos-model.json").exists() and (dest / "model.safetensors").exists()):
        return dest
    from kvchaos.probe.build import build  # numpy and safetensors: only a build pays for them

    return build(dest, kind, replace=False)


def reaching(model_dir: str | Path, context: int) -> Path:
    """``model_dir`` (a built probe) if its positions reach ``context``; else a copy whose position limits
    do (``<cache>/models/<name>-ctx<context>``, written once): the same weights (linked),
    ``max_position_embeddings`` and the rope's ``original_max_position_embeddings`` raised — SGLang sizes
    its rotary cache from them, and with the probes' yarn factor 1 the frequencies do not change (the
    recital reads stale pages at any position: ``kvchaos.probe.circuit``) — and the tokenizer's
    ``model_max_length``. Its ``kvchaos-model.json`` keeps the weights' digest and names the source."""
    import json
    import shutil

    src = Path(model_dir)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("max_position_embeddings", 0) >= context:
        return src
    dest = cache_root() / "models" / f"{src.name}-ctx{context}"
    if (dest / "kvchaos-model.json").exists():
        return dest
    tmp = dest.with_name(f"{dest.name}.tmp{random.getrandbits(32):08x}")
    tmp.mkdir(parents=True)
    try:
        for f in src.iterdir():
            if f.is_file() and f.name not in ("config.json", "tokenizer_config.json", "kvchaos-model.json"):
                try:
                    (tmp / f.name).hardlink_to(f)
                except OSError:
                    shutil.copyfile(f, tmp / f.name)
        cfg["max_position_embeddings"] = context
        for key in ("rope_scaling", "rope_parameters"):
            if isinstance(cfg.get(key), dict) and "original_max_position_embeddings" in cfg[key]:
                cfg[key]["original_max_position_embeddings"] = context
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if (src / "tokenizer_config.json").exists():
            tc = json.loads((src / "tokenizer_config.json").read_text())
            tc["model_max_length"] = context
            (tmp / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
        meta = json.loads((src / "kvchaos-model.json").read_text())
        meta.update(long_context_of=str(src), max_position_embeddings=context)
        (tmp / "kvchaos-model.json").write_text(json.dumps(meta, indent=2))
        try:
            tmp.rename(dest)
        except OSError:  # another process wrote it meanwhile: theirs is identical
            if not (dest / "kvchaos-model.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
