"""fsdp x sp parallelism: the mesh and its shardings, Ulysses sequence parallelism, token-local
modules per device, internal padding. Nothing here imports the layers (they import this package);
GDN state passing, which is the GDN mixer's own math, lives in `layers/gdn_state_passing.py`.

Names load on first use, so importing one module of the package does not import the others.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "token_local": "local", "pad_inputs": "padding", "strip": "padding",
    "ulysses_attention": "ulysses",
    **{name: "mesh" for name in ("ACT_BSD", "FSDP", "SP", "TOKENS_BS", "constrain", "create_sharded",
                                 "init_distributed", "make_mesh", "param_spec", "parse_mesh", "shard_model",
                                 "state_shardings", "valid_layouts")},
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qwen35_jax.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(f"qwen35_jax.parallel.{_EXPORTS[name]}"), name)
