"""Mesh parsing, the parameter sharding rule, and internal padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qwen35_jax.parallel.mesh import (
    ACT_BSD,
    create_sharded,
    make_mesh,
    param_spec,
    parse_mesh,
    shard_model,
    state_shardings,
    valid_layouts,
)
from qwen35_jax.parallel.padding import pad_inputs, strip


def test_parse_mesh_layouts():
    assert parse_mesh("fsdp=2,sp=4", 8) == (2, 4)
    assert parse_mesh("sp=8", 8) == (1, 8)
    assert parse_mesh(" sp=2 , fsdp=4 ", 8) == (4, 2)
    assert parse_mesh(None, 8) == (8, 1)
    assert parse_mesh("", 8) == (8, 1)
    assert parse_mesh(None) == (jax.device_count(), 1)
    assert valid_layouts(8) == [(1, 8), (2, 4), (4, 2), (8, 1)]


@pytest.mark.parametrize(
    "spec, culprit",
    [
        ("fsdp=3,sp=2", "valid layouts: fsdp=1,sp=8, fsdp=2,sp=4, fsdp=4,sp=2, fsdp=8,sp=1"),
        ("sp=16", "fsdp*sp = 16 devices but there are 8"),
        ("tp=8", "bad mesh 'tp=8'"),
        ("sp=8,sp=1", "each axis at most once"),
        ("fsdp=two", "axis fsdp needs a positive integer"),
        ("fsdp=0,sp=8", "axis fsdp needs a positive integer"),
    ],
)
def test_parse_mesh_errors(spec, culprit):
    with pytest.raises(ValueError) as info:
        parse_mesh(spec, 8)
    message = str(info.value)
    assert culprit in message and "\n" not in message


def test_make_mesh_shape_and_order():
    mesh = make_mesh("fsdp=2,sp=4")
    assert mesh.axis_names == ("fsdp", "sp")
    assert mesh.devices.shape == (2, 4)
    ids = [d.id for d in mesh.devices.reshape(-1)]
    assert ids == sorted(ids)  # neighbouring devices on sp
    with pytest.raises(ValueError, match="needs 6 devices"):
        make_mesh((2, 3))


def test_param_spec_rule():
    both = ("fsdp", "sp")
    assert param_spec((1024, 4096), 8) == P(None, both)  # largest divisible dim
    assert param_spec((4096, 1024), 8) == P(both, None)
    assert param_spec((1000, 4096), 8) == P(None, both)
    assert param_spec((1003, 4097), 8) == P()  # nothing divisible
    assert param_spec((64,), 8) == P()  # tiny: replicated
    assert param_spec((1024, 4096), 1) == P()
    # the stacked block dim is never split, even when it is the largest
    assert param_spec((4096, 64, 512), 8, skip_dims=1) == P(None, None, both)
    assert param_spec((4096, 63, 511), 8, skip_dims=1) == P()


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.big = nnx.Linear(64, 512, rngs=rngs)  # kernel [64, 512]: 32768 elements
        self.small = nnx.Linear(8, 8, rngs=rngs)


def test_shard_model_places_params(mesh_2x4):
    mesh = mesh_2x4
    model = shard_model(Tiny(nnx.Rngs(0)), mesh)
    assert model.big.kernel[...].sharding.spec == P(None, ("fsdp", "sp"))
    assert model.big.kernel[...].addressable_shards[0].data.shape == (64, 64)
    assert model.small.kernel[...].sharding.spec == P()
    shardings = state_shardings(nnx.state(model), mesh)
    assert shardings["big"]["bias"].get_value().spec == P()


def test_create_sharded_builds_in_place(mesh_2x4):
    model = create_sharded(lambda: Tiny(nnx.Rngs(0)), mesh_2x4)
    plain = Tiny(nnx.Rngs(0))
    assert model.big.kernel[...].sharding.spec == P(None, ("fsdp", "sp"))
    np.testing.assert_array_equal(model.big.kernel[...], plain.big.kernel[...])
    np.testing.assert_array_equal(model.small.bias[...], plain.small.bias[...])


def test_activation_constraint_is_real_on_cpu(mesh_2x4):
    mesh = mesh_2x4
    x = jnp.ones((4, 16, 8))
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x: jax.lax.with_sharding_constraint(x * 2, ACT_BSD))(x)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, ACT_BSD), 3)
    assert y.addressable_shards[0].data.shape == (2, 4, 8)


def test_pad_and_strip():
    tokens = jnp.arange(3 * 7).reshape(3, 7) + 1
    seg = jnp.ones((3, 7), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(7), (3, 3, 7))  # mrope [3, B, S]
    t, p, s = pad_inputs(tokens, pos, seg, fsdp=2, sp=4)
    assert t.shape == (4, 8) and p.shape == (3, 4, 8) and s.shape == (4, 8)
    assert int(s[:, 7].sum()) == 0 and int(s[3].sum()) == 0  # padding is segment 0
    np.testing.assert_array_equal(strip(t, 3, 7), tokens)
    same = pad_inputs(tokens, pos[0], seg, fsdp=1, sp=7)
    assert same[0] is tokens
