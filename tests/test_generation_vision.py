"""Generation from prompts with images (a tiny random VLM): greedy tokens are transformers'
`Qwen3_5ForConditionalGeneration.generate(do_sample=False)` run in float64 and its float64 argmax at every
step, one prompt alone and two prompts with images of different sizes in one batch (transformers pads on
the left, we on the right); each decoded token's log-prob is what a full forward of prompt + completion
(vision + mrope positions) gives it, as RL's trainer computes it; text prompts to a VLM take the text
programs; bad inputs are one-line errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch.utils._python_dispatch import _disable_current_modes

from float64_reference import torch_float64
from qwen35_jax.data.mrope import decode_positions, expand_image_placeholders, mrope_positions
from qwen35_jax.generation import generate
from qwen35_jax.hf.load import load_hf
from qwen35_jax.vision.inputs import build_vision_inputs
from test_vlm import END, IMAGE, START, VIDEO, write_hf_vlm

PATCH_DIM = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch
STEPS = 8
# Our float32 decode log-prob vs the float64 truth: as test_vlm's full forward (measured there 1.8e-6).
LOGPROB_ATOL = 2e-5
# Decode (per-token recurrence, one query against the cache) vs our full forward, both float32, as
# tests/test_generation.py: float32 rounding.
SAME_MODEL_ATOL = 1e-5


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory):
    """(our VLM, the same weights without the tower, the float64 transformers model)."""
    path = str(tmp_path_factory.mktemp("vlm") / "hf")
    ref = write_hf_vlm(path)
    rope_index = ref.model.get_rope_index

    def integer_rope_index(*args, **kwargs):  # integer positions; it makes float32 on the way, refused in float64
        with _disable_current_modes():
            return rope_index(*args, **kwargs)

    ref.model.get_rope_index = integer_rope_index
    ours, cfg, _ = load_hf(path, text_only=False)
    text, text_cfg, _ = load_hf(path)
    assert cfg.vision is not None and text_cfg.vision is None
    return ours, text, ref


def _prompt(rng: np.random.Generator, pieces: list) -> list[int]:
    """ints: that many random text tokens; grids: one image, its pad run wrapped in vision start/end."""
    out = []
    for p in pieces:
        out += (rng.integers(0, 100, p).tolist() if isinstance(p, int)
                else [START] + expand_image_placeholders([IMAGE], [p], IMAGE, 2) + [END])
    return out


def _case(seed: int, rows: list[list]) -> tuple[list[list[int]], list[tuple[np.ndarray, np.ndarray]]]:
    """Prompts and their images (patches float32 [P, patch_dim], grids [N, 3]) from pieces."""
    rng = np.random.default_rng(seed)
    prompts, images = [], []
    for pieces in rows:
        prompts.append(_prompt(rng, pieces))
        grids = np.asarray([p for p in pieces if not isinstance(p, int)], np.int64).reshape(-1, 3)
        patches = rng.standard_normal((int(np.prod(grids, axis=1).sum()), PATCH_DIM)).astype(np.float32)
        images.append((patches, grids))
    return prompts, images


def _positions(ids: list[int], grids: np.ndarray) -> tuple[np.ndarray, int]:
    return mrope_positions(ids, grids if len(grids) else None, image_token_id=IMAGE, video_token_id=VIDEO,
                           merge_size=2)


@nnx.jit
def _full_logprobs(model, tokens, positions, segment_ids, vision):
    return jax.nn.log_softmax(model.logits(model(tokens, positions=positions, segment_ids=segment_ids,
                                                 vision=vision)), axis=-1)


def _ours_full(model, prompts, images, completions) -> list[np.ndarray]:
    """Our full forward of every prompt + completion in one right-padded batch (the trainer's view):
    per row the log-probs [len(completion), V] that predict its completion tokens."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    b, s = len(seqs), max(len(x) for x in seqs)
    tokens, segment_ids = np.zeros((b, s), np.int32), np.zeros((b, s), np.int32)
    positions = np.zeros((3, b, s), np.int32)
    for j, (prompt, seq, (_, grids)) in enumerate(zip(prompts, seqs, images)):
        pos, nxt = _positions(prompt, grids)
        tokens[j, :len(seq)], segment_ids[j, :len(seq)] = seq, 1
        positions[:, j, :len(seq)] = np.concatenate([pos, decode_positions(nxt, len(seq) - len(prompt))], axis=1)
    vision = build_vision_inputs([(patches[a:z], g) for patches, grids in images
                                  for a, z, g in zip(np.cumsum([0, *np.prod(grids, 1)])[:-1],
                                                     np.cumsum(np.prod(grids, 1)), grids)], model.config.vision)
    out = np.asarray(_full_logprobs(model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids),
                                    vision))
    return [out[j, len(p) - 1:len(p) - 1 + len(c)] for j, (p, c) in enumerate(zip(prompts, completions))]


