"""Long-context memory work changes no value: remat policies, sequence tiling of the MLP / MoE /
delta rule, and the compile-time train-step memory reader.

Every path is compared with the plain one (no remat, no tiling) in float32 within 1e-5 relative to
the array's scale (summation order differs between tiles and recomputations).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from compile_flags import in_default_scheduler_process
from qwen35_kernels.gated_delta_rule.chunked import chunked_gated_delta_rule
from qwen35_kernels.choices import KernelChoices

from qwen35_jax.config import REMAT_POLICIES, Qwen35Config
from qwen35_jax.layers.gdn_arrays import GdnTokens, GdnWeights
from qwen35_jax.model import Qwen35ForCausalLM, check_offload_supported
from qwen35_jax.parallel.mesh import make_mesh, state_shardings
from qwen35_jax.xla_options import compiler_options

TOL = 1e-5


def assert_close(got, want, what=""):
    want = np.asarray(want)
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    np.testing.assert_allclose(np.asarray(got), want, rtol=TOL, atol=TOL * scale, err_msg=what)


def assert_trees_close(got, want):
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want))
    flat_got = jax.tree_util.tree_leaves_with_path(got)
    assert len(flat_got) == len(flat_want)
    for path, g in flat_got:
        assert_close(g, flat_want[path], what=jax.tree_util.keystr(path))


def tiny(moe: bool = False, blocks: int = 2, **changes) -> Qwen35Config:
    """`blocks` blocks of 3 GDN + 1 attention layers, 8 heads each so that sp = 4 and 8 work."""
    extra = ({"num_experts": 4, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16} if moe
             else {"intermediate_size": 64})
    return Qwen35Config.preset(
        "tiny-moe" if moe else "tiny", vocab_size=128, hidden_size=32, num_attention_heads=8,
        num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5, mrope_section=(1, 1, 0),
        num_hidden_layers=4 * blocks, layer_types=(("linear_attention",) * 3 + ("full_attention",)) * blocks,
        linear_num_key_heads=2, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
        gdn_chunk_size=4, **extra, **changes)


def batch(b: int, s: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 128, size=(b, s)).astype(np.int32)
    seg = np.ones((b, s), np.int32)
    seg[0, s // 3:] = 2
    seg[0, 2 * s // 3:] = 3
    seg[-1, s - 3:] = 0
    return jnp.asarray(tokens), jnp.asarray(seg)


def value_and_grads(config: Qwen35Config, tokens, seg, mesh=None):
    graphdef, state = nnx.split(Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)))

    def loss(state):
        hidden = nnx.merge(graphdef, state)(tokens, segment_ids=seg)  # [B, S, D]
        return jnp.sum(jnp.sin(hidden.astype(jnp.float32))), hidden

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    if mesh is None:
        (_, hidden), grads = fn(state)
    else:
        with jax.set_mesh(mesh):
            (_, hidden), grads = fn(jax.device_put(state, state_shardings(state, mesh)))
    return hidden, grads


# ---------------------------------------------------------------------------- config
def test_remat_accepts_bools_and_round_trips():
    assert Qwen35Config.preset("tiny", remat=True).remat == "full"
    assert Qwen35Config.preset("tiny", remat=False).remat == "none"
    assert Qwen35Config.preset("tiny").remat == "auto"
    for policy in REMAT_POLICIES:
        c = Qwen35Config.preset("tiny", remat=policy)
        assert Qwen35Config(**dataclasses.asdict(c)) == c
    with pytest.raises(ValueError, match="remat must be one of"):
        Qwen35Config.preset("tiny", remat="sometimes")


# ---------------------------------------------------------------------------- remat
@functools.lru_cache(maxsize=None)
def no_remat_reference():
    return value_and_grads(tiny(remat="none"), *batch(2, 13))


@pytest.mark.parametrize("policy", [pytest.param("full", marks=pytest.mark.slow), "mlp",
                                    pytest.param("dots", marks=pytest.mark.slow), "layer", "nested", "offload"])
def test_remat_policy_equals_no_remat(policy):
    if policy == "offload":
        check_offload_supported()  # XLA:CPU has a pinned_host memory; a backend without one fails here
    want = no_remat_reference()
    got = value_and_grads(tiny(remat=policy), *batch(2, 13))
    assert_close(got[0], want[0], "hidden")
    assert_trees_close(got[1], want[1])


@pytest.mark.slow
def test_mlp_remat_of_the_moe_block_equals_no_remat():
    tokens, seg = batch(2, 13)
    want = value_and_grads(tiny(moe=True, blocks=1, remat="none"), tokens, seg)
    got = value_and_grads(tiny(moe=True, blocks=1, remat="mlp"), tokens, seg)
    assert_close(got[0], want[0], "hidden")
    assert_trees_close(got[1], want[1])


def test_mlp_remat_keeps_no_feed_forward_activations():
    """Compile-time memory of the train step: "mlp" holds none of the [T, intermediate] activations
    that "none" keeps for every layer (gate, up and their product, float32 on CPU: 3 x 4 x 4 x T x
    I bytes at least, less one layer's that the backward recomputes at a time)."""
    from qwen35_jax.memory.step_memory import step_memory

    if not in_default_scheduler_process(f"{__file__}::test_mlp_remat_keeps_no_feed_forward_activations"):
        return
    seq, inter = 256, 1024
    devices = jax.devices()[:1]
    none, mlp = (step_memory(tiny(blocks=1, remat=policy).replace(intermediate_size=inter), seq, (1, 1),
                             devices=devices, attention="xla", gdn_scan="sequential")  # no interpreted kernels
                 for policy in ("none", "mlp"))
    assert none.arguments == mlp.arguments
    kept = 3 * 4 * 4 * seq * inter  # 4 layers
    assert none.total - mlp.total >= 0.75 * kept, (none.total, mlp.total, kept)


def test_tiled_feed_forward_is_recomputed_once():
    """`recompute=True` wraps the untiled feed-forward in one checkpoint; tiled work is recomputed by
    the tile loop already and gains no second one."""
    from qwen35_jax.layers.tiling import tiled_over_sequence

    graphdef, state = nnx.split(nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
    x = jnp.ones((1, 32, 8))

    def jaxpr(recompute: bool, tile: int | None) -> str:
        def loss(state, x):
            y = tiled_over_sequence(lambda layer, x: jnp.tanh(layer(x)), nnx.merge(graphdef, state), x,
                                    recompute=recompute, tile=tile)
            return jnp.sum(y)
        return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(state, x))

    assert jaxpr(False, None).count("remat") == 0 and jaxpr(True, None).count("remat") > 0
    assert jaxpr(True, 8) == jaxpr(False, 8)


def test_layer_remat_checkpoints_every_layer():
    config = tiny(remat="layer")
    model = Qwen35ForCausalLM(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    jaxpr = str(jax.make_jaxpr(lambda st, t: nnx.merge(graphdef, st)(t))(state, batch(1, 8)[0]))
    # one checkpoint per layer of the scanned block, and inside each GDN layer its convs' own (q, k, v)
    n_gdn = config.layer_types[:config.block_period].count("linear_attention")
    assert jaxpr.count("remat") == config.block_period + 3 * n_gdn


# ---------------------------------------------------------------------------- tiling
def delta_rule_inputs(b: int, s: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    hk, hv, dk, dv = 2, 4, 8, 6
    q = rng.normal(size=(b, s, hk, dk)).astype(np.float32)
    k = rng.normal(size=(b, s, hk, dk)).astype(np.float32)
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = rng.normal(size=(b, s, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 0.5, size=(b, s, hv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, size=(b, s, hv)).astype(np.float32)
    init = rng.normal(size=(b, hv, dk, dv)).astype(np.float32)
    seg = np.ones((b, s), np.int32)
    seg[0, 16:] = 2  # a document starting exactly on a tile edge (tile 16)
    seg[0, 30:35] = 0  # padding across the next edge, then the same id again: a new document
    seg[0, 35:] = 2
    seg[1, 21:] = 3  # mid-tile start
    seg[1, s - 5:] = 0  # trailing padding in the last, partial tile
    return tuple(jnp.asarray(x) for x in (q, k, v, g, beta, seg, init))


def test_tiled_delta_rule_equals_untiled():
    q, k, v, g, beta, seg, init = delta_rule_inputs(2, 57)

    def run(tile, q, k, v, g, beta, init):
        out, state = chunked_gated_delta_rule(q, k, v, g, beta, segment_ids=seg, initial_state=init,
                                              chunk_size=4, choices=KernelChoices(sequence_tile=tile))
        return out, state

    def loss(tile):
        return lambda *xs: sum(jnp.sum(jnp.sin(y)) for y in run(tile, *xs))

    args = (q, k, v, g, beta, init)
    want, got = run(None, *args), run(16, *args)
    assert_close(got[0], want[0], "outputs")
    assert_close(got[1], want[1], "final state")
    assert "scan[" in str(jax.make_jaxpr(lambda *xs: run(16, *xs))(*args))  # the tiled path ran
    want_g = jax.grad(loss(None), argnums=tuple(range(6)))(*args)
    got_g = jax.grad(loss(16), argnums=tuple(range(6)))(*args)
    for name, a, b in zip("q k v g beta init".split(), got_g, want_g):
        assert_close(a, b, f"d{name}")


@pytest.mark.parametrize("scan", ["auto", "pallas"])  # pallas: the GPU's kernel and its gdn_remat "states"
def test_tiled_gdn_core_equals_untiled(scan):
    """The whole mixer (conv halo across tile edges, document starts on and next to edges, padding
    across an edge, a partial last tile) tile by tile against one pass, values and all gradients."""
    from qwen35_jax.layers.gated_deltanet import gdn_core

    _, _, _, _, _, seg, _ = delta_rule_inputs(2, 57)
    seg = seg.at[1, 17].set(4)  # a one-token document right after a tile edge: its conv must not look back
    rng = np.random.default_rng(1)
    b, s, hk, hv, dk, dv, kc = 2, 57, 2, 4, 8, 6, 4
    shapes = [(b, s, hk, dk), (b, s, hk, dk), (b, s, hv, dv), (b, s, hv, dv), (b, s, hv), (b, s, hv),
              (kc, hk, dk), (kc, hk, dk), (kc, hv, dv), (hv,), (hv,), (dv,)]
    args = tuple(jnp.asarray(rng.normal(size=sh).astype(np.float32)) for sh in shapes)

    def run(tile, *xs):
        return gdn_core(GdnTokens(*xs[:6]), GdnWeights(*xs[6:]), seg, eps=1e-6, chunk_size=4,
                        choices=KernelChoices(sequence_tile=tile, gdn_chunk_scan=scan))

    def loss(tile):
        return lambda *xs: jnp.sum(jnp.sin(run(tile, *xs)))

    assert "scan[" in str(jax.make_jaxpr(functools.partial(run, 16))(*args))
    assert_close(run(16, *args), run(None, *args), "outputs")
    names = GdnTokens._fields + GdnWeights._fields
    want = jax.grad(loss(None), argnums=tuple(range(12)))(*args)
    got = jax.grad(loss(16), argnums=tuple(range(12)))(*args)
    for name, x, y in zip(names, got, want):
        assert_close(x, y, f"d{name}")


@pytest.mark.parametrize("moe, layout, gdn_mode", [
    (False, None, "all_to_all"),
    (False, "fsdp=2,sp=4", "state_passing"),  # 16-token shards: the two sweeps of 4-token tiles
    # tiled MoE and the all-to-all GDN core on sequence shards (dense MLP tiles on shards: the case above)
    pytest.param(True, "fsdp=1,sp=4", "all_to_all", marks=pytest.mark.slow)])
def test_sequence_tiled_model_equals_untiled(moe, layout, gdn_mode):
    """Tiles of 4 tokens (MLP / MoE: per device shard; delta rule: whole chunks) against no tiling; one
    block of layers (tiling is per layer, the blocks' scan is tested elsewhere)."""
    tokens, seg = batch(2, 61)
    mesh = None if layout is None else make_mesh(layout, devices=jax.devices()[:8 if "2" in layout else 4])
    config = tiny(moe, blocks=1, remat="layer", gdn_sp_mode=gdn_mode)
    want = value_and_grads(config.replace(kernels=config.kernels.replace(sequence_tile=None)), tokens, seg, mesh)
    got = value_and_grads(config.replace(kernels=config.kernels.replace(sequence_tile=4)), tokens, seg, mesh)
    assert_close(got[0], want[0], "hidden")
    assert_trees_close(got[1], want[1])


def test_sequence_tile_rejects_negative():
    with pytest.raises(ValueError, match="sequence tile must be >= 0"):
        KernelChoices(sequence_tile=-1)


# ---------------------------------------------------------------------------- memory reader and search
def test_compiled_step_config_is_the_traced_platforms():
    """The memory tools compile a GPU's (or the target's) program on this CPU: "auto" layer layout and
    GDN chunk size resolve for that platform, not for the CPU (chunks of 32 at small heads)."""
    from qwen35_jax.memory.step_memory import traced_config

    config = tiny(remat="none").replace(gdn_chunk_size="auto", scan_layers="auto")
    assert config.gdn_chunk("cpu") == 32
    gpu, tpu = traced_config(config, None), traced_config(config, "v5p")
    assert (gpu.gdn_chunk_size, gpu.scan_layers) == (64, False)  # a GPU runs these blocks one after another
    assert (tpu.gdn_chunk_size, tpu.scan_layers) == (64, True)
    chosen = traced_config(config.replace(gdn_chunk_size=16, scan_layers=True), "h100")
    assert (chosen.gdn_chunk_size, chosen.scan_layers) == (16, True)


def test_train_step_memory_matches_the_parameter_count():
    """The compiled step's arguments are exactly the float32 parameters and both AdamW moments,
    ZeRO-3 sharded over 4 devices, plus the batch; the donated state is aliased. A VLM's step with a
    bucket of 32 image patches: the tower counted (`total_parameters` too), the batch holding positions
    and the bucket (the text model's step is the same program less the tower and those inputs)."""
    from qwen35_jax.memory.budget import total_parameters
    from qwen35_jax.memory.step_memory import step_memory
    from qwen35_jax.vision.config import VisionConfig

    text = tiny(remat="nested", dtype="bfloat16")
    vision = VisionConfig.preset("tiny").replace(out_hidden_size=text.hidden_size)
    config = text.replace(vision=vision, hf_model_type="qwen3_5", image_token_id=200, video_token_id=201,
                          vision_start_token_id=202, vision_end_token_id=203)
    image_patches = 32
    # tokens and segment ids [1, 64], positions [3, 64], and the bucket's patches, segments, rows/cols,
    # taps and weights: 4 bytes an element, replicated
    batch_bytes = 2 * 64 * 4 + 3 * 64 * 4 + image_patches * (vision.patch_dim + 1 + 2 + 4 + 4) * 4
    devices = jax.devices()[:4]
    short = step_memory(config, 64, (1, 4), devices=devices, image_patches=image_patches)
    graphdef, state = nnx.split(Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)))
    shardings = state_shardings(nnx.to_pure_dict(state), make_mesh((1, 4), devices=devices))
    per_device = sum(int(np.prod(s.shard_shape(x.shape))) * 4 for x, s in zip(
        jax.tree.leaves(nnx.to_pure_dict(state)), jax.tree.leaves(shardings)))
    assert total_parameters(config) == sum(x.size for x in jax.tree.leaves(state))
    # parameters + mu + nu (+ scalar counts) + batch; outputs alias the donated state
    assert 3 * per_device <= short.arguments <= 3 * per_device + batch_bytes + 64
    assert short.aliased >= 3 * per_device
    assert short.temporaries > 0
    assert short.total == short.arguments + short.outputs + short.temporaries - short.aliased


def fake_measure(fixed: int, per_token: int):
    from qwen35_jax.memory.step_memory import StepMemory

    calls = []

    def measure(seq: int) -> StepMemory:
        calls.append(seq)
        return StepMemory(seq=seq, arguments=fixed, outputs=0, temporaries=per_token * seq, aliased=0, compile_s=0.0)

    return measure, calls


@pytest.mark.parametrize("start", [256, 1024, 1 << 20])
def test_search_finds_the_longest_fitting_multiple(start):
    from qwen35_jax.memory.search import longest_fitting

    measure, calls = fake_measure(fixed=1000, per_token=3)
    limit = 1000 + 3 * 100_000  # fits up to S = 100,000
    best, tried = longest_fitting(measure, limit, start=start, granule=64)
    assert best.total <= limit and best.seq % 64 == 0
    assert best.seq == 100_000 // 64 * 64  # affine memory: the prediction is exact
    assert len(calls) == len(set(calls)) and len(calls) <= 16


def test_search_reports_nothing_when_even_the_shortest_does_not_fit():
    from qwen35_jax.memory.search import longest_fitting

    measure, _ = fake_measure(fixed=1_000, per_token=100)
    best, tried = longest_fitting(measure, 5_000, start=1024, granule=64)
    assert best is None and min(m.seq for m in tried) == 64
    temporaries_too_big = lambda seq: dataclasses.replace(measure(seq), temporaries=9_000 + seq)  # noqa: E731
    best, tried = longest_fitting(temporaries_too_big, 5_000, start=1 << 16, granule=64)
    assert best is None and len(tried) == 2  # S = 0 intercept 10,000 > 5,000 after one halving


@pytest.mark.parametrize("text, value", [("141GB", 141 * 10**9), ("80GiB", 80 * 2**30), ("1.5e9", 1_500_000_000),
                                         ("512 MiB", 512 * 2**20)])
def test_parse_bytes(text, value):
    from qwen35_jax.memory.search import parse_bytes

    assert parse_bytes(text) == value


def test_parse_bytes_rejects_garbage():
    from qwen35_jax.memory.search import parse_bytes

    with pytest.raises(ValueError, match="bad memory size"):
        parse_bytes("lots")


def test_search_stops_when_the_state_alone_does_not_fit():
    from qwen35_jax.memory.search import longest_fitting

    measure, calls = fake_measure(fixed=10_000, per_token=1)
    best, _ = longest_fitting(measure, 5_000, start=1 << 16, granule=64)
    assert best is None and calls == [1 << 16]


def test_tiled_backward_holds_each_layers_buffers_only_during_its_own_backward():
    """Eight checkpointed residual layers of `tiled_over_sequence` (two checkpointed blocks of four,
    as remat "nested" nests them) need less memory than the same loop left to autodiff, whose
    zero-filled input-gradient accumulators XLA allocated for all four layers of a block at once;
    values and gradients agree."""
    from qwen35_jax.layers.tiling import tiled_over_sequence

    if not in_default_scheduler_process(
            f"{__file__}::test_tiled_backward_holds_each_layers_buffers_only_during_its_own_backward"):
        return
    rng = np.random.default_rng(0)
    layers = [nnx.Linear(64, 64, rngs=nnx.Rngs(i)) for i in range(8)]
    graphdef, states = nnx.split(layers)
    x = jnp.asarray(rng.normal(size=(1, 8192, 64)).astype(np.float32))  # 2 MiB per [S, D] buffer

    def layer_fn(layer: nnx.Linear, x: jax.Array) -> jax.Array:
        return jnp.tanh(layer(x))

    def autodiff_tiles(layer: nnx.Linear, x: jax.Array) -> jax.Array:  # the loop autodiff differentiates
        def body(i, ys):
            xt = jax.checkpoint(lambda x, i: layer_fn(layer, jax.lax.dynamic_slice_in_dim(x, i * 1024, 1024, 1)))(x, i)
            return jax.lax.dynamic_update_slice_in_dim(ys, xt, i * 1024, 1)
        return jax.lax.fori_loop(0, 8, body, jnp.zeros_like(x))

    def loss(states, x, tiled):
        stack = nnx.merge(graphdef, states)

        def block(layers, x):
            for layer in layers:
                x = x + jax.checkpoint(lambda x, layer=layer: tiled(layer, x))(x)
            return x

        for i in (0, 4):
            x = jax.checkpoint(lambda x, i=i: block(stack[i:i + 4], x))(x)
        return jnp.sum(x * x)

    def compiled(tiled):
        step = jax.jit(jax.value_and_grad(functools.partial(loss, tiled=tiled)), compiler_options=compiler_options())
        return step.lower(states, x).compile()

    ours = compiled(functools.partial(tiled_over_sequence, layer_fn, tile=1024))
    autodiff = compiled(autodiff_tiles)
    temp = {name: c.memory_analysis().temp_size_in_bytes for name, c in (("ours", ours), ("autodiff", autodiff))}
    assert temp["ours"] < 0.5 * temp["autodiff"], temp  # measured 12.8 against 44.0 MiB
    with jax.enable_x64(True):  # the untiled stack in float64
        want = jax.value_and_grad(functools.partial(loss, tiled=layer_fn))(
            *jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (states, x)))
    got = ours(states, x)
    # float32 against float64 through 8 residual tanh layers of 64-term dots, 8192 rows summed
    assert_close(got[0], want[0], "loss")
    assert_trees_close(got[1], want[1])
