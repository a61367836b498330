"""Ulysses all-to-all around the per-head mixers equals the unsharded mixer, on every mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qwen35_kernels.attention import attention_core
from qwen35_kernels.choices import KernelChoices

from qwen35_jax.layers.gated_deltanet import ulysses_gdn
from qwen35_jax.layers.gdn_arrays import GdnTokens, GdnWeights
from qwen35_bench.hlo import collectives
from qwen35_jax.parallel.mesh import make_mesh
from qwen35_jax.parallel.ulysses import (
    ATTENTION_SCOPE,
    check_heads,
    shared_head_index,
    ulysses_attention,
)


def assert_close(got, want, tol=1e-5):
    """Within `tol` relative to the array's scale: summation order differs between layouts."""
    want = np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())))


def test_shared_head_index():
    assert shared_head_index(8, 8, 4) is None  # plain split
    assert shared_head_index(8, 4, 2) is None
    assert shared_head_index(12, 4, 4) is None  # 3 query heads per device = one kv group
    np.testing.assert_array_equal(shared_head_index(8, 2, 4), [0, 0, 1, 1])
    np.testing.assert_array_equal(shared_head_index(8, 2, 8), [0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(shared_head_index(8, 1, 4), [0, 0, 0, 0])
    # 3 query heads per device straddling groups of 4: one kv head per query head
    np.testing.assert_array_equal(shared_head_index(12, 3, 4), [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    # 4 query heads per device, groups of 2: two kv heads each
    np.testing.assert_array_equal(shared_head_index(8, 4, 2), None)
    np.testing.assert_array_equal(shared_head_index(16, 8, 4), None)


def test_heads_not_divisible_error():
    with pytest.raises(ValueError, match=r"query heads = 6 is not divisible by sp = 4; valid sp values: \[1, 2, 3, 6\]"):
        check_heads(6, 4, "attention query heads")
    mesh = make_mesh("fsdp=2,sp=4")
    q = jnp.zeros((2, 8, 6, 4))
    kv = jnp.zeros((2, 8, 2, 4))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="valid sp values"):
        ulysses_attention(attention_core, q, kv, kv, jnp.ones((2, 8), jnp.int32))


def _attention_inputs(b, s, h, k, dh, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, s, h, dh))
    kk = jax.random.normal(keys[1], (b, s, k, dh))
    v = jax.random.normal(keys[2], (b, s, k, dh))
    # packed rows: documents of random length, padding (0) at the end of the last row
    cuts = np.sort(np.random.default_rng(seed).integers(1, s, size=(b, 2)), axis=1)
    seg = np.ones((b, s), np.int32) + (np.arange(s) >= cuts[:, :1]) + (np.arange(s) >= cuts[:, 1:])
    seg[-1, -3:] = 0
    return q, kk, v, jnp.asarray(seg), jax.random.normal(keys[3], (b, s, h, dh))


@pytest.mark.parametrize(
    "layout, kv_heads",
    [
        ("fsdp=1,sp=8", 1),
        ("fsdp=2,sp=4", 2),
        pytest.param("fsdp=1,sp=8", 2, marks=pytest.mark.slow),
        pytest.param("fsdp=2,sp=4", 8, marks=pytest.mark.slow),
        pytest.param("fsdp=4,sp=2", 1, marks=pytest.mark.slow),
        pytest.param("fsdp=8,sp=1", 2, marks=pytest.mark.slow),
    ],
)
def test_ulysses_attention_matches(layout, kv_heads):
    q, k, v, seg, w = _attention_inputs(b=8, s=16, h=8, k=kv_heads, dh=8)

    def loss(q, k, v, fn):
        return jnp.sum(fn(q, k, v) * w)

    def plain(q, k, v):
        return attention_core(q, k, v, seg)

    def sharded(q, k, v):
        return ulysses_attention(attention_core, q, k, v, seg)

    want = plain(q, k, v)
    want_grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, plain)
    with jax.set_mesh(make_mesh(layout)):
        got = jax.jit(sharded)(q, k, v)
        got_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, sharded)
    assert_close(got, want)
    for g, gw in zip(got_grads, want_grads):
        assert_close(g, gw)


