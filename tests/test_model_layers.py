"""Model pieces on their own: MoE grouped matmul vs a per-expert loop, float32 norms/router under bfloat16,
document positions, bfloat16 params/compute, jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qwen35_jax.config import Qwen35Config
from qwen35_jax.layers.linear import Linear
from qwen35_jax.layers.moe import grouped_experts, route
from qwen35_jax.layers.norms import gated_rms_norm, rms_norm
from qwen35_jax.layers.rope import mrope_axis_of_frequency, rope_cos_sin
from qwen35_jax.model import Qwen35ForCausalLM, document_positions


def test_grouped_experts_equal_per_expert_loop():
    rng = np.random.default_rng(0)
    t, d, i, e, k = 13, 8, 6, 5, 2
    x = rng.standard_normal((t, d)).astype(np.float32)
    gate_up = rng.standard_normal((e, d, 2 * i)).astype(np.float32)
    down = rng.standard_normal((e, i, d)).astype(np.float32)
    logits = rng.standard_normal((t, e)).astype(np.float32)
    logits[:, 4] -= 100.0  # expert 4 gets no tokens: an empty group
    weights, ids = route(jnp.asarray(logits), k, normalize=True)
    got = np.asarray(grouped_experts(jnp.asarray(x), weights, ids, jnp.asarray(gate_up), jnp.asarray(down)))

    x, gate_up, down, logits = (a.astype(np.float64) for a in (x, gate_up, down, logits))  # the reference in float64
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.zeros_like(x)
    for n in range(t):
        top = np.argsort(-probs[n])[:k]
        w = probs[n, top] / probs[n, top].sum()
        for j, ex in enumerate(top):
            h = x[n] @ gate_up[ex]
            h = h[:i] / (1 + np.exp(-h[:i])) * h[i:]
            want[n] += w[j] * (h @ down[ex])
    assert 4 not in np.asarray(ids)
    # Our float32 experts vs the float64 loop: a few float32 ulps of outputs up to 37, measured max 3.7e-6 on
    # AMD EPYC; 4e-5 leaves 10x headroom.
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-5)


@pytest.mark.parametrize("dtype, precision", [(jnp.bfloat16, "DEFAULT"), (jnp.float32, "HIGHEST")])
def test_grouped_experts_contract_bf16_at_default_precision(dtype, precision):
    # conftest sets jax_default_matmul_precision "highest", as a user may; ragged_dot's TPU kernel refuses
    # bf16 operands at a float32 contraction, so bf16 experts ask for DEFAULT, forward and backward (bf16
    # products accumulate in float32 exactly either way); float32 keeps the precision asked for.
    from jaxpr_testutil import all_equations

    assert jax.config.jax_default_matmul_precision == "highest"
    t, d, i, e, k = 8, 4, 6, 3, 2
    x, gate_up, down = (jnp.ones(shape, dtype) for shape in ((t, d), (e, d, 2 * i), (e, i, d)))
    weights, ids = route(jnp.zeros((t, e)), k, normalize=True)
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(grouped_experts(a[0], weights, ids, *a[1:]).astype(jnp.float32)),
                                    argnums=(0, 1, 2)))(x, gate_up, down)
    dots = [e for e in all_equations(jaxpr) if e.primitive.name in ("ragged_dot_general", "ragged_dot")]
    assert len(dots) >= 4, [e.primitive.name for e in all_equations(jaxpr)]
    assert {str(p) for e in dots for p in e.params["precision"]} == {precision}


def test_router_and_norms_compute_in_float32():
    x = jax.random.normal(jax.random.key(0), (4, 32), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (32,), jnp.float32) * 0.1
    want = (x.astype(jnp.float32) * jax.lax.rsqrt(jnp.mean(x.astype(jnp.float32) ** 2, -1, keepdims=True) + 1e-6)
            * (1 + w)).astype(jnp.bfloat16)
    assert rms_norm(x, w, 1e-6).dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(rms_norm(x, w, 1e-6), np.float32), np.asarray(want, np.float32))
    assert gated_rms_norm(x, x, w, 1e-6).dtype == jnp.bfloat16
    weights, ids = route(x[:, :8], 3, normalize=True)
    assert weights.dtype == jnp.float32 and ids.dtype == jnp.int32
    np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)


def test_document_positions_restart_per_document():
    seg = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0], [5, 5, 5, 5, 5, 5, 5, 5]])
    np.testing.assert_array_equal(np.asarray(document_positions(seg)),
                                  [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])


def test_mrope_equal_axes_is_plain_rotary_and_sections_pick_axes():
    cfg = Qwen35Config.preset("tiny", head_dim=64, partial_rotary_factor=0.5, mrope_section=(6, 5, 5))
    assert list(mrope_axis_of_frequency(cfg)) == [0, 1, 2] * 5 + [0]
    pos = jnp.broadcast_to(jnp.arange(10), (2, 10))
    c2, s2 = rope_cos_sin(pos, cfg)
    c3, s3 = rope_cos_sin(jnp.broadcast_to(pos, (3, 2, 10)), cfg)
    np.testing.assert_array_equal(np.asarray(c2), np.asarray(c3))
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(s3))
    with pytest.raises(ValueError, match="positions"):
        rope_cos_sin(jnp.zeros((4, 2, 10)), cfg)


def test_bfloat16_params_and_compute_track_float32():
    cfg = Qwen35Config.preset("tiny-moe")
    ref = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0))
    low = Qwen35ForCausalLM(cfg.replace(dtype="bfloat16", param_dtype="bfloat16"), rngs=nnx.Rngs(0))
    dtypes = {p.get_value().dtype for _, p in nnx.to_flat_state(nnx.state(low, nnx.Param))}
    assert jnp.dtype(jnp.bfloat16) in dtypes
    # same values, rounded: copy the float32 weights into the bfloat16 model
    nnx.update(low, jax.tree.map(lambda r, lo: r.astype(lo.dtype), nnx.state(ref, nnx.Param),
                                 nnx.state(low, nnx.Param)))
    assert {p.get_value().dtype for _, p in nnx.to_flat_state(nnx.state(low, nnx.Param))} == dtypes
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, cfg.vocab_size)
    h_ref, h_low = ref(tokens), low(tokens)
    assert h_low.dtype == jnp.bfloat16 and h_ref.dtype == jnp.float32
    l_ref, l_low = np.asarray(ref.logits(h_ref)), np.asarray(low.logits(h_low))
    assert l_low.dtype == np.float32 and np.isfinite(l_low).all()
    assert np.abs(l_low - l_ref).max() < 0.05 * np.abs(l_ref).max()


def test_jit_matches_eager_and_lm_head_weight_is_tied_embedding():
    cfg = Qwen35Config.preset("tiny")
    model = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    seg = jnp.array([[1] * 9 + [2] * 7, [1] * 12 + [0] * 4])
    eager = model(tokens, segment_ids=seg)
    jitted = nnx.jit(lambda m, t, s: m(t, segment_ids=s))(model, tokens, seg)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), atol=1e-5)
    assert not hasattr(model, "lm_head")
    np.testing.assert_array_equal(np.asarray(model.lm_head_weight()),
                                  np.asarray(model.embed_tokens.embedding[...]).T)


def test_bad_inputs_are_clear_errors():
    cfg = Qwen35Config.preset("tiny")
    model = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="tokens"):
        model(jnp.zeros((8,), jnp.int32))
    with pytest.raises(ValueError, match="positions"):
        model(jnp.zeros((1, 8), jnp.int32), positions=jnp.zeros((1, 7), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        model(jnp.zeros((1, 8), jnp.int32), segment_ids=jnp.ones((1, 9), jnp.int32))
    with pytest.raises(ValueError, match="kind"):
        from qwen35_jax.model import DecoderLayer
        DecoderLayer(cfg, "sliding_attention", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name,total,active", [
    ("0.8B", 0.8, None), ("4B", 4, None), ("9B", 9, None), ("27B", 27, None),
    ("35B-A3B", 35, 3), ("397B-A17B", 397, 17),
])
def test_published_presets_have_their_advertised_sizes(name, total, active):
    """Text-model parameter counts (from shapes only) near the size in the model name; the names also count the
    vision tower and round, hence the tolerances."""
    cfg = Qwen35Config.preset(name)
    model = nnx.eval_shape(lambda: Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    n_all = n_experts = 0
    for path, p in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[0] == "visual":  # the presets carry the vision tower too; this counts the text model
            continue
        n = int(np.prod(p.get_value().shape))
        n_all += n
        n_experts += n if "experts" in path else 0
    assert abs(n_all / 1e9 - total) <= 0.1 * total, n_all
    if active is not None:
        n_active = n_all - n_experts + n_experts * cfg.num_experts_per_tok // cfg.num_experts
        assert abs(n_active / 1e9 - active) <= 0.2 * active, n_active


def _jaxpr_text(cfg: Qwen35Config) -> str:
    model = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((1, 8), jnp.int32)

    def loss(state):
        m = nnx.merge(graphdef, state)
        return m.logits(m(tokens)).sum()

    return str(jax.make_jaxpr(jax.grad(loss))(state))


def test_depth_is_scanned_and_rematerialised():
    """The traced program does not grow with the number of blocks, and the block runs under remat."""
    four = _jaxpr_text(Qwen35Config.preset("tiny"))
    twelve = _jaxpr_text(Qwen35Config.preset("tiny", num_hidden_layers=12,
                                             layer_types=Qwen35Config.preset("tiny").layer_types * 3))
    assert len(twelve) < 1.05 * len(four)
    assert "checkpoint" in four or "remat" in four
    cfg = Qwen35Config.preset("tiny", remat=False)
    plain = _jaxpr_text(cfg)
    # without remat the only checkpoints left are the GDN convs' own (q, k, v in each GDN layer)
    assert "checkpoint" not in plain
    assert plain.count("remat2[") == 3 * cfg.layer_types.count("linear_attention")


@pytest.mark.parametrize("s,block_q", [(70, 16), (64, 16), (40, 64)])
def test_query_blocked_attention_equals_one_block(s, block_q):
    from qwen35_kernels.attention import attention_core

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, s, 4, 8))
    k = jax.random.normal(keys[1], (2, s, 2, 8))
    v = jax.random.normal(keys[2], (2, s, 2, 8))
    seg = jnp.stack([jnp.where(jnp.arange(s) < s // 3, 1, 2), jnp.where(jnp.arange(s) < s - 5, 7, 0)])
    full = lambda q, k, v: attention_core(q, k, v, seg, block_q=10 ** 6)
    blocked = lambda q, k, v: attention_core(q, k, v, seg, block_q=block_q)
    np.testing.assert_allclose(np.asarray(blocked(q, k, v)), np.asarray(full(q, k, v)), atol=1e-6)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    g_full = jax.grad(loss(full), argnums=(0, 1, 2))(q, k, v)
    g_blocked = jax.grad(loss(blocked), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_blocked, g_full):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_linear_parts_equal_the_fused_projection_sliced():
    # `Linear.parts` (one matmul per output block, as the GDN layer takes q, k and v) against slicing the
    # fused projection's output: the same dot per column, so equal up to the matmul's own summation
    # order; in bfloat16 with a float32 weight, as the model computes. Sizes that do not split the
    # outputs are refused.
    lin = Linear(32, 24, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 32)), jnp.bfloat16)
    fused = np.asarray(lin(x), np.float32)
    parts = lin.parts(x, (8, 4, 12))
    assert [p.shape for p in parts] == [(2, 5, 8), (2, 5, 4), (2, 5, 12)] and parts[0].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.concatenate([np.asarray(p, np.float32) for p in parts], -1), fused,
                               rtol=2**-7, atol=1e-6)
    with pytest.raises(ValueError, match="must split the 24 outputs"):
        lin.parts(x, (8, 8))
