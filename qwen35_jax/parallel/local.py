"""Token-local modules (the MoE block) run per device on their own tokens.

The MoE flattens [B, S, D] to tokens, sorts them by expert and scatters them back. Left to XLA's
partitioner on a sequence-sharded input, that sort gathers the whole sequence onto every device.
Inside `jax.shard_map` each device instead routes only its own [B/F, S/sp, D] tokens, with the
module's weights gathered (ZeRO-3: the weights move, the activations stay put). Exact, because every
token is routed on its own.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from qwen35_jax.parallel.mesh import FSDP, SP, auto_mesh, mesh_axis_size

TOKEN_LOCAL_SCOPE = "token_local"


def token_local(module: nnx.Module, x: jax.Array) -> jax.Array:  # [B, S, D] -> [B, S, D]
    """`module(x)` per device on its token shard; a plain call without a multi-device mesh."""
    mesh = auto_mesh()
    if mesh is None:
        return module(x)
    b, s, _ = x.shape
    fsdp, sp = mesh_axis_size(mesh, FSDP), mesh_axis_size(mesh, SP)
    spec = P(FSDP if b % fsdp == 0 else None, SP if s % sp == 0 else None, None)
    graphdef, state = nnx.split(module)

    def local(state: nnx.State, x: jax.Array) -> jax.Array:  # [B/F, S/sp, D]
        return nnx.merge(graphdef, state)(x)

    with jax.named_scope(TOKEN_LOCAL_SCOPE):
        state_specs = jax.tree.map(lambda _: P(), state)
        return jax.shard_map(local, mesh=mesh, in_specs=(state_specs, spec), out_specs=spec,
                             check_vma=False)(state, x)