def test_ulysses_without_mesh_is_the_plain_call_and_at_sp_1_a_batch_shard():
    q, k, v, seg, _ = _attention_inputs(b=8, s=8, h=4, k=2, dh=8)
    seen = []

    def core(q, k, v, seg):  # records the shape the mixer is traced with
        seen.append(q.shape)
        return attention_core(q, k, v, seg)

    jaxpr = str(jax.make_jaxpr(lambda *a: ulysses_attention(core, *a))(q, k, v, seg))
    assert "shard_map" not in jaxpr and "all_to_all" not in jaxpr and seen == [(8, 8, 4, 8)]
    # at sp = 1 on several devices the mixer still runs per device, on its rows: a Pallas kernel's
    # custom call cannot be partitioned by XLA (Mosaic refuses it; a Triton call ran on every row)
    with jax.set_mesh(make_mesh("fsdp=8,sp=1")):
        jaxpr = str(jax.make_jaxpr(lambda *a: ulysses_attention(core, *a))(q, k, v, seg))
    assert "shard_map" in jaxpr and seen[-1] == (1, 8, 4, 8)
    assert not any(c in jaxpr for c in ("all_to_all", "all_gather", "psum"))


def test_ulysses_attention_hlo_has_all_to_all(mesh_2x4):
    q, k, v, seg, _ = _attention_inputs(b=2, s=16, h=8, k=2, dh=8)
    with jax.set_mesh(mesh_2x4):
        fn = jax.jit(lambda *a: ulysses_attention(attention_core, *a))
        hlo = fn.lower(q, k, v, seg).compile().as_text()
    ops = collectives(hlo)
    a2a = [c for c in ops if c.op == "all-to-all"]
    assert all(ATTENTION_SCOPE in c.op_name for c in a2a)
    # q, k, v in and the output back: each one all-to-all of one [B/F, S/sp, H/sp, Dh] block per peer
    # (k, v carry the kv heads replicated to one per device: 2 kv heads, sp = 4)
    assert len(a2a) == 4
    assert sorted(c.bytes for c in a2a) == [4 * 4 * 1 * 8 * 4] * 2 + [4 * 4 * 2 * 8 * 4] * 2
    gathers = [c for c in ops if c.op == "all-gather"]
    assert [c.shapes for c in gathers] == [(("s32", (1, 16)),)]  # only the segment ids


def _gdn_inputs(b, s, hk, hv, d, kc, seed=1):
    keys = iter(jax.random.split(jax.random.key(seed), 16))

    def rnd(*shape, scale=1.0):
        return scale * jax.random.normal(next(keys), shape)

    _, _, _, seg, _ = _attention_inputs(b, s, 1, 1, 1, seed=seed)
    tokens = GdnTokens(q=rnd(b, s, hk, d), k=rnd(b, s, hk, d), v=rnd(b, s, hv, d), z=rnd(b, s, hv, d),
                       b=rnd(b, s, hv), a=rnd(b, s, hv))
    weights = GdnWeights(conv_q=rnd(kc, hk, d, scale=0.5), conv_k=rnd(kc, hk, d, scale=0.5),
                         conv_v=rnd(kc, hv, d, scale=0.5), A_log=rnd(hv, scale=0.5), dt_bias=rnd(hv, scale=0.5),
                         norm_weight=1.0 + rnd(d, scale=0.1))
    return (tokens, weights), seg, rnd(b, s, hv, d)  # the mixer's first two arguments, ids, a cotangent


@pytest.mark.parametrize(
    "layout, key_heads",
    [
        ("fsdp=2,sp=4", 1),
        pytest.param("fsdp=1,sp=8", 2, marks=pytest.mark.slow),
        pytest.param("fsdp=4,sp=2", 8, marks=pytest.mark.slow),
    ],
)
def test_ulysses_gdn_matches(layout, key_heads):
    from qwen35_jax.layers.gated_deltanet import gdn_core

    args, seg, w = _gdn_inputs(b=4, s=16, hk=key_heads, hv=8, d=8, kc=4)
    static = dict(eps=1e-6, chunk_size=4)

    def plain(*a):
        return gdn_core(*a, seg, **static)

    def sharded(*a):
        return ulysses_gdn(gdn_core, *a, seg, **static)

    def loss(args, fn):
        return jnp.sum(fn(*args) * w)

    want = plain(*args)
    want_grads = jax.grad(loss)(args, plain)
    with jax.set_mesh(make_mesh(layout)):
        got = jax.jit(sharded)(*args)
        got_grads = jax.jit(jax.grad(loss), static_argnums=1)(args, sharded)
    assert_close(got, want)
    jax.tree.map(assert_close, got_grads, want_grads)


