"""Tiny models generated locally — no model hub is ever contacted.

``ensure_tiny_model(seed)`` writes a random LlamaForCausalLM (vocab 512, hidden 64, 2 layers,
4 heads, RoPE, 8192 positions) plus a character-level tokenizer into a cache directory and
returns its path. The same seed gives the same weights on the same torch version; the
directory name carries the seed and a digest of the recipe so a changed recipe never reuses
a stale cache entry.

Random weights do NOT repeat their context, so a canary oracle against this model cannot see a
leak: suites that use it must report ``unknown`` for isolation. It exists to prove the cluster
plumbing (token-identical PD vs single-server output) cheaply.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
import tempfile
from pathlib import Path

RECIPE_VERSION = 2
VOCAB_SIZE = 512
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
# Printable ASCII (letters, digits, punctuation, space) and newline: every character a prompt
# built by kvchaos can contain maps to exactly one token, so token counts equal char counts.
CHARSET = string.ascii_letters + string.digits + string.punctuation + " \n"

TINY_LLAMA = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=8192,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def cache_root() -> Path:
    return Path(os.environ.get("KVCHAOS_CACHE", Path.home() / ".cache" / "kvchaos"))


def _recipe_digest(seed: int) -> str:
    blob = json.dumps(
        {"v": RECIPE_VERSION, "seed": seed, "cfg": TINY_LLAMA, "chars": CHARSET}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def char_vocab(vocab_size: int = VOCAB_SIZE) -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in CHARSET:
        vocab.setdefault(ch, len(vocab))
    for i in range(len(vocab), vocab_size):  # unused slots keep vocab == model vocab
        vocab[f"<unused{i}>"] = i
    return vocab


def build_char_tokenizer(out_dir: Path, vocab_size: int = VOCAB_SIZE, max_len: int = 8192,
                         chat_template: str | None = None) -> None:
    """Save a char-level WordLevel tokenizer as a PreTrainedTokenizerFast in ``out_dir``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = char_vocab(vocab_size)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.add_bos_token = False
    fast.model_max_length = max_len
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))


def tiny_model_dir(seed: int = 0, root: Path | None = None) -> Path:
    """Where the tiny model for ``seed`` lives (pure path computation: no torch import)."""
    root = Path(root) if root else cache_root() / "models"
    return root / f"tiny-llama-s{seed}-{_recipe_digest(seed)}"


def is_complete(path: Path) -> bool:
    return (Path(path) / "config.json").exists() and (Path(path) / "kvchaos-model.json").exists()


def ensure_tiny_model(seed: int = 0, root: Path | None = None) -> Path:
    """Return the path of the tiny random Llama for ``seed``, generating it if missing.

    Needs torch + transformers (run it in the engine's interpreter: ``python -m kvchaos.model``).
    Generation is atomic (temp dir + rename), so concurrent pytest-xdist workers are safe.
    """
    dest = tiny_model_dir(seed, root)
    root = dest.parent
    if is_complete(dest):
        return dest
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=root))
    os.chmod(tmp, 0o755)
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        # initializer_range 0.5 (not 0.02): outputs then depend strongly on the whole context, so
        # a PD output that is token-identical to a single server's really required the right KV.
        cfg = LlamaConfig(**TINY_LLAMA, initializer_range=0.5, torch_dtype="float32")
        model = LlamaForCausalLM(cfg).eval()
        model.save_pretrained(str(tmp), safe_serialization=True)
        build_char_tokenizer(tmp)
        digest = hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()
        (tmp / "kvchaos-model.json").write_text(
            json.dumps({"kind": "tiny-random-llama", "seed": seed, "recipe": RECIPE_VERSION,
                        "weights_sha256": digest, "echoes_context": False}, indent=2)
        )
        try:
            os.rename(tmp, dest)
        except OSError:  # another worker won the race; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def model_info(path: Path) -> dict:
    meta = Path(path) / "kvchaos-model.json"
    return json.loads(meta.read_text()) if meta.exists() else {"kind": "external"}


if __name__ == "__main__":  # pragma: no cover - convenience
    import sys

    print(ensure_tiny_model(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