def _hf_generate(ref, prompts, images) -> list[list[int]]:
    """transformers' greedy generate in float64 on the batch left-padded, as its processor pads."""
    n = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (n - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    pixels = torch.from_numpy(np.concatenate([p for p, _ in images])).double()
    grids = torch.from_numpy(np.concatenate([g for _, g in images]))
    with torch.no_grad(), torch_float64():
        out = ref.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids,
                           mm_token_type_ids=(ids == IMAGE).long(), do_sample=False, max_new_tokens=STEPS,
                           min_new_tokens=STEPS, pad_token_id=0)
    return out[:, n:].tolist()


def _hf_full(ref, prompt, completion, patches, grids) -> np.ndarray:
    """transformers' float64 log-probs [len(completion), V] predicting the completion, one row alone."""
    seq = torch.tensor([prompt + completion])
    with torch.no_grad():
        pos, _ = ref.model.get_rope_index(seq, (seq == IMAGE).long(), image_grid_thw=torch.from_numpy(grids))
    pixels = torch.from_numpy(patches).double()
    with torch.no_grad(), torch_float64():
        logits = ref(input_ids=seq, position_ids=pos, pixel_values=pixels, image_grid_thw=torch.from_numpy(grids)).logits[0]
    return torch.log_softmax(logits, dim=-1).numpy()[len(prompt) - 1:len(prompt) - 1 + len(completion)]


def test_greedy_image_prompts_are_transformers_float64_generate(vlm):
    """One prompt with an image alone; two prompts of different lengths whose images differ in size (6, and
    8 + 1 pads) in one batch."""
    model, _, ref = vlm
    one, one_images = _case(1, [[3, (1, 4, 6), 5]])
    two, two_images = _case(2, [[4, (1, 4, 6), 3], [2, (1, 8, 4), 9, (1, 2, 2), 1]])
    out = []
    for prompts, images in ((one, one_images), (two, two_images)):
        got = generate(model, prompts, max_new_tokens=STEPS, temperature=0, images=images)
        assert [c.completion_ids for c in got] == _hf_generate(ref, prompts, images)
        assert all(len(c.completion_ids) == STEPS and c.finish_reason == "length" for c in got)
        out += got
    prompts, images = one + two, one_images + two_images
    trainer = _ours_full(model, prompts, images, [c.completion_ids for c in out])  # one batch of all three
    at = np.arange(STEPS)
    for prompt, c, (patches, grids), mine in zip(prompts, out, images, trainer):
        want = _hf_full(ref, prompt, c.completion_ids, patches, grids)
        assert np.all(want[at, c.completion_ids] == want.max(axis=-1))  # float64's argmax at every step
        np.testing.assert_allclose(c.log_probs, want[at, c.completion_ids], atol=LOGPROB_ATOL, rtol=0)
        # sampler == trainer: each token's decode log-prob is what the full forward gives it
        np.testing.assert_allclose(c.log_probs, mine[at, c.completion_ids], atol=SAME_MODEL_ATOL, rtol=0)
        print("MEASURE vs float64", np.abs(np.asarray(c.log_probs) - want[at, c.completion_ids]).max(),
              "vs full forward", np.abs(np.asarray(c.log_probs) - mine[at, c.completion_ids]).max())