def test_ulysses_gdn_value_heads_error():
    from qwen35_jax.layers.gated_deltanet import gdn_core

    args, seg, _ = _gdn_inputs(b=2, s=8, hk=2, hv=6, d=4, kc=4)
    with jax.set_mesh(make_mesh("fsdp=2,sp=4")), pytest.raises(
        ValueError, match=r"value heads = 6 is not divisible by sp = 4; valid sp values: \[1, 2, 3, 6\]"
    ):
        ulysses_gdn(gdn_core, *args, seg, eps=1e-6, chunk_size=4)


def _boundary_segments(b, s, sp):
    """Row 0: a document starting exactly at a shard start, padding at a shard end followed by a new
    document at the next shard start; other rows: random packing (see `_attention_inputs`)."""
    _, _, _, seg, _ = _attention_inputs(b, s, 1, 1, 1, seed=4)
    seg = np.array(seg)
    L = s // sp
    row = np.ones(s, np.int32)
    row[L:] = 2
    row[2 * L - 3: 2 * L] = 0
    row[2 * L:] = 3
    row[3 * L + 2:] = 4
    seg[0] = row
    return jnp.asarray(seg)


@pytest.mark.parametrize("layout, key_heads, scan, tile", [
    ("fsdp=2,sp=4", 2, "auto", None),
    ("fsdp=2,sp=4", 2, "pallas", None),  # the GPU default (interpreted here) inside shard_map, initial states too
    # long shards: two sweeps of 4-token tiles per 8-token shard (tile edges inside and between documents)
    ("fsdp=2,sp=4", 2, "auto", 4),
    pytest.param("fsdp=1,sp=8", 1, "auto", None, marks=pytest.mark.slow),
])
def test_gdn_state_passing_matches(layout, key_heads, scan, tile):
    from qwen35_jax.layers.gated_deltanet import gdn_core, sharded_gdn_core

    sp = int(layout.split("sp=")[1])
    args, _, w = _gdn_inputs(b=2, s=32, hk=key_heads, hv=4, d=8, kc=4)
    seg = _boundary_segments(2, 32, sp)
    static = dict(eps=1e-6, chunk_size=4)

    def plain(*a):
        return gdn_core(*a, seg, **static)

    def sharded_with(tile):
        def sharded(*a):
            return sharded_gdn_core(*a, seg, **static, sp_mode="state_passing",
                                    choices=KernelChoices(gdn_chunk_scan=scan, sequence_tile=tile))
        return sharded

    sharded = sharded_with(tile)

    def loss(args, fn):
        return jnp.sum(fn(*args) * w)

    want = plain(*args)
    want_grads = jax.grad(loss)(args, plain)
    with jax.set_mesh(make_mesh(layout)):
        fn = jax.jit(sharded)
        got = fn(*args)
        hlo = fn.lower(*args).compile().as_text()
        if tile is not None:  # the two sweeps' tile loops (scans over 2 tiles) are in the program
            def scans(fn):
                return str(jax.make_jaxpr(fn)(*args)).count("scan[")
            assert scans(sharded) >= scans(sharded_with(None)) + 2
        got_grads = jax.jit(jax.grad(loss), static_argnums=1)(args, sharded)
    assert_close(got, want)
    jax.tree.map(assert_close, got_grads, want_grads)
    ops = collectives(hlo)
    assert not [c for c in ops if c.op == "all-to-all"]  # states and halos only
    assert all(32 not in dims for c in ops for _, dims in c.shapes)  # nothing sequence-long moves


def test_gdn_state_passing_needs_a_halo_sized_shard():
    from qwen35_jax.layers.gated_deltanet import sharded_gdn_core

    args, seg, _ = _gdn_inputs(b=2, s=16, hk=2, hv=4, d=4, kc=4)
    with jax.set_mesh(make_mesh("fsdp=1,sp=8")), pytest.raises(ValueError, match="needs >= 3 tokens per shard"):
        sharded_gdn_core(*args, seg, eps=1e-6, chunk_size=4, sp_mode="state_passing")
    with pytest.raises(ValueError, match="GDN sequence-parallel mode 'ring' is not one of"):
        sharded_gdn_core(*args, seg, eps=1e-6, chunk_size=4, sp_mode="ring")
