"""The vision tower (qwen35_jax/vision/) against transformers' Qwen3_5VisionModel, both in float64.

transformers runs inside `torch_float64()` (its float32 pins, in the rotary, the interpolation weights and
the softmax, widened to float64) with its rotary `inv_freq` buffer recomputed there too (the model builds it
in float32 at construction), so both sides compute the same float64 numbers up to summation order.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers import vision_utils

from float64_reference import torch_float64
from qwen35_jax.config import Qwen35Config
from qwen35_jax.vision.config import PRESETS, VisionConfig
from qwen35_jax.vision.hf_weights import load_hf_state
from qwen35_jax.vision.layout import vision_layout
from qwen35_jax.vision.tower import VisionTower

# depth 2, 4 heads of 8, a 6 x 6 learned grid (so a 6 x 10 image really interpolates), 2 x 2 merge
CFG = VisionConfig(depth=2, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=48, num_heads=4,
                   in_channels=3, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=24,
                   num_position_embeddings=36, rope_theta=10_000.0)
ONE = [[1, 6, 10]]  # one image, non-square grid
MANY = [[1, 6, 10], [2, 4, 4], [1, 2, 6]]  # the 2-frame one (video-like) is two attention segments
# float64 on both sides: what is left is summation order, measured 1.8e-15 of the largest output (|out| up
# to 26); 1e-10 of it leaves five orders of headroom, while one float32 rounding shows: transformers' own
# float32 inv_freq (here [1, 0.01], only 0.01 rounds) is off by 8.5e-10.
RTOL = 1e-10


def _hf_config(cfg: VisionConfig) -> transformers.Qwen3_5VisionConfig:
    d = cfg.to_hf_dict()
    d.pop("model_type")
    hf_config = transformers.Qwen3_5VisionConfig(**d)
    hf_config._attn_implementation = "eager"
    return hf_config


@pytest.fixture(scope="module")
def pair():
    """(our float64 tower, the float64 transformers model): random weights, LayerNorms near 1."""
    torch.manual_seed(0)
    hf = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel(_hf_config(CFG))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale_one = "norm" in name and name.endswith("weight")
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if scale_one else 0.3 * torch.randn_like(p))
    hf = hf.double().eval()
    with torch_float64():
        inv_freq, _ = hf.rotary_pos_emb.compute_axial_rope_parameters(hf.config)
    hf.rotary_pos_emb.inv_freq = inv_freq
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    with jax.enable_x64(True):
        ours = VisionTower(CFG, "float64", "float64", rngs=nnx.Rngs(0))
        load_hf_state(ours, state)
    return ours, hf


def _patches(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, CFG.patch_dim))


@nnx.jit
def _forward(tower, patches, *layout):
    return tower(patches, *layout)


def _ours(tower: VisionTower, patches: np.ndarray, grid: list, padded: int | None = None) -> np.ndarray:
    lay = vision_layout(grid, CFG, padded)
    with jax.enable_x64(True):
        out = _forward(tower, jnp.asarray(patches), *(jnp.asarray(a) for a in lay[:4]))
        assert out.dtype == jnp.float64
        return np.asarray(out)


def _hf(hf, patches: np.ndarray, grid: list) -> np.ndarray:
    with torch.no_grad(), torch_float64():
        return hf(torch.from_numpy(patches), grid_thw=torch.tensor(grid)).pooler_output.numpy()


def _close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, rtol=0, atol=RTOL * np.abs(ref).max())


def test_one_non_square_image_matches_hf(pair):
    ours, hf = pair
    x = _patches(60)
    _close(_ours(ours, x, ONE), _hf(hf, x, ONE))


def test_images_of_several_sizes_and_frames_match_hf(pair):
    ours, hf = pair
    x = _patches(104, seed=1)
    ref = _hf(hf, x, MANY)
    _close(_ours(ours, x, MANY), ref)
    # each frame is its own segment: the second frame alone gives the same merged rows
    alone = _hf(hf, x[76:92], [[1, 4, 4]])
    _close(ref[19:23], alone)


def test_padding_rows_do_not_change_valid_outputs(pair):
    ours, hf = pair
    x = _patches(104, seed=1)
    garbage = np.random.default_rng(9).standard_normal((24, CFG.patch_dim)) * 100
    out = _ours(ours, np.concatenate([x, garbage]), MANY, padded=128)
    assert out.shape == (32, CFG.out_hidden_size) and np.isfinite(out).all()
    _close(out[:26], _hf(hf, x, MANY))
    _close(out[:26], _ours(ours, x, MANY))  # bitwise equal only up to summation order over more keys


GRAD_WEIGHTS = np.random.default_rng(3).standard_normal((26, CFG.out_hidden_size))  # MANY's 26 merged rows


def _weighted_sum(tower: VisionTower):
    """(graphdef, params, scalar(params, patches)): sum(tower(patches of MANY) * GRAD_WEIGHTS)."""
    lay = vision_layout(MANY, CFG)
    graphdef, params = nnx.split(tower)

    def scalar(params, patches):
        return jnp.sum(nnx.merge(graphdef, params)(patches, *(jnp.asarray(a) for a in lay[:4])) * GRAD_WEIGHTS)

    return graphdef, params, scalar


def _hf_backward(hf, x: np.ndarray) -> tuple[float, float, np.ndarray]:
    """transformers' float64 (weighted sum, sum of |output|, its gradient w.r.t. the patches); the
    parameters' gradients are left in `hf`."""
    hf.zero_grad()
    xt = torch.from_numpy(x).requires_grad_(True)
    with torch_float64():
        out = hf(xt, grid_thw=torch.tensor(MANY)).pooler_output
        total = (out * torch.from_numpy(GRAD_WEIGHTS)).sum()
        total.backward()
    return total.item(), out.detach().abs().sum().item(), xt.grad.numpy()


