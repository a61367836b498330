"""The vision-language model: a tiny transformers Qwen3_5ForConditionalGeneration imported through our real
loader (safetensors + config.json -> `load_hf(text_only=False)`) against transformers run in float64.

Our model runs in float32 (Qwen35Config has no float64 compute dtype) and the reference is transformers in
float64 end to end (`torch_float64`, with the vision rotary's float32 `inv_freq` buffer recomputed there),
so the tolerances below are float32 rounding through a 2-block tower and 4 text layers. Putting an image's
features on the wrong placeholders, a wrong position axis or a wrong weight layout is off by O(1)."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from flax import nnx

from float64_reference import float64_copy, torch_float64
from hf_testutil import all_tensors, edit_tensors, load_script
from qwen35_jax.checkpoint import load_checkpoint, save_checkpoint
from qwen35_jax.config import Qwen35Config
from qwen35_jax.data.mrope import expand_image_placeholders, mrope_positions
from qwen35_jax.hf import names as N
from qwen35_jax.hf.export import export_hf
from qwen35_jax.hf.load import inspect_hf, load_hf
from qwen35_jax.vision.inputs import VisionInputs, build_vision_inputs, check_vision_tokens

VOCAB = 128
IMAGE, VIDEO, START, END = 120, 121, 122, 123  # placeholder ids inside the tiny vocabulary
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                 mrope_section=[1, 1, 2], mrope_interleaved=True))
# 2 blocks, a 4 x 4 learned position grid (so every image below interpolates), 2 x 2 merge into 32 = hidden
VISION = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
# Our float32 log-probs vs the float64 truth: measured max 1.8e-6 (log-probs down to -7) on AMD EPYC; 2e-5 leaves
# 11x headroom, while the images' features given in the wrong order, or left out, are off by more than 1 (asserted).
LOGPROB_ATOL = 2e-5
# Tower gradients vs float64 autograd, relative to the largest entry of each tensor: measured max 2.3e-6.
GRAD_RTOL = 2e-5


def _init(model: torch.nn.Module) -> None:
    """Random weights of a healthy scale: norm gains near their identity, A_log in [-1, 1]."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand_like(p) * 2 - 1)
            elif "visual" in name and "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # LayerNorm gain
            elif name.endswith("norm.weight") and "linear_attn" not in name:
                p.copy_(0.1 * torch.randn_like(p))  # Qwen3.5 RMSNorm scales by 1 + weight
            else:
                p.copy_(torch.randn_like(p) * 0.1)


def write_hf_vlm(path: str):
    """A random tiny `Qwen3_5ForConditionalGeneration` (TEXT, VISION, IDS) saved at `path` in float32;
    returns its float64 copy, the tower's rotary buffer recomputed in float64."""
    config = tf.Qwen3_5Config(text_config=TEXT, vision_config=VISION, **IDS)
    model = tf.Qwen3_5ForConditionalGeneration._from_config(config, attn_implementation="eager")
    _init(model)
    model.float().save_pretrained(path)
    ref = float64_copy(model)
    with torch_float64():  # the tower's rotary buffer was built in float32 at construction
        inv_freq, _ = ref.model.visual.rotary_pos_emb.compute_axial_rope_parameters(ref.model.visual.config)
    ref.model.visual.rotary_pos_emb.inv_freq = inv_freq
    return ref


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory):
    """(HF checkpoint dir, our model loaded from it with the tower, its config, the float64 transformers model)."""
    path = str(tmp_path_factory.mktemp("vlm") / "hf")
    ref = write_hf_vlm(path)
    ours, cfg, _ = load_hf(path, text_only=False)
    return path, ours, cfg, ref


def _row(rng: np.random.Generator, pieces: list) -> list[int]:
    """pieces: ints (that many random text tokens) or grids (one image placeholder run of that grid)."""
    out = []
    for p in pieces:
        if isinstance(p, int):
            out += rng.integers(0, 100, p).tolist()
        else:
            out += [START] + expand_image_placeholders([IMAGE], [p], IMAGE, 2) + [END]
    return out


