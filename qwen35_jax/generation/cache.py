"""The size of the hybrid decode cache (`layers/cache.py`) before a run: the GDN part depends on the
rows only, the attention part grows with the prompt plus the new tokens."""

from __future__ import annotations

import functools

import jax

from qwen35_jax.config import Qwen35Config
from qwen35_jax.layers.cache import AttentionCache, HybridCache, init_cache

__all__ = ["HybridCache", "cache_bytes", "describe_cache"]


def cache_bytes(config: Qwen35Config, rows: int, max_len: int) -> dict[str, int]:
    """Bytes of the cache of `rows` rows of up to `max_len` tokens: {"attention", "gdn", "total"}."""
    cache = jax.eval_shape(functools.partial(init_cache, config, rows, max_len))
    size = {"attention": 0, "gdn": 0}
    for layer in cache.layers:
        size["attention" if isinstance(layer, AttentionCache) else "gdn"] += sum(
            a.size * a.dtype.itemsize for a in layer)
    return {**size, "total": size["attention"] + size["gdn"]}


def describe_cache(config: Qwen35Config, rows: int, max_len: int) -> str:
    """One line: the cache's total and its two parts, for `rows` rows of up to `max_len` tokens."""
    size = cache_bytes(config, rows, max_len)

    def mib(n: int) -> str:
        return f"{n / 2**20:,.1f} MiB"

    return (f"cache for {rows} rows x {max_len} tokens: {mib(size['total'])} (attention K/V {mib(size['attention'])}, "
            f"grows with the length; GDN conv + state {mib(size['gdn'])}, constant)")
