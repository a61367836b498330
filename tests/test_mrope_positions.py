"""qwen35_jax/data/mrope.py against transformers' Qwen3.5 itself: `Qwen3_5Model.get_rope_index` (called
unbound on a stand-in exposing the vision merge size), `compute_3d_position_ids` for decoding, and the
Qwen3-VL processor's placeholder expansion (`replace_image_token`, `replace_video_token`,
`get_text_with_replacements`, on a processor built without its image/video processors, which need
torchvision and downloads) followed by a small in-test BPE tokenizer."""

import functools
from types import SimpleNamespace

import numpy as np
import pytest

from qwen35_jax.data.mrope import (decode_position_offset, decode_positions, expand_image_placeholders,
                                   expand_video_placeholders, merged_token_count, mrope_positions,
                                   packed_mrope_positions, video_timestamps)

torch = pytest.importorskip("torch")
modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
processing = pytest.importorskip("transformers.models.qwen3_vl.processing_qwen3_vl")

MERGE = 2
SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


@functools.cache
def tokenizer():
    """A byte-level BPE with Qwen's vision special tokens, trained on a few lines (incl. timestamps)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Describe the picture in detail.", "What happens in this video?\n", "<0.8 seconds> <3.8 seconds>",
              "<12.5 seconds> and then <1.0 seconds>", "Compare the two images: left and right."] * 4
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


def tid(token: str) -> int:
    return tokenizer().token_to_id(token)


def ids_of(text: str) -> list[int]:
    return tokenizer().encode(text).ids


def kw() -> dict:
    return {"image_token_id": tid("<|image_pad|>"), "video_token_id": tid("<|video_pad|>"), "merge_size": MERGE}


def hf_processor():
    proc = processing.Qwen3VLProcessor.__new__(processing.Qwen3VLProcessor)
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.vision_start_token, proc.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    proc.image_processor = SimpleNamespace(merge_size=MERGE)
    proc.video_processor = SimpleNamespace(merge_size=MERGE, temporal_patch_size=2)
    return proc


def hf_expand(text: str, image_grids=None, videos=None) -> list[int]:
    """The processor's expanded text, tokenized. videos: [(grid_thw, frames_indices, fps)]."""
    proc = hf_processor()
    image_reps, video_reps = [], []
    if image_grids is not None:
        inputs = {"image_grid_thw": torch.tensor(image_grids)}
        image_reps = [proc.replace_image_token(inputs, i) for i in range(len(image_grids))]
    if videos:
        inputs = {"video_grid_thw": torch.tensor([g for g, _, _ in videos]),
                  "video_metadata": [SimpleNamespace(fps=fps, frames_indices=list(idx)) for _, idx, fps in videos]}
        video_reps = [proc.replace_video_token(inputs, i) for i in range(len(videos))]
    (expanded,), _ = proc.get_text_with_replacements([text], image_reps, video_reps)
    return ids_of(expanded)


def stand_in():
    """What get_rope_index / compute_3d_position_ids read from a Qwen3_5Model."""
    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=MERGE)),
                            rope_deltas=None)
    model.get_vision_position_ids = functools.partial(modeling.Qwen3_5Model.get_vision_position_ids, model)
    model.get_rope_index = functools.partial(modeling.Qwen3_5Model.get_rope_index, model)
    return model


