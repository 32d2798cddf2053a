"""The element formats a paged KV cache can hold (`--kv-cache-dtype`), by name: torch-free, so the engine
process, the KV layout and the cache sizing agree on one description.

`auto` stores keys and values in the model's compute dtype. `int8` and `fp8` (e4m3fn) store one byte per
element plus a scale per (token, KV head): each head's row in the cache is `head_dim` codes followed by
its scale as a bfloat16 (SCALE_BYTES). Scales are dynamic (amax of the row over the format's largest code,
computed when the token is written), so no calibration is needed and an outlier head or token never
costs the others their precision. ops/kv_quant.py is the reference of the arithmetic.
"""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# The cache's element type name (KvLayout.dtype) of each quantized --kv-cache-dtype.
QUANTIZED_ELEMENTS = {"int8": "int8", "fp8": "fp8_e4m3"}
SCALE_BYTES = 2  # one bfloat16 scale after each head's codes
_COMPUTE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_element_dtype(compute_dtype: str, kv_cache_dtype: str) -> str:
    """The name of what the cache stores: the compute dtype (auto), "int8" or "fp8_e4m3"."""
    if kv_cache_dtype == "auto":
        return compute_dtype
    if kv_cache_dtype not in QUANTIZED_ELEMENTS:
        raise ValueError(
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return QUANTIZED_ELEMENTS[kv_cache_dtype]


def is_quantized(element_dtype: str) -> bool:
    return element_dtype in QUANTIZED_ELEMENTS.values()


def kv_head_bytes(element_dtype: str, head_dim: int) -> int:
    """Bytes of one token's row of one KV head in a cache of `element_dtype` (codes and scale, if any)."""
    if is_quantized(element_dtype):
        return head_dim + SCALE_BYTES
    return head_dim * _COMPUTE_BYTES[element_dtype]