def _batch(rows: list[list], seed: int = 0):
    """Rows of pieces (equal total lengths) -> (tokens [B, S], grids in placeholder order, positions [3, B, S],
    patches [P, patch_dim] float64 in transformers' pixel_values order)."""
    rng = np.random.default_rng(seed)
    tokens = np.asarray([_row(rng, r) for r in rows], np.int32)
    grids = [g for r in rows for g in r if not isinstance(g, int)]
    positions = np.stack([mrope_positions(t, [g for g in r if not isinstance(g, int)] or None, image_token_id=IMAGE,
                                          video_token_id=VIDEO, merge_size=2)[0] for t, r in zip(tokens, rows)], 1)
    patch_dim = 3 * 2 * 4 * 4
    patches = rng.standard_normal((sum(int(np.prod(g)) for g in grids), patch_dim))
    return tokens, grids, positions, patches


def _vision_inputs(grids, patches, cfg, num_patches=None) -> VisionInputs:
    starts = np.cumsum([0] + [int(np.prod(g)) for g in grids])
    images = [(patches[a:b], g) for a, b, g in zip(starts[:-1], starts[1:], grids)]
    return build_vision_inputs(images, cfg.vision, num_patches)


@nnx.jit
def _logprobs(model, tokens, positions, vision):
    return jax.nn.log_softmax(model.logits(model(tokens, positions=positions, vision=vision)), axis=-1)


def _ours(model, cfg, tokens, grids, positions, patches, num_patches=None) -> np.ndarray:
    vision = _vision_inputs(grids, patches, cfg, num_patches) if grids else None
    check_vision_tokens(tokens, vision, cfg)
    return np.asarray(_logprobs(model, jnp.asarray(tokens), jnp.asarray(positions), vision))


def _ref_kwargs(ref, tokens, grids, patches, positions) -> dict:
    """transformers' inputs: its own mrope positions (get_rope_index, run outside float64 mode: it makes
    float32 on the way), which must be ours, and the images as pixel_values."""
    ids = torch.from_numpy(tokens).long()
    if not grids:
        return dict(input_ids=ids)
    types = torch.from_numpy((tokens == IMAGE).astype(np.int64))
    with torch.no_grad():
        pos, _ = ref.model.get_rope_index(ids, types, image_grid_thw=torch.tensor(grids))
    np.testing.assert_array_equal(pos.numpy(), positions)
    return dict(input_ids=ids, position_ids=pos, pixel_values=torch.from_numpy(patches),
                image_grid_thw=torch.tensor(grids))


def _ref(ref, tokens, grids, patches, positions) -> np.ndarray:
    kw = _ref_kwargs(ref, tokens, grids, patches, positions)
    with torch.no_grad(), torch_float64():
        return torch.log_softmax(ref(**kw).logits, dim=-1).numpy()


