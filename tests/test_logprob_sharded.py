"""Sequence-sharded log-prob/entropy on a 2x4 CPU mesh equals the unsharded call, values and grads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import qwen35_kernels as qk

T, D, V = 8 * 6, 24, 8 * 40  # 6 tokens and 40 vocabulary entries per device
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("fsdp", "sp"), axis_types=(AxisType.Auto, AxisType.Auto))


def _problem():
    k = jax.random.split(jax.random.key(0), 5)
    h = jax.random.normal(k[0], (T, D))
    w = jax.random.normal(k[1], (D, V)) * 0.4
    labels = jax.random.randint(k[2], (T,), 0, V)
    labels = jnp.where(jax.random.uniform(k[3], (T,)) < 0.2, -1, labels)
    g = jax.random.normal(k[4], (2, T))
    return h, w, labels, g


def _objective(fn, labels, g):
    def objective(h, w):
        lp, ent = fn(h, w, labels)
        return jnp.sum(g[0] * lp) + jnp.sum(g[1] * ent), (lp, ent)

    return jax.jit(jax.value_and_grad(objective, (0, 1), has_aux=True))


def _sharded(mesh, mode, backend, weight_axes, check_vma=True):
    tokens = P(("fsdp", "sp"))

    def local(h, w, labels):
        return qk.sharded_linear_logprob_entropy(
            h, w, labels, mode=mode, axis_names=weight_axes, temperature=TEMPERATURE, backend=backend
        )

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(tokens, P(None, weight_axes), tokens),
        out_specs=(tokens, tokens),
        check_vma=check_vma,
    )


def _compare(mesh, mode, backend, weight_axes=("fsdp", "sp"), check_vma=True):
    h, w, labels, g = _problem()
    unsharded = lambda h, w, l: qk.linear_logprob_entropy(  # noqa: E731
        h, w, l, temperature=TEMPERATURE, backend="reference"
    )
    (_, (lp0, ent0)), (dh0, dw0) = _objective(unsharded, labels, g)(h, w)
    fn = _sharded(mesh, mode, backend, weight_axes, check_vma)
    (_, (lp1, ent1)), (dh1, dw1) = _objective(fn, labels, g)(h, w)
    np.testing.assert_allclose(lp1, lp0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent1, ent0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dh1, dh0, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(dh0))))
    np.testing.assert_allclose(dw1, dw0, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(dw0))))
    assert np.all(np.asarray(lp1)[np.asarray(labels) < 0] == 0)


@pytest.mark.parametrize("mode", qk.MODES)
@pytest.mark.parametrize("backend", ["xla", "reference"])
def test_sharded_equals_unsharded(mesh, mode, backend):
    _compare(mesh, mode, backend)


@pytest.mark.parametrize("mode", qk.MODES)
def test_weight_sharded_over_sp_only(mesh, mode):
    # Vocabulary split over 'sp' (replicated over 'fsdp'): the group is the 4 devices of an sp row,
    # and the weight gradient is summed over 'fsdp' by shard_map's transpose.
    _compare(mesh, mode, "xla", weight_axes=("sp",))


@pytest.mark.parametrize("mode", qk.MODES)
def test_sharded_pallas_interpret(mesh, mode):
    # jax 0.10's Pallas interpreter cannot type loop carries under check_vma=True ("Scan carry input
    # and output got mismatched varying manual axes"), so the interpreted kernels run with
    # check_vma=False here; compiled GPU/TPU kernels are not interpreted.
    _compare(mesh, mode, "pallas", check_vma=False)


def test_vocab_parallel_never_gathers_the_weight(mesh):
    h, w, labels, g = _problem()
    fn = _sharded(mesh, "vocab_parallel", "xla", ("fsdp", "sp"))
    hlo = _objective(fn, labels, g).lower(h, w).compile().as_text()
    gathered = [line for line in hlo.splitlines() if "all-gather" in line and f"[{D},{V}]" in line]
    assert not gathered, gathered[:2]
    fn = _sharded(mesh, "gather", "xla", ("fsdp", "sp"))
    hlo = _objective(fn, labels, g).lower(h, w).compile().as_text()
    assert any("all-gather" in line and f"[{D},{V}]" in line for line in hlo.splitlines())


def test_bad_mode_raises(mesh):
    with pytest.raises(ValueError, match="mode must be one of"):
        qk.sharded_linear_logprob_entropy(
            jnp.zeros((4, 8)), jnp.zeros((8, 10)), jnp.zeros((4,), jnp.int32), mode="ring"
        )