def test_gradients_match_torch_autograd(pair):
    ours, hf = pair
    x = _patches(104, seed=2)
    _, params, scalar = _weighted_sum(ours)
    with jax.enable_x64(True):
        g_params, g_x = jax.jit(jax.grad(scalar, argnums=(0, 1)))(params, jnp.asarray(x))
        g_qkv = np.asarray(g_params["blocks"]["attn"]["qkv"]["kernel"][...])  # [depth, D, 3D]
        g_pos = np.asarray(g_params["pos_embed"]["embedding"][...])  # [36, D]
        g_patch = np.asarray(g_params["patch_embed"]["proj"]["kernel"][...])  # [patch_dim, D]
        g_x = np.asarray(g_x)
    _, _, want_x = _hf_backward(hf, x)
    _close(g_x, want_x)
    for i in range(CFG.depth):
        _close(g_qkv[i], hf.blocks[i].attn.qkv.weight.grad.numpy().T)
    _close(g_pos, hf.pos_embed.weight.grad.numpy())
    _close(g_patch, hf.patch_embed.proj.weight.grad.numpy().reshape(CFG.hidden_size, -1).T)


def test_rows_split_over_the_mesh_match_hf_and_each_device_holds_a_share(pair, mesh_2x4):
    """On fsdp=2 x sp=4 the bucket's rows (104 patches, padded to 128 = 8 devices x 4 merge windows of
    4) split over all 8 devices: outputs and gradients are transformers' in float64, and the compiled
    attention computes [H, P/8, P] scores per device, never the whole [H, P, P]."""
    from qwen35_jax.parallel.mesh import shard_model

    ours, hf = pair
    x = _patches(104, seed=2)
    graphdef, params, scalar = _weighted_sum(ours)
    with jax.enable_x64(True), jax.set_mesh(mesh_2x4):
        sharded = nnx.split(shard_model(nnx.merge(graphdef, params), mesh_2x4))[1]
        fn = jax.jit(jax.value_and_grad(scalar, argnums=(0, 1)))
        hlo = fn.lower(sharded, jnp.asarray(x)).compile().as_text()
        value, (g_params, g_x) = fn(sharded, jnp.asarray(x))
        value, g_x = float(value), np.asarray(g_x)
        g_qkv = np.asarray(g_params["blocks"]["attn"]["qkv"]["kernel"][...])  # [depth, D, 3D]
    total, scale, want_x = _hf_backward(hf, x)
    assert abs(value - total) < RTOL * scale
    _close(g_x, want_x)
    for i in range(CFG.depth):
        _close(g_qkv[i], hf.blocks[i].attn.qkv.weight.grad.numpy().T)
    heads = CFG.num_heads
    assert f"f64[{heads},16,128]" in hlo and f"f64[{heads},128,128]" not in hlo  # 128 / 8 query rows a device
    assert "all-gather" in hlo


def test_float32_and_bfloat16_towers_track_the_float64_truth(pair):
    # the same weights rounded to float32 (norms, rotary and softmax in float32): measured 4.3e-7 of the
    # largest output through two blocks; 1e-5 leaves 20x headroom, while rows and cols swapped in the
    # rotary are off by 0.68
    ours, hf = pair
    x = _patches(104, seed=4)
    with jax.enable_x64(True):
        state = jax.tree.map(lambda a: np.asarray(a, np.float32), nnx.state(ours))
    lay = [jnp.asarray(a) for a in vision_layout(MANY, CFG)[:4]]
    ref = _hf(hf, x, MANY)
    # bfloat16 compute over float32 parameters: measured 1.5e-2 (bf16's 8 bits through two blocks)
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 5e-2)):
        tower = VisionTower(CFG, dtype, "float32", rngs=nnx.Rngs(0))
        nnx.update(tower, state)
        out = _forward(tower, jnp.asarray(x, jnp.float32), *lay)
        assert out.dtype == jnp.dtype(dtype)
        np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=0, atol=tol * np.abs(ref).max())