def test_text_prompts_to_a_vlm_take_the_text_path(vlm):
    model, text, _ = vlm
    prompts, images = _case(3, [[9], [14], [3, (1, 4, 4), 2]])
    kw = dict(max_new_tokens=5, temperature=1.0, top_k=30, seed=4)  # keys follow the prompt index, not the batch
    alone = generate(text, prompts[:2], **kw)
    for got in (generate(model, prompts[:2], **kw), generate(model, prompts[:2], images=[None, None], **kw)):
        assert [(c.completion_ids, c.log_probs) for c in got] == [(c.completion_ids, c.log_probs) for c in alone]
    # in a batch with an image prompt the text rows run the vision programs (offset 0): the same tokens
    mixed = generate(model, prompts, images=[None, None, images[2]], **kw)
    for m, a in zip(mixed[:2], alone):
        assert m.completion_ids == a.completion_ids
        np.testing.assert_allclose(m.log_probs, a.log_probs, atol=SAME_MODEL_ATOL, rtol=0)


def test_bad_image_inputs_are_one_line_errors(vlm):
    model, text, _ = vlm
    prompts, images = _case(4, [[2, (1, 4, 6), 2]])
    with pytest.raises(ValueError, match=r"^prompt 0: has images but the model has no vision tower$"):
        generate(text, prompts, max_new_tokens=2, images=images)
    with pytest.raises(ValueError, match=r"^prompt 0: holds 6 image/video placeholder tokens but no images were given$"):
        generate(model, prompts, max_new_tokens=2)
    small = (images[0][0][:16], np.asarray([[1, 4, 4]]))
    with pytest.raises(ValueError, match=re.escape("prompt 0: image pad run at tokens 3..8 has 6 tokens but its grid "
                                                   "[1, 4, 4] needs 4 (merge_size 2)")):
        generate(model, prompts, max_new_tokens=2, images=[small])
    with pytest.raises(ValueError, match=re.escape("prompt 0: image patches have shape (23, 96), expected (24, 96)")):
        generate(model, prompts, max_new_tokens=2, images=[(images[0][0][:23], images[0][1])])
    with pytest.raises(ValueError, match="^images must be a list with one entry"):
        generate(model, prompts, max_new_tokens=2, images=images * 2)


def test_image_prompts_on_a_mesh_equal_one_device(vlm, mesh_2x4):
    """fsdp=2, sp=4, every parameter ZeRO-3 split: the prompts' sequences split over sp in the prefill (the
    images' rows found on the whole batch), the decode rows over all eight devices, each with its offset; two
    samples per prompt (6 rows padded to 8, each sample's row with its prompt's images)."""
    from qwen35_jax.parallel.mesh import shard_model

    model, _, _ = vlm
    prompts, images = _case(5, [[4, (1, 4, 6), 3], [6], [2, (1, 8, 4), 9, (1, 2, 2), 1]])
    kw = dict(max_new_tokens=4, temperature=1.0, seed=2, num_samples=2, images=images)  # images repeat per sample
    one = generate(model, prompts, **kw)
    graphdef, state = nnx.split(model)
    sharded = shard_model(nnx.merge(graphdef, jax.tree.map(jnp.copy, state)), mesh_2x4)
    got = generate(sharded, prompts, mesh=mesh_2x4, **kw)
    for g, o in zip(got, one):
        assert g.completion_ids == o.completion_ids
        np.testing.assert_allclose(g.log_probs, o.log_probs, atol=SAME_MODEL_ATOL, rtol=0)
