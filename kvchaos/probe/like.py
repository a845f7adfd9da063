"""``like:`` probes: the probe model's recital with a real model's KV-cache geometry.

A like probe is named after a model config (a Hugging Face ``config.json``; geometry only, never
weights): ``like/<name>.json`` beside this module (``llama-3.1-8b``, ``deepseek-v3``) or one registered
by path (:func:`register`: the pytest option ``--kvchaos-probe-like PATH`` or ``KVCHAOS_PROBE_LIKE``).
From the config this module derives the KV geometry the way SGLang 0.5.23 does
(``sglang/srt/configs/model_config.py``, ``_derive_model_shapes`` / ``get_total_num_kv_heads``, and
``model_executor/pool_configurator.py``'s per-token cell size):

* grouped-query attention (``MHATokenToKVPool``): ``num_hidden_layers`` layers, ``num_key_value_heads``
  KV heads (absent: ``num_attention_heads``), ``head_dim`` (absent: ``hidden_size // num_attention_heads``),
  K and V per token and layer: ``2 · kv_heads · head_dim`` elements;
* multi-head latent attention (``MLATokenToKVPool``, the DeepSeek-V2/V3 family): one latent per token and
  layer, ``kv_lora_rank + qk_rope_head_dim`` elements shared by every head;
* the dtype ``--dtype auto`` serves: the config's ``dtype`` / ``torch_dtype`` (float32 or absent: float16).

The probe built from it (:mod:`kvchaos.probe.build`) has exactly that geometry — the same layer count, KV
heads and head dim, or the same latent and rope widths — with hidden size 256: the recital circuit
(:mod:`kvchaos.probe.circuit`, :mod:`kvchaos.probe.mla`) sits in layer 0 and the last layer, every layer
between passes the residual through (attention output and MLP zero, its q/k/v copies of the token
one-hot, so its KV pages are not all zeros). Query heads are the probe's own (the KV pool does not depend
on them): GQA — ``kv_heads · ceil(4 / kv_heads)`` (Llama-3.1-8B: 8 query heads on its 8 KV heads; IND reads
KV head 0, SEL KV head 1); MLA — 4 heads, as the ``mla`` probe. The architecture is the probe's too:
``LlamaForCausalLM`` for a GQA source, ``DeepseekV2ForCausalLM`` for an MLA source (SGLang's
``DeepseekV3ForCausalLM`` is a subclass of it and takes the same MLA pool and attention path).

This module reads JSON only (no numpy): layouts and specs name like probes without building one.
``python -m kvchaos.probe.like NAME|PATH [--page 64] [--tokens 512]`` prints a geometry and its KV bytes.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

LIKE_DIR = Path(__file__).resolve().parent / "like"
ENV = "KVCHAOS_PROBE_LIKE"  # config paths (os.pathsep-separated) registered for this process and its children
PREFIX = "like:"
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")

# SGLang 0.5.23 (configs/model_config.py): these take the MLA branch of _derive_model_shapes (AttentionArch.MLA,
# MLATokenToKVPool); the GQA ones the default branch (MHATokenToKVPool, no sliding-window or hybrid pool).
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")
GQA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
                     "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

# What the recital circuit needs (kvchaos.probe.circuit / kvchaos.probe.mla; tests/test_probe_like.py checks
# these against the builders' constants, which this module cannot import without numpy).
CIRCUIT_HEAD_DIM = 128  # GQA: rope pairs 0..7 carry position, pairs 13..63 are position-free at rope_theta 1e36
MIN_KV_HEADS = 2  # GQA: IND and SEL read different keys, so they sit on two KV heads
OFFSET_HEADS = 4  # layer 0's offset heads (δ = 1, 2, 3, 11): query heads the probe needs at least
MIN_KV_LORA_RANK = 4 * 35  # MLA: the latent holds four 35-wide one-hots (TOK, P1, P2, P3)
MLA_ROPE_HEAD_DIM = 64  # MLA: rope_theta 1e18 over 64 dims gives the Llama probe's position frequencies
MLA_PROBE_HEADS = 4

# SGLang's _STR_DTYPE_TO_TORCH_DTYPE
DTYPE_NAMES = {"half": "float16", "float16": "float16", "float": "float32", "float32": "float32", "bfloat16": "bfloat16"}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1}


class LikeError(ValueError):
    """A like config that cannot be read or has no geometry the probe can take: names the file and field."""


@dataclass(frozen=True)
class Geometry:
    """The KV-cache geometry of a model config, as SGLang derives it (tensor parallel size 1)."""

    name: str
    architecture: str
    attention: str  # "gqa" (MHATokenToKVPool: K and V per KV head) | "mla" (MLATokenToKVPool: one latent)
    layers: int  # KV layers: num_hidden_layers
    kv_heads: int  # per token and layer (MLA: 1, the latent every head shares)
    head_dim: int | None  # GQA: K (and V) head dim
    kv_lora_rank: int | None  # MLA: latent width
    qk_rope_head_dim: int | None  # MLA: decoupled rope key width (stored beside the latent)
    dtype: str  # what SGLang's --dtype auto serves: bfloat16 | float16 | float32
    num_attention_heads: int  # the source's query heads (the probe's are its own: probe_heads)

    @property
    def kind(self) -> str:
        return PREFIX + self.name

    @property
    def elements_per_token_layer(self) -> int:
        """KV elements one token keeps in one layer."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.kv_heads * self.head_dim

    def bytes_per_token(self, dtype: str | None = None) -> int:
        """KV bytes of one token over every layer, stored as ``dtype`` (default: :attr:`dtype`)."""
        return self.layers * self.elements_per_token_layer * _itemsize(dtype or self.dtype)

    def bytes_per_page(self, page_size: int, dtype: str | None = None) -> int:
        """Bytes of one KV page over every layer: what a PD transfer moves per page."""
        return page_size * self.bytes_per_token(dtype)

    def request_bytes(self, tokens: int, page_size: int, dtype: str | None = None) -> int:
        """Bytes a request of ``tokens`` prompt tokens transfers: its whole pages."""
        return math.ceil(tokens / page_size) * self.bytes_per_page(page_size, dtype)

    @property
    def probe_heads(self) -> int:
        """Query heads of the probe built with this geometry."""
        if self.attention == "mla":
            return MLA_PROBE_HEADS
        return self.kv_heads * math.ceil(OFFSET_HEADS / self.kv_heads)

    def to_dict(self) -> dict:
        return asdict(self)