def hf_types(tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([tokens])
    return (ids == tid("<|image_pad|>")).int() + 2 * (ids == tid("<|video_pad|>")).int()


def hf_rope_index(tokens: list[int], image_grids=None, video_grids=None) -> tuple[np.ndarray, int]:
    positions, delta = modeling.Qwen3_5Model.get_rope_index(
        stand_in(), torch.tensor([tokens]), hf_types(tokens),
        image_grid_thw=None if image_grids is None else torch.tensor(image_grids),
        video_grid_thw=None if video_grids is None else torch.tensor(video_grids))
    return positions[:, 0].numpy(), int(delta)


def check_against_hf(text: str, image_grids=None):
    tokens = hf_expand(text, image_grids)
    raw = ids_of(text)
    if image_grids is not None:
        assert expand_image_placeholders(raw, np.array(image_grids), tid("<|image_pad|>"), MERGE) == tokens
    positions, next_position = mrope_positions(tokens, None if image_grids is None else np.array(image_grids),
                                               **kw())
    want, delta = hf_rope_index(tokens, image_grids)
    assert positions.dtype == np.int32 and positions.shape == (3, len(tokens))
    np.testing.assert_array_equal(positions, want)
    assert decode_position_offset(next_position, len(tokens)) == delta
    return tokens, positions, next_position


def test_text_only_is_plain_positions():
    tokens, positions, next_position = check_against_hf("Describe the picture in detail.")
    np.testing.assert_array_equal(positions, np.broadcast_to(np.arange(len(tokens)), (3, len(tokens))))
    assert next_position == len(tokens)


def test_one_non_square_image_mid_text():
    grids = [[1, 4, 10]]  # merged 2 x 5: text after resumes at +5, not +10
    tokens, positions, next_position = check_against_hf(
        "Describe <|vision_start|><|image_pad|><|vision_end|> in detail.", grids)
    image = np.flatnonzero(np.array(tokens) == tid("<|image_pad|>"))
    assert len(image) == 10
    start = image[0]
    np.testing.assert_array_equal(positions[0, image], start)
    np.testing.assert_array_equal(positions[1, image], start + np.repeat(np.arange(2), 5))
    np.testing.assert_array_equal(positions[2, image], start + np.tile(np.arange(5), 2))
    assert positions[0, image[-1] + 1] == start + 5
    assert next_position == len(tokens) - 10 + 5


def test_two_images_of_different_sizes():
    check_against_hf("Compare<|vision_start|><|image_pad|><|vision_end|> and "
                     "<|vision_start|><|image_pad|><|vision_end|>: left and right.", [[1, 6, 4], [1, 2, 8]])


def test_images_at_the_very_start_and_end():
    check_against_hf("<|image_pad|>Compare the two images<|image_pad|>", [[1, 4, 4], [1, 6, 2]])
    check_against_hf("<|image_pad|>", [[1, 8, 2]])  # nothing but an image


def test_image_with_several_frames():
    # an image grid with t > 1 (t-axis current + frame; the text resumes by max(h, w) // merge only)
    check_against_hf("a <|vision_start|><|image_pad|><|vision_end|> b", [[3, 2, 2]])


def test_video_frames_and_timestamps():
    videos = [([3, 4, 6], [0, 4, 8, 12, 16], 4.0), ([2, 2, 2], [0, 30, 60, 90], None)]
    text = ("What happens in this video?\n<|vision_start|><|video_pad|><|vision_end|> then "
            "<|image_pad|> and\n<|video_pad|>")
    image_grids = [[1, 2, 4]]
    tokens = hf_expand(text, image_grids, videos)
    times = [video_timestamps(idx, fps, temporal_patch_size=2) for _, idx, fps in videos]
    assert [f"{t:.1f}" for t in times[0]] == ["0.5", "2.5", "4.0"]  # last index padded, then averaged
    grids = np.array([g for g, _, _ in videos])
    ours = expand_video_placeholders(ids_of(text), grids, times, video_token_id=tid("<|video_pad|>"),
                                     vision_start_id=tid("<|vision_start|>"), vision_end_id=tid("<|vision_end|>"),
                                     merge_size=MERGE, encode=ids_of)
    ours = expand_image_placeholders(ours, np.array(image_grids), tid("<|image_pad|>"), MERGE)
    assert ours == tokens
    positions, next_position = mrope_positions(tokens, np.array(image_grids), video_grids_thw=grids, **kw())
    want, delta = hf_rope_index(tokens, image_grids, grids.tolist())
    np.testing.assert_array_equal(positions, want)
    assert next_position - len(tokens) == delta


def test_packed_documents_each_with_images():
    docs = [("Describe <|vision_start|><|image_pad|><|vision_end|> in detail.", [[1, 4, 6]]),
            ("<|image_pad|> left and <|image_pad|> right", [[1, 2, 2], [1, 6, 4]]),
            ("Describe the picture in detail.", None)]
    expanded = [hf_expand(text, grids) for text, grids in docs]
    pad = 3
    tokens = np.concatenate([np.array(t) for t in expanded] + [np.full(pad, tid("<|image_pad|>"))])
    segment_ids = np.concatenate([np.full(len(t), i + 1) for i, t in enumerate(expanded)] + [np.zeros(pad, int)])
    all_grids = np.array([g for _, grids in docs if grids for g in grids])
    positions = packed_mrope_positions(tokens, segment_ids, all_grids, **kw())
    want = np.concatenate([hf_rope_index(t, grids)[0] for t, (_, grids) in zip(expanded, docs)]
                          + [np.broadcast_to(np.arange(pad), (3, pad))], axis=1)
    assert positions.dtype == np.int32
    np.testing.assert_array_equal(positions, want)

    # padding and text follow the model's convention (document_positions), padding at the start too
    from qwen35_jax.model import default_positions

    seg = np.array([0, 0, 1, 1, 1, 2, 2, 0, 0, 0])
    text = packed_mrope_positions(np.arange(10) + 100, seg, None, **kw())
    model = np.asarray(default_positions(seg[None].shape, seg[None], None))[0]
    np.testing.assert_array_equal(text, np.broadcast_to(model, (3, 10)))


def test_decode_continues_like_compute_3d_position_ids():
    grids = [[1, 4, 10], [1, 2, 2]]
    tokens = hf_expand("Describe <|vision_start|><|image_pad|><|vision_end|> and <|image_pad|>.", grids)
    positions, next_position = mrope_positions(tokens, np.array(grids), **kw())
    model = stand_in()
    compute = functools.partial(modeling.Qwen3_5Model.compute_3d_position_ids, model)
    prefill = compute(input_ids=torch.tensor([tokens]), inputs_embeds=None, image_grid_thw=torch.tensor(grids),
                      mm_token_type_ids=hf_types(tokens))
    np.testing.assert_array_equal(prefill[:, 0].numpy(), positions)
    length = len(tokens)
    for step in range(3):  # one generated token at a time, with `length + step` tokens cached
        cache = SimpleNamespace(get_seq_length=lambda n=length + step: n)
        got = compute(input_ids=torch.tensor([[7]]), inputs_embeds=torch.zeros(1, 1, 4), cache=cache)
        np.testing.assert_array_equal(got[:, 0].numpy(), decode_positions(next_position + step, 1))
        offset = decode_position_offset(next_position, length)
        assert int(got[0, 0, 0]) == length + step + offset
    several = compute(input_ids=torch.tensor([[7, 8, 9]]), inputs_embeds=torch.zeros(1, 3, 4),
                      cache=SimpleNamespace(get_seq_length=lambda: length))
    np.testing.assert_array_equal(several[:, 0].numpy(), decode_positions(next_position, 3))


def test_expansion_counts():
    pad = tid("<|image_pad|>")
    assert merged_token_count([2, 4, 6], MERGE) == 12
    assert expand_image_placeholders([105, pad, pad, 106], np.array([[1, 2, 2], [1, 2, 4]]), pad, MERGE) == \
        [105, pad, pad, pad, 106]
    with pytest.raises(ValueError, match="^2 image placeholder tokens but 1 image grids$"):
        expand_image_placeholders([pad, 101, pad], np.array([[1, 2, 2]]), pad, MERGE)
    with pytest.raises(ValueError, match="^0 image placeholder tokens but 1 image grids$"):
        expand_image_placeholders([101, 102], np.array([[1, 2, 2]]), pad, MERGE)
    with pytest.raises(ValueError, match="divisible by merge_size 2"):
        expand_image_placeholders([pad], np.array([[1, 3, 2]]), pad, MERGE)


def test_position_errors():
    pad = tid("<|image_pad|>")
    run4 = [101] + [pad] * 4 + [102]
    grid = np.array([[1, 4, 4]])
    mrope_positions(run4, grid, **kw())
    with pytest.raises(ValueError, match="^more image placeholder runs than the 1 image grids$"):
        mrope_positions(run4 + run4, grid, **kw())
    with pytest.raises(ValueError, match="^1 image placeholder runs but 2 image grids$"):
        mrope_positions(run4, np.concatenate([grid, grid]), **kw())
    with pytest.raises(ValueError, match=r"^image pad run at tokens 1\.\.3 has 3 tokens but its grid \[1, 4, 4\]"):
        mrope_positions([101, pad, pad, pad, 102], grid, **kw())
    with pytest.raises(ValueError, match="divisible by merge_size 2"):
        mrope_positions(run4, np.array([[1, 4, 5]]), **kw())
    with pytest.raises(ValueError, match="^more video frame placeholder runs than the 0 video frame grids$"):
        mrope_positions([101, tid("<|video_pad|>")], None, **kw())
    # packed: a document cut inside an image (row split by packing) and the row's error offset
    with pytest.raises(ValueError, match=r"tokens 7\.\.8 has 2 tokens"):
        packed_mrope_positions(run4 + [101, pad, pad], [1] * 6 + [2] * 3, np.concatenate([grid, grid]), **kw())
