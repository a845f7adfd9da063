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

Applying a layout to a spec sets ``model``, ``page_size`` and ``dtype`` and names the spec after it; a
spec names its layout with :func:`of_spec` (``model`` that is not a probe: ``external``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ATTENTION = ("mha", "gqa", "mla")
# the CPU profile's own layout: every run's files before layouts existed; theirs keep their plain names
DEFAULT_LAYOUT = "mha-p1-fp32"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_NAME = re.compile(r"^(?P<att>[a-z]+)-p(?P<page>[0-9]+)-(?P<dt>[a-z0-9]+)$")


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    attention: str
    page_size: int
    dtype: str  # short name: fp32 | bf16 | fp16

    @property
    def name(self) -> str:
        return f"{self.attention}-p{self.page_size}-{self.dtype}"

    @property
    def model(self) -> str:
        return "probe" if self.attention == "mha" else f"probe:{self.attention}"

    def overrides(self) -> dict:
        """The spec fields this layout sets."""
        return {"model": self.model, "page_size": self.page_size, "dtype": DTYPES[self.dtype]}


def parse(name: str) -> Layout:
    m = _NAME.match(name.strip())
    if not m:
        raise LayoutError(f"layout {name!r}: expected <attention>-p<page size>-<dtype>, e.g. mla-p64-bf16 "
                          f"(attention one of {ATTENTION}, dtype one of {tuple(DTYPES)})")
    att, page, dt = m["att"], int(m["page"]), m["dt"]
    if att not in ATTENTION:
        raise LayoutError(f"layout {name!r}: attention {att!r} is not one of {ATTENTION}")
    if page < 1:
        raise LayoutError(f"layout {name!r}: page size must be >= 1")
    if dt not in DTYPES:
        raise LayoutError(f"layout {name!r}: dtype {dt!r} is not one of {tuple(DTYPES)}")
    return Layout(att, page, dt)


def parse_list(raw: str) -> list[Layout]:
    names = list(dict.fromkeys(x.strip() for x in raw.split(",") if x.strip()))
    if not names:
        raise LayoutError(f"layouts {raw!r}: name at least one layout, e.g. mha-p1-fp32,mla-p64-bf16")
    return [parse(n) for n in names]


def attention_of_model(model: str) -> str | None:
    if model == "probe":
        return "mha"
    if model.startswith("probe:"):
        return model[len("probe:"):]
    return None


def of_spec(spec) -> str:
    """The layout name of a spec (``external-p64-bf16`` for a model that is not a probe)."""
    short = {v: k for k, v in DTYPES.items()}.get(spec.dtype, spec.dtype)
    att = attention_of_model(spec.model) or ("tiny" if spec.model.startswith("tiny:") else "external")
    return f"{att}-p{spec.page_size}-{short}"


def apply(spec_dict: dict, layout: Layout, *, name: str | None = None) -> dict:
    """A spec dict with ``layout`` applied (model, page size, dtype; named ``<profile>-<layout>``)."""
    pool = spec_dict.get("pool_tokens", 0)
    if pool and pool % layout.page_size:
        raise LayoutError(f"layout {layout.name}: the pool ({pool} tokens) is not a multiple of page size "
                          f"{layout.page_size}")
    return {**spec_dict, **layout.overrides(), "name": name or f"{spec_dict.get('name', 'cpu')}-{layout.name}"}