CASES = {
    "one_image": [[8, (1, 4, 6), 5]],  # non-square grid: 24 patches, 6 placeholders
    "two_images_one_row": [[2, (1, 4, 6), 3, (1, 2, 4), 4]],  # 6 + 2 placeholders (same shapes: one compile)
    "no_image": [[17]],
    "two_rows": [[4, (1, 4, 6), 3, (1, 2, 2), 2], [4, (1, 2, 4), 2, (1, 4, 4), 4]],  # 6+1 / 2+4 placeholders
}


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_match_transformers_float64(vlm, case):
    _, model, cfg, ref = vlm
    tokens, grids, positions, patches = _batch(CASES[case])
    want = _ref(ref, tokens, grids, patches, positions)
    got = _ours(model, cfg, tokens, grids, positions, patches)
    np.testing.assert_allclose(got, want, atol=LOGPROB_ATOL, rtol=0)
    if case == "two_rows":
        # the test can fail: without the images, or with them in the wrong order, it is far off
        text_only = np.asarray(_logprobs(model, jnp.asarray(tokens), jnp.asarray(positions), None))
        assert np.abs(text_only - want).max() > 1.0
        # a bigger bucket (more padding patches) changes nothing
        padded = _ours(model, cfg, tokens, grids, positions, patches, num_patches=256)
        np.testing.assert_allclose(padded, want, atol=LOGPROB_ATOL, rtol=0)
        # the same images in another order (the same placeholder total) put features on the wrong tokens
        order, starts = [1, 0, 3, 2], np.cumsum([0] + [int(np.prod(g)) for g in grids])
        moved = np.concatenate([patches[starts[k]:starts[k + 1]] for k in order])
        vision = _vision_inputs([grids[k] for k in order], moved, cfg)
        wrong = np.asarray(_logprobs(model, jnp.asarray(tokens), jnp.asarray(positions), vision))
        assert np.abs(wrong - want).max() > 1.0


def test_image_and_video_in_one_row_match_transformers(vlm):
    """An image, then a 2-frame video (timestamp text before each frame): one VisionInputs holds both in
    placeholder order; transformers takes them as pixel_values and pixel_values_videos."""
    from qwen35_jax.data.mrope import expand_video_placeholders

    _, model, cfg, ref = vlm
    rng = np.random.default_rng(7)
    image, video = (1, 2, 4), (2, 2, 4)
    head = _row(rng, [3, image, 2]) + [START, VIDEO, END] + rng.integers(0, 100, 3).tolist()
    tokens = np.asarray([expand_video_placeholders(head, [video], [[0.5, 1.5]], video_token_id=VIDEO,
                                                   vision_start_id=START, vision_end_id=END, merge_size=2,
                                                   encode=lambda text: [ord(c) % 100 for c in text])], np.int32)
    assert (tokens == VIDEO).sum() == 4 and (tokens == IMAGE).sum() == 2
    positions = mrope_positions(tokens[0], [image], video_grids_thw=[video], image_token_id=IMAGE,
                                video_token_id=VIDEO, merge_size=2)[0][:, None]  # [3, 1, S]
    patches = rng.standard_normal((8 + 16, 96))
    vision = build_vision_inputs([(patches[:8], image), (patches[8:], video)], cfg.vision)
    check_vision_tokens(tokens, vision, cfg)
    got = np.asarray(_logprobs(model, jnp.asarray(tokens), jnp.asarray(positions), vision))
    ids = torch.from_numpy(tokens).long()
    types = torch.from_numpy((tokens == IMAGE) + 2 * (tokens == VIDEO)).long()
    with torch.no_grad():
        pos, _ = ref.model.get_rope_index(ids, types, image_grid_thw=torch.tensor([image]),
                                          video_grid_thw=torch.tensor([video]))
    np.testing.assert_array_equal(pos.numpy(), positions)
    with torch.no_grad(), torch_float64():
        want = torch.log_softmax(ref(input_ids=ids, position_ids=pos, pixel_values=torch.from_numpy(patches[:8]),
                                     image_grid_thw=torch.tensor([image]),
                                     pixel_values_videos=torch.from_numpy(patches[8:]),
                                     video_grid_thw=torch.tensor([video])).logits, -1).numpy()
    np.testing.assert_allclose(got, want, atol=LOGPROB_ATOL, rtol=0)