def _itemsize(dtype: str) -> int:
    d = DTYPE_NAMES.get(dtype, dtype)
    if d not in ITEMSIZE:
        raise LikeError(f"KV dtype {dtype!r}: one of {sorted(ITEMSIZE)}")
    return ITEMSIZE[d]


# --------------------------------------------------------------------------- reading a config
def name_of_path(path: str | os.PathLike) -> str:
    """The name a config file registers under: its stem, lower-cased."""
    p = Path(path)
    name = p.stem.lower()
    if p.suffix != ".json" or not NAME.match(name):
        raise LikeError(f"{p}: a like config is a .json file whose name is letters, digits, '.', '-' or '_' "
                        f"(it names the layout like:<name>-p<page>-<dtype>): rename it, e.g. my-model.json")
    return name


def _field(cfg: dict, field: str, where: str, why: str, minimum: int = 1) -> int:
    v = cfg.get(field)
    if v is None:
        raise LikeError(f"{where}: field {field!r} is missing ({why})")
    if isinstance(v, bool) or not isinstance(v, int):
        raise LikeError(f"{where}: field {field!r}={v!r} must be an integer ({why})")
    if v < minimum:
        raise LikeError(f"{where}: field {field!r}={v} must be >= {minimum} ({why})")
    return v


def _dtype(cfg: dict, where: str) -> str:
    """SGLang's _get_and_verify_dtype with --dtype auto: the config's dtype, float32 or none served as float16."""
    field = "dtype" if cfg.get("dtype") is not None else "torch_dtype"
    raw = cfg.get(field)
    if raw is None:
        return "float16"
    if not isinstance(raw, str) or raw not in DTYPE_NAMES:
        raise LikeError(f"{where}: field {field!r}={raw!r} is not a dtype SGLang serves ({sorted(DTYPE_NAMES)})")
    d = DTYPE_NAMES[raw]
    return "float16" if d == "float32" else d


