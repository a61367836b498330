"""The whole model on every (fsdp, sp) layout equals the single-device model.

Hidden states, log-probs and parameter gradients within 1e-5 (float32) for dense and MoE tiny models,
sequence lengths 1, 7, 61 (padded internally), kv heads 1 with sp 4 and 8; packed documents equal
each document run alone; the compiled forward+backward has the all-to-alls of every attention and
GDN layer and never all-gathers a full-sequence activation.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from qwen35_jax.config import Qwen35Config
from qwen35_jax.labels import next_token_labels
from qwen35_jax.model import EMBED_SCOPE, Qwen35ForCausalLM
from qwen35_bench.hlo import collectives
from qwen35_jax.parallel.local import TOKEN_LOCAL_SCOPE
from qwen35_jax.parallel.mesh import ACT_BSD, make_mesh, state_shardings
from qwen35_jax.parallel.ulysses import ATTENTION_SCOPE, GDN_SCOPE

HIDDEN = 48  # a size no other axis has, so [.., S, D] gathers are recognisable in the HLO


def tiny_config(moe: bool, kv_heads: int = 2, gdn_sp_mode: str = "all_to_all") -> Qwen35Config:
    """4 layers (3 GDN + 1 attention), 8 query heads and 8 GDN value heads so that sp = 8 works."""
    return Qwen35Config.preset(
        "tiny-moe" if moe else "tiny",
        vocab_size=128, hidden_size=HIDDEN, num_attention_heads=8, num_key_value_heads=kv_heads, head_dim=8,
        partial_rotary_factor=0.5, mrope_section=(1, 1, 0), linear_num_key_heads=2, linear_num_value_heads=8,
        linear_key_head_dim=8, linear_value_head_dim=8, gdn_chunk_size=8, gdn_sp_mode=gdn_sp_mode,
        **({"intermediate_size": 64} if not moe else {"num_experts": 4, "moe_intermediate_size": 16,
                                                     "shared_expert_intermediate_size": 16}),
    )


@functools.lru_cache(maxsize=None)
def model_parts(moe: bool, kv_heads: int, gdn_sp_mode: str = "all_to_all"):
    model = Qwen35ForCausalLM(tiny_config(moe, kv_heads, gdn_sp_mode), rngs=nnx.Rngs(0))
    return nnx.split(model)


def batch(b: int, s: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 128, size=(b, s)).astype(np.int32)
    seg = np.ones((b, s), np.int32)
    if s > 4:  # two documents in row 0, padding at the end of the last row
        seg[0, s // 3:] = 2
        seg[-1, s - 2:] = 0
    return jnp.asarray(tokens), jnp.asarray(seg)


def loss_fn(graphdef):
    def loss(state, tokens, seg):
        model = nnx.merge(graphdef, state)
        hidden = model(tokens, segment_ids=seg)  # [B, S, D]
        logp_all = jax.nn.log_softmax(model.logits(hidden), axis=-1)  # [B, S, V]
        labels = next_token_labels(tokens, seg)
        logp = jnp.take_along_axis(logp_all, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
        logp = jnp.where(labels >= 0, logp, 0.0)  # [B, S]
        return -jnp.sum(logp), (hidden, logp)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


@functools.lru_cache(maxsize=None)
def reference(moe: bool, kv_heads: int, b: int, s: int):
    graphdef, state = model_parts(moe, kv_heads)
    (_, aux), grads = loss_fn(graphdef)(state, *batch(b, s))
    return aux, grads


def run_on_mesh(layout: str, moe: bool, kv_heads: int, b: int, s: int, gdn_sp_mode: str = "all_to_all"):
    graphdef, state = model_parts(moe, kv_heads, gdn_sp_mode)
    mesh = make_mesh(layout)
    with jax.set_mesh(mesh):
        sharded = jax.device_put(state, state_shardings(state, mesh))
        (_, aux), grads = loss_fn(graphdef)(sharded, *batch(b, s))
    return aux, grads


def assert_close(got, want, tol=1e-5, what=""):
    """Within `tol` relative to the array's scale: summation order differs between layouts."""
    want = np.asarray(want)
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol * scale, err_msg=what)


CASES = [
    # (layout, moe, kv heads, B, S)
    ("fsdp=2,sp=4", False, 2, 2, 61),
    ("fsdp=1,sp=8", True, 1, 2, 7),  # kv heads 1 with sp 8, MoE, S padded 7 -> 8
    pytest.param("fsdp=1,sp=8", False, 2, 3, 1, marks=pytest.mark.slow),  # S = 1, B = 3
    pytest.param("fsdp=4,sp=2", True, 1, 3, 7, marks=pytest.mark.slow),  # B = 3 padded to 4, kv heads 1
    pytest.param("fsdp=8,sp=1", True, 2, 8, 1, marks=pytest.mark.slow),  # every device on fsdp, S = 1
]
# kv-head replication for any sp is tests/test_ulysses.py's; each layout above appears once


@pytest.mark.parametrize("layout, moe, kv_heads, b, s", CASES)
def test_layouts_match_single_device(layout, moe, kv_heads, b, s):
    got, got_grads = run_on_mesh(layout, moe, kv_heads, b, s)
    assert_matches_reference(got, got_grads, moe, kv_heads, b, s)


