"""fsdp x sp parallelism: the mesh and its shardings, Ulysses sequence parallelism (or GDN state
passing), token-local modules per device, internal padding."""

from qwen35_jax.parallel.gdn_state_passing import gdn_sp_mode
from qwen35_jax.parallel.local import token_local
from qwen35_jax.parallel.mesh import (
    ACT_BSD,
    FSDP,
    SP,
    TOKENS_BS,
    constrain,
    create_sharded,
    init_distributed,
    make_mesh,
    param_spec,
    parse_mesh,
    shard_model,
    state_shardings,
    valid_layouts,
)
from qwen35_jax.parallel.padding import pad_inputs, strip
from qwen35_jax.parallel.ulysses import ulysses_attention, ulysses_gdn

__all__ = [
    "ACT_BSD",
    "FSDP",
    "SP",
    "TOKENS_BS",
    "constrain",
    "create_sharded",
    "gdn_sp_mode",
    "init_distributed",
    "make_mesh",
    "pad_inputs",
    "param_spec",
    "parse_mesh",
    "shard_model",
    "state_shardings",
    "strip",
    "token_local",
    "ulysses_attention",
    "ulysses_gdn",
    "valid_layouts",
]