def geometry_of(cfg: dict, name: str, where: str) -> Geometry:
    """The geometry of config ``cfg`` (read from ``where``), checked against what the probe can take."""
    if not isinstance(cfg, dict):
        raise LikeError(f"{where}: a config.json is a JSON object, not {type(cfg).__name__}")
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise LikeError(f"{where}: field 'architectures' is missing or empty (SGLang picks the model and its "
                        f"KV pool by it; one of {GQA_ARCHITECTURES + MLA_ARCHITECTURES})")
    arch = archs[0]
    if arch not in GQA_ARCHITECTURES + MLA_ARCHITECTURES:
        raise LikeError(f"{where}: field 'architectures' names {arch!r}: like probes take grouped-query "
                        f"attention models {GQA_ARCHITECTURES} and multi-head latent attention models "
                        f"{MLA_ARCHITECTURES} (their KV pool is SGLang's plain MHA or MLA pool)")
    layers = _field(cfg, "num_hidden_layers", where, "the recital circuit sits in layer 0 and the last layer",
                    minimum=2)
    heads = _field(cfg, "num_attention_heads", where, "SGLang derives the head geometry from it")
    dtype = _dtype(cfg, where)
    if arch in MLA_ARCHITECTURES:
        if cfg.get("kv_lora_rank") is None:
            raise LikeError(f"{where}: {arch} is multi-head latent attention but field 'kv_lora_rank' is missing "
                            "(the latent width SGLang's MLATokenToKVPool stores per token and layer)")
        rank = _field(cfg, "kv_lora_rank", where, "the latent width", minimum=MIN_KV_LORA_RANK)
        rope = _field(cfg, "qk_rope_head_dim", where, "the decoupled rope key stored beside the latent")
        if rope != MLA_ROPE_HEAD_DIM:
            raise LikeError(f"{where}: field 'qk_rope_head_dim'={rope}: the MLA recital circuit needs "
                            f"{MLA_ROPE_HEAD_DIM} (its offset heads' position frequencies live on 64 rope dims)")
        for f in ("qk_nope_head_dim", "v_head_dim"):  # SGLang reads both for every MLA model
            _field(cfg, f, where, "SGLang's MLA path reads it")
        if cfg.get("index_topk") is not None:
            raise LikeError(f"{where}: field 'index_topk' is set: DSA sparse attention (DeepSeek-V3.2, GLM-5) keeps "
                            "an indexer K cache beside the latent, which a like probe does not have; its latent "
                            "alone is like:deepseek-v3's shape (kv_lora_rank 512 + rope 64 per layer)")
        return Geometry(name, arch, "mla", layers, 1, None, rank, rope, dtype, heads)
    if cfg.get("sliding_window") is not None and cfg.get("use_sliding_window", True) is not False:
        raise LikeError(f"{where}: field 'sliding_window'={cfg['sliding_window']!r}: sliding-window attention may "
                        "keep a separate SWA pool in SGLang; like probes model full attention only")
    kinds = cfg.get("layer_types")
    if kinds is not None and any(k != "full_attention" for k in kinds):
        raise LikeError(f"{where}: field 'layer_types' has layers other than full_attention: SGLang keeps a hybrid "
                        "pool for them; like probes model full attention only")
    kv_field = "num_key_value_heads" if cfg.get("num_key_value_heads") is not None else "num_attention_heads"
    kv = _field(cfg, kv_field, where, "KV heads per token and layer")
    if heads % kv:
        raise LikeError(f"{where}: field 'num_attention_heads'={heads} is not a multiple of {kv_field}={kv}")
    if kv < MIN_KV_HEADS:
        raise LikeError(f"{where}: field {kv_field!r}={kv}: the recital circuit needs {MIN_KV_HEADS} KV heads "
                        "(its induction and selection heads read different keys)")
    if cfg.get("head_dim") is not None:
        head_dim, src = _field(cfg, "head_dim", where, "K and V head width"), "field 'head_dim'"
    else:
        hidden = _field(cfg, "hidden_size", where, "head_dim is absent: SGLang takes hidden_size // num_attention_heads")
        head_dim, src = hidden // heads, f"hidden_size {hidden} // num_attention_heads {heads}"
    if head_dim != CIRCUIT_HEAD_DIM:
        raise LikeError(f"{where}: head_dim {head_dim} ({src}): the recital circuit needs {CIRCUIT_HEAD_DIM} "
                        "(fewer dimensions leave no room for its position-free content; more change the rotary "
                        "frequencies its offset heads are tuned to)")
    if cfg.get("v_head_dim") not in (None, 0, head_dim):
        raise LikeError(f"{where}: field 'v_head_dim'={cfg['v_head_dim']!r} differs from head_dim {head_dim}: "
                        "the probe's V heads are as wide as its K heads")
    return Geometry(name, arch, "gqa", layers, kv, head_dim, None, None, dtype, heads)


@functools.lru_cache(maxsize=64)
def _load_cached(path: str, name: str, _stamp: tuple) -> Geometry:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise LikeError(f"{p}: cannot read the like config: {e.strerror or e}") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise LikeError(f"{p}: not JSON: {e}") from None
    return geometry_of(cfg, name, str(p))


def load_path(path: str | os.PathLike, name: str | None = None) -> Geometry:
    """The geometry of the config file ``path`` (named by its stem unless ``name`` is given)."""
    p = Path(path).expanduser()
    name = name or name_of_path(p)
    try:
        st = p.stat()
        stamp = (st.st_mtime_ns, st.st_size)
    except OSError as e:
        raise LikeError(f"{p}: no like config there ({e.strerror or e})") from None
    return _load_cached(str(p.resolve()), name, stamp)


# --------------------------------------------------------------------------- names
_registered: dict[str, Path] = {}


