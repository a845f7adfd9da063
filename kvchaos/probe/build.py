"""Write a probe model to disk: config, weights (:mod:`kvchaos.probe.circuit` for the Llama kinds,
:mod:`kvchaos.probe.mla` for MLA; either for a ``like:<name>`` kind, with its config's KV geometry from
:mod:`kvchaos.probe.like`), the character-level tokenizer and ``kvchaos-model.json``.

The construction is deterministic (no training, no randomness): rebuilding gives bit-identical
weights, checked by the sha256 in ``kvchaos-model.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from kvchaos.model import build_char_tokenizer
from kvchaos.probe import like, mla
from kvchaos.probe.circuit import MAX_POS, RECIPE, VOCAB, build_weights, config

# COMMITTED: the mha probe shipped with kvchaos, rebuilt bit-identically by build()
from kvchaos.probe.kinds import (  # noqa: F401 (PROBE_KINDS re-exported)
    COMMITTED,
    PROBE_KINDS,
    _check_kind,
    recipe_digest,
)

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _like(kind: str) -> like.Geometry | None:
    name = like.name_of_kind(kind)
    return None if name is None else like.geometry(name)


def hf_config(kind: str = "mha") -> dict:
    """config.json of a probe kind."""
    geo = _like(kind)
    if kind == "mla" or (geo is not None and geo.attention == "mla"):
        return mla.hf_config() if geo is None else mla.hf_config(geo.layers, geo.kv_lora_rank)
    cfg = config(kind) if geo is None else config(kv_heads=geo.kv_heads, q_heads=geo.probe_heads, n_layers=geo.layers)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
            "rope_scaling": None, **cfg}


def weights(kind: str = "mha") -> dict[str, np.ndarray]:
    geo = _like(kind)
    if geo is not None:
        if geo.attention == "mla":
            return mla.build_weights(geo.layers, geo.kv_lora_rank)
        return build_weights(kv_heads=geo.kv_heads, q_heads=geo.probe_heads, n_layers=geo.layers, fill_idle=True)
    if kind == "mla":
        return mla.build_weights()
    return build_weights(kind)


def metadata(kind: str, digest: str) -> dict:
    meta = {"kind": "probe", "recipe": RECIPE, "weights_sha256": digest, "echoes_context": True,
            "canary_format": "[" + "base32x10" + "]", "order": "ascending first payload char"}
    if kind != "mha":  # the committed model's metadata stays as shipped
        cfg = hf_config(kind)
        geo = _like(kind)
        attention = kind if geo is None else geo.attention
        meta.update({"probe_kind": kind, "recipe_digest": recipe_digest(kind), "attention": attention,
                     "architecture": cfg["architectures"][0],
                     "num_attention_heads": cfg["num_attention_heads"],
                     # MLA: one latent (kv_lora_rank + qk_rope_head_dim wide) per token, shared by every head
                     "kv_heads": 1 if attention == "mla" else cfg["num_key_value_heads"]})
        if geo is not None:  # what it is like: the source config's name and KV geometry
            src = like.config_path(geo.name).resolve()
            try:
                src = src.relative_to(COMMITTED.parent.parent.parent)  # a committed one: repository-relative
            except ValueError:
                pass
            meta["like"] = {"name": geo.name, "config": str(src), "geometry": geo.to_dict(),
                            "kv_bytes_per_token": {d: geo.bytes_per_token(d) for d in ("bfloat16", "float32")}}
    return meta


def build(dest: Path, kind: str = "mha", replace: bool = True) -> Path:
    """Write the probe model of ``kind`` (safetensors + config + tokenizer) to ``dest`` atomically.
    ``replace=False``: if ``dest`` appears meanwhile (another process built it), keep that one."""
    _check_kind(kind)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    os.chmod(tmp, 0o755)
    try:
        save_file(weights(kind), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(kind), indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}, indent=2))
        if kind == "mha":
            # chat = the messages' contents concatenated, so /v1/chat/completions sees the probe prompt as is
            build_char_tokenizer(tmp, vocab_size=VOCAB, max_len=MAX_POS, chat_template=CHAT_TEMPLATE)
        else:  # the same tokenizer as the committed probe (no transformers import needed)
            for name in TOKENIZER_FILES:
                shutil.copyfile(COMMITTED / name, tmp / name)
        digest = hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()
        (tmp / "kvchaos-model.json").write_text(json.dumps(metadata(kind, digest), indent=2))
        if dest.exists() and replace:
            shutil.rmtree(dest)
        try:
            os.rename(tmp, dest)
        except OSError:
            if replace or not (dest / "kvchaos-model.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race; theirs is identical
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


if __name__ == "__main__":
    # python -m kvchaos.probe.build [DEST [KIND]]   (KIND: mha | gqa | mla | like:<name>)
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else COMMITTED, *sys.argv[2:3]))