def test_gradient_of_tower_weights_matches_torch_autograd(vlm):
    _, model, cfg, ref = vlm
    tokens, grids, positions, patches = _batch(CASES["two_rows"], seed=1)
    weights = np.random.default_rng(2).standard_normal((*tokens.shape, VOCAB))
    vision = _vision_inputs(grids, patches, cfg)
    graphdef, params = nnx.split(model)

    @jax.jit
    def grad(params):
        def scalar(params):
            m = nnx.merge(graphdef, params)
            logits = m.logits(m(jnp.asarray(tokens), positions=jnp.asarray(positions), vision=vision))
            return jnp.sum(jax.nn.log_softmax(logits, axis=-1) * weights)
        return jax.grad(scalar)(params)

    g = grad(params)["visual"]
    g_qkv = np.asarray(g["blocks"]["attn"]["qkv"]["kernel"][...])  # [depth, D, 3D]
    g_patch = np.asarray(g["patch_embed"]["proj"]["kernel"][...])  # [patch_dim, D]
    g_fc2 = np.asarray(g["merger"]["linear_fc2"]["kernel"][...])  # [4D, out]
    ref.zero_grad()
    kw = _ref_kwargs(ref, tokens, grids, patches, positions)
    with torch_float64():
        (torch.log_softmax(ref(**kw).logits, -1) * torch.from_numpy(weights)).sum().backward()
    visual = ref.model.visual
    pairs = [(g_qkv[i], visual.blocks[i].attn.qkv.weight.grad.numpy().T) for i in range(VISION["depth"])]
    pairs += [(g_patch, visual.patch_embed.proj.weight.grad.numpy().reshape(VISION["hidden_size"], -1).T),
              (g_fc2, visual.merger.linear_fc2.weight.grad.numpy().T)]
    for ours, want in pairs:
        assert np.abs(want).max() > 1e-3  # the images reach the loss
        np.testing.assert_allclose(ours, want, rtol=0, atol=GRAD_RTOL * np.abs(want).max())


def test_cache_prefill_and_mrope_decode_match_the_full_forward(vlm):
    """Prefill with the images through the cache, then a decode step at mrope position next_position."""
    from qwen35_jax.layers.cache import init_cache

    _, model, cfg, _ = vlm
    tokens, grids, positions, patches = _batch(CASES["two_rows"], seed=4)
    vision = _vision_inputs(grids, patches, cfg)
    b, s = tokens.shape
    nxt = positions.max(axis=(0, 2)) + 1  # [B]: each row's next position, on all three axes
    full_tokens = np.concatenate([tokens, np.full((b, 1), 7, np.int32)], 1)
    full_pos = np.concatenate([positions, np.broadcast_to(nxt[None, :, None], (3, b, 1))], 2)
    want = np.asarray(_logprobs(model, jnp.asarray(full_tokens), jnp.asarray(full_pos), vision))

    @nnx.jit
    def prefill_and_decode(model, cache):
        h, cache = model(jnp.asarray(tokens), positions=jnp.asarray(positions), cache=cache, vision=vision)
        h2, _ = model(jnp.asarray(full_tokens[:, -1:]), positions=jnp.asarray(full_pos[:, :, -1:]), cache=cache)
        return jax.nn.log_softmax(model.logits(jnp.concatenate([h, h2], 1)), -1)

    got = np.asarray(prefill_and_decode(model, init_cache(cfg, b, 32)))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_text_only_batches_have_no_tower_in_the_program(vlm):
    _, model, cfg, _ = vlm
    tokens, grids, positions, patches = _batch(CASES["one_image"])
    vision = _vision_inputs(grids, patches, cfg)
    graphdef, visual, rest = nnx.split(model, nnx.PathContains("visual"), ...)
    n_visual = len(jax.tree.leaves(visual))

    def used_visual_inputs(vision_inputs) -> int:
        def f(visual, rest):
            return nnx.merge(graphdef, visual, rest)(jnp.asarray(tokens), jnp.asarray(positions), vision=vision_inputs)
        jaxpr = jax.make_jaxpr(f)(visual, rest).jaxpr
        used = {v for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, jax.extend.core.Var)}
        used |= {v for v in jaxpr.outvars if isinstance(v, jax.extend.core.Var)}
        return sum(v in used for v in jaxpr.invars[:n_visual])

    assert used_visual_inputs(None) == 0
    assert used_visual_inputs(vision) == n_visual


