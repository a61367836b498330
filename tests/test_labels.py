import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from qwen35_jax.labels import IGNORE, next_token_labels


def test_single_document_shifts_left_and_ignores_last():
    tokens = np.array([[5, 6, 7, 8]])
    np.testing.assert_array_equal(next_token_labels(tokens), [[6, 7, 8, IGNORE]])


def test_document_ends_and_padding_are_ignored():
    tokens = np.array([[1, 2, 3, 4, 5, 6, 0, 0]])
    segments = np.array([[1, 1, 1, 2, 2, 2, 0, 0]])
    expected = [[2, 3, IGNORE, 5, 6, IGNORE, IGNORE, IGNORE]]
    np.testing.assert_array_equal(next_token_labels(tokens, segments), expected)


def test_sharded_sequence_matches_global_shift():
    """Labels of a sequence sharded over 8 devices equal the unsharded ones, shard edges included."""
    mesh = jax.make_mesh((2, 4), ("fsdp", "sp"), axis_types=(AxisType.Auto, AxisType.Auto))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 100, size=(2, 16))
    segments = np.repeat(np.array([[1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 0, 0]]), 2, axis=0)
    sharding = NamedSharding(mesh, P("fsdp", "sp"))
    sharded = jax.jit(next_token_labels, out_shardings=sharding)(
        jax.device_put(tokens, sharding), jax.device_put(segments, sharding)
    )
    np.testing.assert_array_equal(sharded, next_token_labels(tokens, segments))
    # every shard edge (positions 3, 7, 11) carries the first token of the next shard, not IGNORE
    for edge in (3, 7, 11):
        if segments[0, edge] == segments[0, edge + 1]:
            assert int(sharded[0, edge]) == tokens[0, edge + 1]
    assert jnp.sum(sharded == IGNORE) == 2 * 5