def committed_names() -> list[str]:
    return sorted(p.stem for p in LIKE_DIR.glob("*.json"))


def _env_paths() -> list[Path]:
    return [Path(x).expanduser() for x in os.environ.get(ENV, "").split(os.pathsep) if x.strip()]


def registered_names() -> list[str]:
    names = set(_registered)
    for p in _env_paths():
        try:
            names.add(name_of_path(p))
        except LikeError:
            pass
    return sorted(names)


def names() -> list[str]:
    """Every like name this process can resolve: committed and registered."""
    return sorted(set(committed_names()) | set(registered_names()))


def config_path(name: str) -> Path:
    """The config file a like name stands for: registered in this process, in ``KVCHAOS_PROBE_LIKE``,
    or committed in ``kvchaos/probe/like/``."""
    if name in _registered:
        return _registered[name]
    for p in _env_paths():
        if p.suffix == ".json" and p.stem.lower() == name:
            return p
    committed = LIKE_DIR / f"{name}.json"
    if NAME.match(name) and committed.exists():
        return committed
    raise LikeError(f"like probe {name!r}: no config of that name (committed: {', '.join(committed_names())} in "
                    f"kvchaos/probe/like/; another is registered with --kvchaos-probe-like PATH/{name}.json "
                    f"or {ENV})")


def geometry(name: str) -> Geometry:
    """The geometry of the like config called ``name``."""
    return load_path(config_path(name), name)


def register(path: str | os.PathLike) -> Geometry:
    """Make the config at ``path`` resolvable as ``like:<its stem>`` in this process and, through
    ``KVCHAOS_PROBE_LIKE``, in the processes it starts. A stem that names another config with a
    different geometry (committed or registered) is refused."""
    p = Path(path).expanduser().resolve()
    name = name_of_path(p)
    geo = load_path(p, name)
    try:
        have = config_path(name).resolve()
    except LikeError:
        have = None
    if have is not None and have != p and load_path(have, name) != geo:
        raise LikeError(f"{p}: like name {name!r} already stands for {have}, with another geometry: rename the file")
    _registered[name] = p
    paths = [str(x) for x in _env_paths()]
    if str(p) not in paths:
        os.environ[ENV] = os.pathsep.join([*paths, str(p)])
    return geo


def unregister(name: str) -> None:
    """Forget a registered name (tests): this process and ``KVCHAOS_PROBE_LIKE``."""
    p = _registered.pop(name, None)
    keep = [str(x) for x in _env_paths() if not (x.suffix == ".json" and x.stem.lower() == name) and x != p]
    if keep:
        os.environ[ENV] = os.pathsep.join(keep)
    else:
        os.environ.pop(ENV, None)


def name_of_kind(kind: str) -> str | None:
    """``like:<name>`` -> name; any other probe kind -> None."""
    return kind[len(PREFIX):] if isinstance(kind, str) and kind.startswith(PREFIX) else None


def load(ref: str) -> Geometry:
    """A name (committed or registered) or a path to a config file."""
    if ref.endswith(".json") or os.sep in ref:
        return load_path(ref)
    return geometry(ref)


# --------------------------------------------------------------------------- command line
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvchaos.probe.like",
                                 description="KV-cache geometry of a like config and its bytes per token, page and request")
    ap.add_argument("ref", nargs="+", help="a committed or registered name, or a config.json path")
    ap.add_argument("--page", type=int, default=64, help="page size in tokens [64]")
    ap.add_argument("--tokens", type=int, default=512, help="prompt tokens of a typical request [512]")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    out = []
    for ref in args.ref:
        try:
            geo = load(ref)
        except LikeError as e:
            ap.error(str(e))
        row = {"name": geo.name, "geometry": geo.to_dict(), "page_size": args.page, "request_tokens": args.tokens,
               "bytes": {d: {"per_token": geo.bytes_per_token(d), "per_page": geo.bytes_per_page(args.page, d),
                             "per_request": geo.request_bytes(args.tokens, args.page, d)}
                         for d in ("bfloat16", "fp8_e4m3", "float32")}}
        out.append(row)
        if not args.json:
            g = geo
            shape = (f"{g.kv_heads} KV heads x head_dim {g.head_dim} (K and V)" if g.attention == "gqa"
                     else f"latent {g.kv_lora_rank} + rope {g.qk_rope_head_dim}")
            print(f"like:{g.name}: {g.architecture}, {g.attention}, {g.layers} layers, {shape}, serves {g.dtype}")
            for d, b in row["bytes"].items():
                print(f"  {d:9s} {b['per_token']:>9,d} B/token  {b['per_page']:>12,d} B/page (page {args.page})  "
                      f"{b['per_request']:>14,d} B per {args.tokens}-token request")
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