def test_config_round_trips_and_text_only(vlm):
    path, _, cfg, _ = vlm
    assert cfg.vision is not None and cfg.vision.depth == 2 and cfg.image_token_id == IMAGE
    assert cfg.hf_model_type == "qwen3_5" and Qwen35Config.from_hf(cfg.to_hf_dict()) == cfg
    d = cfg.to_hf_dict()
    hf = tf.AutoConfig.for_model(d.pop("model_type"), **{k: v for k, v in d.items() if k != "architectures"})
    assert isinstance(hf, tf.Qwen3_5Config) and hf.vision_config.depth == 2 and hf.image_token_id == IMAGE
    assert Qwen35Config.from_hf(hf) == cfg
    assert cfg.text_only().vision is None and inspect_hf(path).config.vision is None  # the library default
    moe = Qwen35Config.preset("35B-A3B")
    assert moe.vision.out_hidden_size == moe.hidden_size
    assert moe.to_hf_dict()["vision_config"]["model_type"] == "qwen3_5_moe_vision"
    assert Qwen35Config.from_hf(moe.to_hf_dict()) == moe
    with pytest.raises(ValueError, match=r"^vision.out_hidden_size \(64\) must equal the text hidden_size \(32\)$"):
        cfg.replace(vision=cfg.vision.replace(out_hidden_size=64)).check_vision_fits()
    with pytest.raises(ValueError, match="a vision tower needs a VLM model type"):
        cfg.replace(hf_model_type="qwen3_5_text")


def test_token_count_mismatch_is_a_one_line_error(vlm):
    _, _, cfg, _ = vlm
    tokens, grids, _, patches = _batch(CASES["two_rows"])
    with pytest.raises(ValueError, match=r"^the tokens hold 13 image/video placeholder tokens but the vision "
                                         r"inputs make 9 feature rows$"):
        check_vision_tokens(tokens, _vision_inputs(grids[:3], patches[:36], cfg), cfg)
    with pytest.raises(ValueError, match=r"^the tokens hold 13 image/video placeholder tokens but no vision"):
        check_vision_tokens(tokens, None, cfg)
    with pytest.raises(ValueError, match=r"^image 1 \(grid 1x2x2\) has patches of shape \(3, 96\), expected \(4, 96\)$"):
        build_vision_inputs([(patches[:24], (1, 4, 6)), (patches[24:27], (1, 2, 2))], cfg.vision)


def test_import_export_bit_exact_and_transformers_loads_it(vlm, tmp_path):
    """HF -> load_hf(text_only=False) -> our checkpoint -> export_hf: every tensor back bit for bit (tower
    included), the same config.json, and transformers loads it as Qwen3_5ForConditionalGeneration."""
    path, _, _, _ = vlm
    model, config, ckpt = load_hf(path, text_only=False)
    assert not ckpt.skipped and any(e.path.startswith("visual.") for e in ckpt.table)
    save_checkpoint(str(tmp_path / "ours"), model, config, layout=ckpt.layout, hf_config=ckpt.raw_config)
    model2, config2, meta = load_checkpoint(str(tmp_path / "ours"))
    assert config2 == config and model2.visual is not None
    out = str(tmp_path / "back")
    export_hf(nnx.state(model2, nnx.Param), config2, out, layout=N.Layout.from_dict(meta["layout"]),
              hf_config=meta["hf_config"])
    assert all_tensors(out) == all_tensors(path)
    with open(os.path.join(path, "config.json")) as f, open(os.path.join(out, "config.json")) as g:
        assert json.load(f) == json.load(g)
    loaded, info = tf.AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert type(loaded).__name__ == "Qwen3_5ForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # a VLM made from scratch: transformers' own layout and config.json
    scratch = str(tmp_path / "scratch")
    export_hf(nnx.state(model2, nnx.Param), config2, scratch)
    assert all_tensors(scratch) == all_tensors(path)
    loaded, info = tf.AutoModelForImageTextToText.from_pretrained(scratch, output_loading_info=True)
    assert type(loaded).__name__ == "Qwen3_5ForConditionalGeneration" and not info["missing_keys"]


