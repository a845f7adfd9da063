"""KV layouts: the axis every suite can run over (``--kvchaos-layouts a,b``).

A layout is how the KV cache is laid out in the engine: the attention kind of the model (which
decides the KV pool class and what a transferred page holds), the page size, and the dtype.

Names are ``<attention>-p<page size>-<dtype>``:

=========== ================================================================================
attention   model (a leak-sensitive probe model per kind, ``kvchaos.probe.ensure_probe``)
=========== ================================================================================
``mha``     the committed probe: LlamaForCausalLM, 4 query heads, 4 KV heads (``MHATokenToKVPool``)
``gqa``     the same recital with 2 KV heads for 4 query heads (grouped-query attention)
``mla``     DeepseekV2ForCausalLM, Multi-head Latent Attention: one compressed latent per token
            (``MLATokenToKVPool``), DeepSeek-V3 geometry (kv_lora_rank 512, rope 64)
=========== ================================================================================

page size: any integer >= 1 (the pool must be a multiple of it); dtype: ``fp32``, ``bf16``, ``fp16``.
Examples: ``mha-p1-fp32`` (the CPU profile's own), ``gqa-p16-bf16``, ``gqa-p64-bf16``, ``mla-p64-bf16``
(what most production PD deployments run: FlashMLA requires page 64).

``like:<name>-p<page size>-<dtype>``: the probe with the KV-cache geometry of a real model's config
(``kvchaos.probe.like``: ``like:llama-3.1-8b-p64-bf16``, ``like:deepseek-v3-p64-bf16``, or a config
registered with ``--kvchaos-probe-like``). Its attention is its config's — ``gqa`` or ``mla`` — so
everything that branches on the pool class sees what it would for the real model. Its dtypes add
``fp8``: the model in the config's dtype and ``--kv-cache-dtype fp8_e4m3`` (refused on CPU by
:class:`kvchaos.cluster.spec.ClusterSpec`).

Applying a layout to a spec sets ``model``, ``page_size`` and ``dtype`` (and ``kv_cache_dtype``) and names
the spec after it; a spec names its layout with :func:`of_spec` (``model`` that is not a probe: ``external``).
On CPU a like layout also sets the spec's ``pace``: every layer of a probe is computed, so a token of a
32-layer probe takes about 16 times as long as one of the 2-layer probes (measured: 3-4 tokens/s decoding
against 70-190), and every time bound of a request is scaled by it (:attr:`ClusterSpec.pace`). On a GPU
the pace stays 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvchaos.probe import like
from kvchaos.probe.kinds import PACE_MAX, PROBE_LAYERS  # the pace-1 probes' layers; no bound stretches further

ATTENTION = ("mha", "gqa", "mla")
# the CPU profile's own layout: every run's files before layouts existed; theirs keep their plain names
DEFAULT_LAYOUT = "mha-p1-fp32"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
LIKE_DTYPES = (*DTYPES, "fp8")  # fp8: the KV cache only (--kv-cache-dtype fp8_e4m3), the model in its config's dtype
KV_CACHE_DTYPES = {"fp8": "fp8_e4m3"}
SHORT = {v: k for k, v in DTYPES.items()}
_NAME = re.compile(r"^(?P<att>[a-z]+)-p(?P<page>[0-9]+)-(?P<dt>[a-z0-9]+)$")
_LIKE = re.compile(r"^like:(?P<name>[a-z0-9][a-z0-9._-]*)-p(?P<page>[0-9]+)-(?P<dt>[a-z0-9]+)$")


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    attention: str
    page_size: int
    dtype: str  # short name: fp32 | bf16 | fp16 (like layouts also fp8)
    like: str | None = None  # a like layout's config name (kvchaos.probe.like)

    @property
    def name(self) -> str:
        head = self.attention if self.like is None else like.PREFIX + self.like
        return f"{head}-p{self.page_size}-{self.dtype}"

    @property
    def model(self) -> str:
        if self.like is not None:
            return f"probe:{like.PREFIX}{self.like}"
        return "probe" if self.attention == "mha" else f"probe:{self.attention}"

    def overrides(self) -> dict:
        """The spec fields this layout sets."""
        if self.like is None:
            return {"model": self.model, "page_size": self.page_size, "dtype": DTYPES[self.dtype]}
        fp8 = self.dtype in KV_CACHE_DTYPES
        return {"model": self.model, "page_size": self.page_size,
                "dtype": like.geometry(self.like).dtype if fp8 else DTYPES[self.dtype],
                "kv_cache_dtype": KV_CACHE_DTYPES.get(self.dtype, "auto")}


def _parse_like(name: str) -> Layout:
    m = _LIKE.match(name)
    if not m:
        raise LayoutError(f"layout {name!r}: expected like:<config name>-p<page size>-<dtype>, e.g. "
                          f"like:llama-3.1-8b-p64-bf16 (config names: {', '.join(like.names())}; dtype one of "
                          f"{LIKE_DTYPES})")
    cfg, page, dt = m["name"], int(m["page"]), m["dt"]
    try:
        geo = like.geometry(cfg)
    except like.LikeError as e:
        raise LayoutError(f"layout {name!r}: {e}") from None
    if page < 1:
        raise LayoutError(f"layout {name!r}: page size must be >= 1")
    if dt not in LIKE_DTYPES:
        raise LayoutError(f"layout {name!r}: dtype {dt!r} is not one of {LIKE_DTYPES}")
    return Layout(geo.attention, page, dt, like=cfg)


def parse(name: str) -> Layout:
    name = name.strip()
    if name.startswith(like.PREFIX):
        return _parse_like(name)
    m = _NAME.match(name)
    if not m:
        raise LayoutError(f"layout {name!r}: expected <attention>-p<page size>-<dtype>, e.g. mla-p64-bf16 "
                          f"(attention one of {ATTENTION}, dtype one of {tuple(DTYPES)}), or "
                          f"like:<config name>-p<page size>-<dtype>")
    att, page, dt = m["att"], int(m["page"]), m["dt"]
    if att not in ATTENTION:
        raise LayoutError(f"layout {name!r}: attention {att!r} is not one of {ATTENTION}")
    if page < 1:
        raise LayoutError(f"layout {name!r}: page size must be >= 1")
    if dt not in DTYPES:
        extra = " (fp8 is a like: layout's, e.g. like:llama-3.1-8b-p64-fp8)" if dt == "fp8" else ""
        raise LayoutError(f"layout {name!r}: dtype {dt!r} is not one of {tuple(DTYPES)}{extra}")
    return Layout(att, page, dt)


def parse_list(raw: str) -> list[Layout]:
    names = list(dict.fromkeys(x.strip() for x in raw.split(",") if x.strip()))
    if not names:
        raise LayoutError(f"layouts {raw!r}: name at least one layout, e.g. mha-p1-fp32,mla-p64-bf16")
    return [parse(n) for n in names]


def probe_kind_of_model(model: str) -> str | None:
    """The probe kind a spec's ``model`` names (``kvchaos.probe.ensure_probe``'s argument: ``mha``,
    ``gqa``, ``mla`` or ``like:<name>``, unchecked); None for a model that is not a probe."""
    if model == "probe":
        return "mha"
    if model.startswith("probe:"):
        return model[len("probe:"):]
    return None


def attention_of_model(model: str) -> str | None:
    """The attention kind of a probe model: ``mha``, ``gqa`` or ``mla`` — a like probe's is its config's
    (``gqa`` or ``mla``: the KV pool class everything downstream branches on); None for a model that is
    not a probe. An unknown like name raises :class:`LayoutError`."""
    kind = probe_kind_of_model(model)
    name = like.name_of_kind(kind) if kind is not None else None
    if name is None:
        return kind
    try:
        return like.geometry(name).attention
    except like.LikeError as e:
        raise LayoutError(f"model {model!r}: {e}") from None


def of_spec(spec) -> str:
    """The layout name of a spec (``external-p64-bf16`` for a model that is not a probe)."""
    short = SHORT.get(spec.dtype, spec.dtype)
    kv = getattr(spec, "kv_cache_dtype", "auto")
    if kv != "auto":
        short = {v: k for k, v in KV_CACHE_DTYPES.items()}.get(kv, kv)
    kind = probe_kind_of_model(spec.model)
    att = kind or ("tiny" if spec.model.startswith("tiny:") else "external")
    return f"{att}-p{spec.page_size}-{short}"


def apply(spec_dict: dict, layout: Layout, *, name: str | None = None) -> dict:
    """A spec dict with ``layout`` applied (model, page size, dtype; named ``<profile>-<layout>``)."""
    pool = spec_dict.get("pool_tokens", 0)
    if pool and pool % layout.page_size:
        raise LayoutError(f"layout {layout.name}: the pool ({pool} tokens) is not a multiple of page size "
                          f"{layout.page_size}")
    out = {**spec_dict, **layout.overrides(), "name": name or f"{spec_dict.get('name', 'cpu')}-{layout.name}"}
    if layout.like is None and out.get("kv_cache_dtype", "auto") != "auto":
        out["kv_cache_dtype"] = "auto"  # a plain layout's KV cache is in the model's dtype
    # the profile's own pace (a slower machine class) times the layout's
    out["pace"] = min(PACE_MAX, float(spec_dict.get("pace", 1.0)) * pace(layout, out.get("device", "cpu")))
    return out


def pace_of(cluster) -> float:
    """The pace of a launched or attached cluster (its spec's, :attr:`ClusterSpec.pace`); 1 for anything
    without a spec (a stand-in in a unit test)."""
    return float(getattr(getattr(cluster, "spec", None), "pace", 1.0))


def pace(layout: Layout, device: str) -> float:
    """How many times longer a token of ``layout``'s probe takes on ``device`` than one of the profile's
    own probe: on CPU a like probe's layers over :data:`PROBE_LAYERS` (capped at :data:`PACE_MAX`);
    otherwise 1 (a GPU runs a 61-layer probe of hidden size 256 as fast as a 2-layer one)."""
    if layout.like is None or device != "cpu":
        return 1.0
    return min(PACE_MAX, max(1.0, like.geometry(layout.like).layers / PROBE_LAYERS))
