"""fsdp x sp parallelism: the mesh and its shardings, Ulysses sequence parallelism, internal padding."""

from qwen35_jax.parallel.mesh import (
    ACT_BSD,
    FSDP,
    SP,
    TOKENS_BS,
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
    "create_sharded",
    "init_distributed",
    "make_mesh",
    "pad_inputs",
    "param_spec",
    "parse_mesh",
    "shard_model",
    "state_shardings",
    "strip",
    "ulysses_attention",
    "ulysses_gdn",
    "valid_layouts",
]