def test_checkpoint_without_tower_tensors_needs_text_only(vlm, tmp_path, capsys):
    path, _, _, _ = vlm
    src = shutil.copytree(path, str(tmp_path / "no_tower"))
    edit_tensors(src, lambda t: {k: v for k, v in t.items() if not k.startswith("model.visual.")})
    with pytest.raises(ValueError, match=r"config.json has a vision_config but the checkpoint has no model\.visual\.\* "
                                         r"tensors; import it with --text-only"):
        load_hf(src, text_only=False)
    imp = load_script("import_hf")
    assert imp.main([src, str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--text-only" in err
    assert imp.main([src, str(tmp_path / "b"), "--text-only"]) == 0
    assert "no vision tower" in capsys.readouterr().out
    assert load_checkpoint(str(tmp_path / "b"))[1].vision is None


def test_mesh_2x4_matches_single_device(vlm, mesh_2x4):
    """fsdp=2, sp=4, every parameter ZeRO-3 split (small-weight threshold off, so the tiny tower splits too):
    S = 21 is padded to whole sequence shards ([3, B, S] positions too) and the placeholders' rows are found
    on the whole batch before the sequence split."""
    from jax.sharding import NamedSharding

    from qwen35_jax.parallel.mesh import param_spec

    _, model, cfg, ref = vlm
    tokens, grids, positions, patches = _batch([[5, (1, 4, 6), 3, (1, 2, 2), 2], [5, (1, 2, 4), 2, (1, 4, 4), 4]],
                                               seed=5)
    assert tokens.shape == (2, 21)
    vision = _vision_inputs(grids, patches, cfg)
    single = _ours(model, cfg, tokens, grids, positions, patches)
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh_2x4):
        def spec(path, x):
            stacked = int(any(getattr(k, "key", None) == "blocks" for k in path))
            return NamedSharding(mesh_2x4, param_spec(x.shape, 8, skip_dims=stacked, min_size=1))

        sharded = jax.device_put(state, jax.tree_util.tree_map_with_path(spec, state))

        @jax.jit
        def run(state, tokens, positions, vision):
            m = nnx.merge(graphdef, state)
            hidden = m(tokens, positions=positions, vision=vision)
            return hidden, jax.nn.log_softmax(m.logits(hidden), axis=-1)

        _, got = run(sharded, jnp.asarray(tokens), jnp.asarray(positions), vision)
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(sharded["visual"]))
    # float32 on both sides, summed in other orders and split differently: measured 1.4e-6
    np.testing.assert_allclose(np.asarray(got), single, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(got), _ref(ref, tokens, grids, patches, positions), atol=LOGPROB_ATOL, rtol=0)



MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)


def test_moe_vlm_import_export_bit_exact(tmp_path):
    """Qwen3_5MoeForConditionalGeneration (its vision_config's model_type is qwen3_5_moe_vision): the tower
    and the experts imported, and exported back bit for bit."""
    config = tf.Qwen3_5MoeConfig(text_config={**TEXT, **MOE}, vision_config=VISION, **IDS)
    model = tf.Qwen3_5MoeForConditionalGeneration._from_config(config)
    _init(model)
    src = str(tmp_path / "hf")
    model.float().save_pretrained(src)
    ours, cfg, ckpt = load_hf(src, text_only=False)
    assert cfg.is_moe and cfg.vision.depth == 2 and cfg.hf_model_type == "qwen3_5_moe"
    assert ours.visual is not None and not ckpt.skipped
    out = str(tmp_path / "back")
    export_hf(nnx.state(ours, nnx.Param), cfg, out, layout=ckpt.layout, hf_config=ckpt.raw_config)
    assert all_tensors(out) == all_tensors(src)