@pytest.mark.slow
def test_gdn_state_passing_model_matches():
    got, got_grads = run_on_mesh("fsdp=2,sp=4", False, 2, 2, 61, gdn_sp_mode="state_passing")
    graphdef, state = model_parts(False, 2, "state_passing")
    with jax.set_mesh(make_mesh("fsdp=2,sp=4")):
        jaxpr = str(jax.make_jaxpr(lambda st, t: nnx.merge(graphdef, st)(t))(state, batch(2, 61)[0]))
    # GDN by states; attention by Ulysses (q, k, v in, output back) and one for the embedding lookup
    assert "ppermute" in jaxpr and jaxpr.count("all_to_all") == 4 + 1
    assert_matches_reference(got, got_grads, False, 2, 2, 61)


def assert_matches_reference(got, got_grads, moe, kv_heads, b, s):
    want, want_grads = reference(moe, kv_heads, b, s)
    assert got[0].shape == (b, s, HIDDEN) and got[1].shape == (b, s)
    assert_close(got[0], want[0], what="hidden")
    assert_close(got[1], want[1], what="log-probs")
    assert s == 1 or float(jnp.abs(want[1]).sum()) > 0  # something was scored (S = 1 has no labels)
    flat_got = jax.tree_util.tree_leaves_with_path(got_grads)
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want_grads))
    assert len(flat_got) == len(flat_want)
    for path, g in flat_got:
        assert_close(g, flat_want[path], what=jax.tree_util.keystr(path))


@pytest.mark.parametrize("layout", [pytest.param(None, marks=pytest.mark.slow), "fsdp=1,sp=4"])
def test_packed_documents_equal_documents_alone(layout):
    graphdef, state = model_parts(False, 2)
    lengths = [5, 9, 3]
    rng = np.random.default_rng(3)
    docs = [jnp.asarray(rng.integers(0, 128, size=(1, n)), jnp.int32) for n in lengths]
    packed = jnp.concatenate(docs + [jnp.zeros((1, 2), jnp.int32)], axis=1)  # 19 tokens incl. padding
    seg = jnp.asarray(np.repeat([1, 2, 3, 0], lengths + [2])[None], jnp.int32)
    forward = jax.jit(lambda st, t, sg: nnx.merge(graphdef, st)(t, segment_ids=sg))
    alone = [forward(state, d, None) for d in docs]
    if layout is None:
        together = forward(state, packed, seg)
    else:
        mesh = make_mesh(layout, devices=jax.devices()[:4])
        with jax.set_mesh(mesh):
            together = forward(jax.device_put(state, state_shardings(state, mesh)), packed, seg)
    starts = np.cumsum([0] + lengths)
    for d, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
        assert_close(together[:, lo:hi], alone[d], what=f"document {d}")


@pytest.mark.parametrize("moe", [pytest.param(False, marks=pytest.mark.slow), True])
def test_hlo_all_to_all_per_layer_and_no_sequence_gather(moe):
    b, s, layout = 2, 40, "fsdp=2,sp=4"  # 40: no weight has a dim of that size
    graphdef, state = model_parts(moe, 2)
    mesh = make_mesh(layout)
    tokens, seg = batch(b, s)
    with jax.set_mesh(mesh):
        sharded = jax.device_put(state, state_shardings(state, mesh))
        hlo = loss_fn(graphdef).lower(sharded, tokens, seg).compile().as_text()
    ops = collectives(hlo)
    a2a = [c for c in ops if c.op == "all-to-all"]
    attn = [c for c in a2a if ATTENTION_SCOPE in c.op_name]
    gdn = [c for c in a2a if GDN_SCOPE in c.op_name]
    cfg = tiny_config(moe)
    n_attn = cfg.layer_types.count("full_attention")
    n_gdn = cfg.layer_types.count("linear_attention")
    # forward: attention q, k, v in + out back = 4; GDN q, k, v, z, b, a in + out back = 7; the
    # backward has the transposes, and remat recomputes the forward once more
    passes = 3 if cfg.remat != "none" else 2
    assert len(attn) == passes * 4 * n_attn
    assert len(gdn) == passes * 7 * n_gdn
    embed = [c for c in a2a if EMBED_SCOPE in c.op_name]  # the lookup's hidden-dim shards, forward + backward
    assert len(embed) == 2
    assert len(a2a) == len(attn) + len(gdn) + len(embed)
    # no device ever gathers (or reduces) a full-sequence float activation, [B, S, D] or flattened to
    # tokens ([B*S, D], [B*S*k, D] in the MoE): no dim a multiple of S. The only full-sequence
    # collectives besides the all-to-alls are small int/bool [B, S] gathers (segment ids, doc starts).
    for c in ops:
        if c.op == "all-to-all":
            continue
        for dtype, dims in c.shapes:
            if any(d % s == 0 for d in dims if d):
                assert c.op == "all-gather" and dtype in ("s32", "pred") and dims[1:] == (s,), c
    if moe:
        assert any(TOKEN_LOCAL_SCOPE in c.op_name for c in ops)  # the expert weights gathered per device


def test_hidden_states_come_out_sequence_sharded(mesh_2x4):
    graphdef, state = model_parts(False, 2)
    tokens, seg = batch(2, 16)
    with jax.set_mesh(mesh_2x4):
        sharded = jax.device_put(state, state_shardings(state, mesh_2x4))
        hidden = jax.jit(lambda st, t, sg: nnx.merge(graphdef, st)(t, segment_ids=sg))(sharded, tokens, seg)
    assert hidden.sharding.is_equivalent_to(NamedSharding(mesh_2x4, ACT_BSD), 3)
    assert hidden.addressable_shards[0].data.shape == (1, 4, HIDDEN)