def test_load_hf_state_checks_names_and_shapes(pair):
    ours, hf = pair
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    tower = VisionTower(CFG, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="lacks .*blocks.1.attn.qkv.weight"):
        load_hf_state(tower, {k: v for k, v in state.items() if k != "blocks.1.attn.qkv.weight"})
    with pytest.raises(ValueError, match="merger.linear_fc2.bias: shape"):
        load_hf_state(tower, {**state, "merger.linear_fc2.bias": np.zeros(5)})
    with pytest.raises(ValueError, match="not copied.*extra"):
        load_hf_state(tower, {**state, "extra.weight": np.zeros(1)})
    with pytest.raises(ValueError, match="patch_embed.proj.weight has shape"):
        load_hf_state(tower, {**state, "patch_embed.proj.weight": state["patch_embed.proj.weight"][..., :2]})


@pytest.mark.parametrize("merge, grid", [(2, [[1, 6, 10], [2, 4, 4], [1, 2, 6], [3, 8, 2], [1, 12, 14]]),
                                         (1, [[1, 1, 5], [2, 3, 1], [1, 7, 9]])])
def test_layout_reproduces_transformers_vision_utils(merge, grid):
    cfg = CFG.replace(spatial_merge_size=merge)
    lay = vision_layout(grid, cfg, None)
    g = torch.tensor(grid)
    pos = vision_utils.get_vision_position_ids(g, merge).numpy()
    np.testing.assert_array_equal(lay.rope_rows_cols, pos)
    cu = vision_utils.get_vision_cu_seqlens(g).numpy()
    np.testing.assert_array_equal(lay.segment_ids, np.repeat(np.arange(1, len(cu)), np.diff(cu)))
    kw = dict(num_grid_per_side=cfg.grid_side, mode="bilinear", align_corners=True, spatial_merge_size=merge)
    with torch_float64():
        index, weight = vision_utils.get_vision_interpolation_indices_and_weights(g, **kw)
    np.testing.assert_array_equal(lay.interp_index, index.numpy())
    np.testing.assert_array_equal(lay.interp_weight, weight.numpy())
    _, weight32 = vision_utils.get_vision_interpolation_indices_and_weights(g, **kw)  # as transformers runs it
    np.testing.assert_allclose(lay.interp_weight, weight32.numpy(), rtol=0, atol=1e-6)
    assert lay.num_valid == len(pos)


def test_layout_pads_with_segment_zero_and_zero_weights():
    lay = vision_layout(ONE, CFG, 64)
    assert lay.num_valid == 60 and lay.segment_ids.shape == (64,)
    assert (lay.segment_ids[60:] == 0).all() and (lay.interp_weight[60:] == 0).all()
    assert (lay.rope_rows_cols[60:] == 0).all() and (lay.segment_ids[:60] == 1).all()
    np.testing.assert_allclose(lay.interp_weight[:60].sum(axis=1), 1.0, rtol=0, atol=1e-15)
    for bad, msg in ((58, "smaller than"), (62, "multiple of merge_unit")):
        with pytest.raises(ValueError, match=msg):
            vision_layout(ONE, CFG, bad)
    with pytest.raises(ValueError, match="multiples of spatial_merge_size"):
        vision_layout([[1, 5, 4]], CFG)


def test_config_reads_what_transformers_writes():
    hf_config = _hf_config(CFG)
    assert VisionConfig.from_hf(hf_config.to_dict()) == CFG
    assert VisionConfig.from_hf(CFG.to_hf_dict()) == CFG
    defaults = VisionConfig.from_hf(transformers.Qwen3_5VisionConfig().to_dict())
    assert defaults == VisionConfig.from_hf({}) == VisionConfig.from_hf({"rope_parameters": None})
    assert (defaults.depth, defaults.hidden_size, defaults.rope_theta, defaults.grid_side) == (27, 1152, 1e4, 48)
    assert (CFG.head_dim, CFG.patch_dim, CFG.merge_unit, CFG.grid_side) == (8, 96, 4, 6)


@pytest.mark.parametrize("changes, msg", [
    (dict(num_position_embeddings=35), "perfect square"),
    (dict(num_heads=3), "divisible by num_heads"),
    (dict(hidden_size=24, num_heads=4), "multiple of 4"),
    (dict(hidden_act="silu"), "hidden_act"),
    (dict(depth=0), "depth must be an int >= 1"),
])
def test_config_rejects_what_the_tower_cannot_run(changes, msg):
    with pytest.raises(ValueError, match=msg):
        CFG.replace(**changes)


def test_from_hf_rejects_unsupported_settings():
    with pytest.raises(ValueError, match="deepstack"):
        VisionConfig.from_hf({"deepstack_visual_indexes": [8]})
    with pytest.raises(ValueError, match="rope_type"):
        VisionConfig.from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="only equal sizes"):
        VisionConfig.from_hf({"patch_size": [14, 16]})
    assert VisionConfig.from_hf({"patch_size": [14, 14]}).patch_size == 14


@pytest.mark.parametrize("name", sorted(set(PRESETS) - {"tiny"}))
def test_published_presets_feed_their_text_model(name):
    vision = VisionConfig.preset(name)
    assert vision.out_hidden_size == Qwen35Config.preset(name).hidden_size
    assert VisionConfig.from_hf(vision.to_hf_dict()) == vision
