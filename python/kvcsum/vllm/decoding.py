"""How each layer's KV bytes are read back as numbers, as vLLM configures
it, declared to the kvcsum worker (docs/SPEC.md section 7, "Decoding").

Two engines can hold the same KV bytes and still compute with different
KV: another kv_cache_dtype (fp8_e4m3 bytes read as fp8_e5m2), other fp8
`k_scale`/`v_scale` of a layer, another head size. The checksums of the
bytes then match. `LayerDecodings` reads these facts per layer (the
attention layer's `kv_cache_dtype`, `_k_scale_float` and `_v_scale_float`
where vLLM's static forward context has the layer, else the cache config's
`cache_dtype`; the head size from the KV cache spec) and declares them with
`Worker.set_layer_decoding`; records and the payload extension carry them,
and the verifier reports a load whose sides declare a fact differently as
UNVERIFIED (DECODING_DIFFERS), never as a match.

Scales are declared for fp8 caches only (other caches do not use them), and
again whenever they change (vLLM's calculate_kv_scales sets them at the
first forward). It needs torch and vLLM's config objects only through the
attributes it reads, so it is tested with stand-ins.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Iterable, Mapping

from kvcsum.vllm.cache_checksums import CacheChecksummer, LayerSpec, layer_number

__all__ = ["LayerDecodings", "dtype_name"]

logger = logging.getLogger("vllm.kvcsum")

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")

#: vLLM's and torch's spellings of an element type -> the name SPEC
#: section 7 gives it.
_ALIASES = {
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "float": "float32",
    "fp32": "float32",
    "float8_e4m3fn": "fp8_e4m3",
    "fp8_e4m3fn": "fp8_e4m3",
    "float8_e4m3fnuz": "fp8_e4m3fnuz",
    "float8_e5m2": "fp8_e5m2",
    "float8_e5m2fnuz": "fp8_e5m2fnuz",
}


def dtype_name(cache_dtype: str | None, spec_dtype: str | None, fp8: str = "fp8_e4m3") -> str | None:
    """The SPEC name of a layer's cache element type: vLLM's `cache_dtype`
    ("auto": the spec's dtype, "torch.bfloat16" -> "bfloat16"; "fp8": the
    platform's fp8, `fp8`), or None where it has no name kvcsum takes."""
    text = str(cache_dtype or "auto").strip().lower()
    if text == "auto":
        text = str(spec_dtype or "").strip().lower()
    text = text.removeprefix("torch.")
    if text == "fp8":
        text = fp8
    text = _ALIASES.get(text, text)
    return text if _NAME.match(text) else None


def _platform_fp8() -> str:
    """What "fp8" means on this platform (e4m3fn, or e4m3fnuz on ROCm)."""
    try:
        from vllm.platforms import current_platform

        return dtype_name(str(current_platform.fp8_dtype()), None) or "fp8_e4m3"
    except Exception:  # noqa: BLE001 - no platform to ask: vLLM's CUDA meaning
        return "fp8_e4m3"


def _scale(layer, attribute: str) -> float | None:
    value = getattr(layer, attribute, None)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and value > 0 else None


class LayerDecodings:
    """Declares each registered layer's decoding facts to `checksummer`'s
    worker, and declares them again when they change.

    Args:
        vllm_config: vLLM's config (its cache_config.cache_dtype and
            compilation_config.static_forward_context are read).
        layers: the LayerSpecs the checksummer was made from.
        checksummer: the CacheChecksummer whose worker registered them.
        kv_cache_names: the layers vLLM gave caches for.
    """

    def __init__(
        self,
        vllm_config,
        layers: Iterable[LayerSpec],
        checksummer: CacheChecksummer,
        kv_cache_names: Iterable[str],
    ):
        self._config = vllm_config
        self._worker = checksummer.worker
        present = set(kv_cache_names)
        self._layers = [
            spec
            for spec in layers
            if spec.name in present and spec.kind == "attention" and spec.group_id not in checksummer.skipped
        ]
        self._fp8 = _platform_fp8()
        self._declared: dict[tuple, tuple] = {}
        self._failed: set = set()
        #: Layers whose facts cannot change any more: not fp8 (only fp8
        #: scales change, when vLLM calculates them) while the forward
        #: context holds the same number of layers. declare() looks at the
        #: others only.
        self._settled: set = set()
        self._context_size = -1
        #: The forward context last looked at, while every layer is settled
        #: (None otherwise): vLLM fills one dict while it builds the model
        #: and keeps it (compilation_config.static_forward_context; its
        #: layers hold it too), so while its size holds nothing can change.
        self._quiet_context: Mapping | None = None

    def _forward_context(self) -> Mapping:
        compilation = getattr(self._config, "compilation_config", None)
        context = getattr(compilation, "static_forward_context", None)
        # A dict in vLLM: the ABC check only for anything else (it costs more).
        return context if type(context) is dict or isinstance(context, Mapping) else {}

    def facts(self, spec: LayerSpec, layer) -> tuple:
        """(dtype, head_size, k_scale, v_scale) of one layer; None where
        not known."""
        cache = getattr(self._config, "cache_config", None)
        cache_dtype = getattr(layer, "kv_cache_dtype", None) or getattr(cache, "cache_dtype", None)
        dtype = dtype_name(cache_dtype, spec.dtype, self._fp8)
        if dtype is not None and dtype.endswith("_ds_mla") and spec.spec_type == "SlidingWindowMLASpec" and self._fp8.endswith("fnuz"):
            # DeepSeek V4's sliding-window records on an FNUZ platform
            # (gfx942): vLLM's C++ writer encodes their fp8 as FNUZ, its
            # readers decode them so (models/deepseek_v4/amd/rocm.py:
            # 1674-1684, use_fnuz=current_platform.is_fp8_fnuz(); its
            # compressed states stay OCP, :1662): another record than an
            # OCP engine's of the same bytes' width.
            dtype += "_fnuz"
        k_scale = v_scale = None
        if dtype is not None and dtype.startswith("fp8") and layer is not None:
            k_scale, v_scale = _scale(layer, "_k_scale_float"), _scale(layer, "_v_scale_float")
        return dtype, spec.head_size or None, k_scale, v_scale

    def declare(self) -> None:
        """Declares every layer whose facts are new or changed. A layer the
        worker refuses is logged once and left undeclared (it then compares
        as if nothing were declared)."""
        quiet = self._quiet_context
        if quiet is not None and len(quiet) == self._context_size:
            return  # a decode step's call: every layer settled, none came
        context = self._forward_context()
        if len(context) != self._context_size:
            # Layers came or went: look at every layer again.
            self._context_size = len(context)
            self._settled.clear()
        self._quiet_context = None
        if len(self._settled) == len(self._layers):
            self._quiet_context = context
            return
        for spec in self._layers:
            key = (spec.group_id, spec.name)
            if key in self._failed or key in self._settled:
                continue
            layer = context.get(spec.name)
            facts = self.facts(spec, layer)
            if not (facts[0] or "").startswith("fp8") and self._declared.get(key, facts) == facts:
                self._settled.add(key)
            if self._declared.get(key) == facts:
                continue
            dtype, head_size, k_scale, v_scale = facts
            if dtype is None and head_size is None and k_scale is None and v_scale is None:
                continue
            try:
                self._worker.set_layer_decoding(
                    spec.group_id, layer_number(spec.name), dtype, head_size or 0, k_scale, v_scale
                )
            except (ValueError, LookupError) as error:  # kvcsum's InvalidArgument / NotFound
                self._failed.add(key)
                logger.warning("kvcsum: layer %s: its decoding is not declared: %s", spec.name, error)
                continue
            self._declared[key] = facts
        if len(self._settled) == len(self._layers):
            self._quiet_context = context
