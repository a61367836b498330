"""Next-token labels built on the global sequence.

Under sequence parallelism each device holds a slice of the sequence. Shifting a local slice would
pair the last token of every shard with the wrong (or no) label, so labels are always derived from the
global [B, S] token array; when that array is sharded over ('fsdp', 'sp'), XLA inserts the one-token
halo exchange between neighbouring shards itself.
"""

import jax.numpy as jnp

IGNORE = -1  # label value that scores nothing and sends no gradient


def next_token_labels(
    tokens: jnp.ndarray,  # [B, S] int
    segment_ids: jnp.ndarray | None = None,  # [B, S] int: document ids >= 1, 0 = padding
) -> jnp.ndarray:  # [B, S] int32
    """`labels[b, t] = tokens[b, t + 1]` where t + 1 is in the same document, else IGNORE.

    Without `segment_ids` the whole row is one document, so only the last position is ignored. With
    them, the last token of each document and every padding position (id 0) get IGNORE.
    """
    tokens = jnp.asarray(tokens).astype(jnp.int32)
    following = jnp.roll(tokens, -1, axis=1)  # the wrapped-around last column is masked below
    has_next = jnp.arange(tokens.shape[1]) < tokens.shape[1] - 1  # [S]
    valid = jnp.broadcast_to(has_next, tokens.shape)
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids)
        next_segment = jnp.roll(segment_ids, -1, axis=1)
        valid = valid & (segment_ids > 0) & (next_segment == segment_ids)
    return jnp.where(valid, following, IGNORE)
