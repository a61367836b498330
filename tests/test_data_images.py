"""Image data: the processor matches transformers' PIL Qwen2-VL processor, chat rows with images expand
their pads to the images' grids and never train on them, bad images name their path, and prepared data
keeps every image whole and its patches bit-exact."""

import copy
import json
import os
import pickle

import numpy as np
import pytest
from PIL import Image

from data_testutil import demo_tokenizer, write_jsonl
from qwen35_jax.data.demo.tokenizer import CHAT_TEMPLATE, VISION_CHAT_TEMPLATE, VISION_TOKENS
from qwen35_jax.data.image_rows import IMAGE_PAD, RowImages, expand_images, image_loss_mask, image_spans
from qwen35_jax.data.images import (QWEN35_MAX_PIXELS, QWEN35_MIN_PIXELS, ImageError, ImageProcessor,
                                    load_image)
from qwen35_jax.data.mrope import merged_token_count, mrope_positions, packed_mrope_positions
from qwen35_jax.data.packing import fit_images_to_length
from qwen35_jax.data.prepare import describe, prepare_dataset
from qwen35_jax.data.prepared import open_prepared, prepared_row_images
from qwen35_jax.data.rows import BadRow, PromptEncoder, RowEncoder, load_tokenizer, prediction_mask
from qwen35_jax.vision.config import VisionConfig

VOCAB = 512  # the demo tokenizer's 256 tokens plus the three vision tokens
TINY = VisionConfig.preset("tiny")  # patch 4, temporal 2, merge 2: 8-pixel grid cells, patch_dim 96
MIN_PIXELS, MAX_PIXELS = 512, 4096  # 32 .. 256 patches of 4 x 4


def vision_tokenizer():
    """(a copy of the demo tokenizer with VISION_TOKENS added and VISION_CHAT_TEMPLATE, their ids (start, pad, end))."""
    tok = copy.deepcopy(demo_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = VISION_CHAT_TEMPLATE
    return tok, tuple(tok.convert_tokens_to_ids(VISION_TOKENS))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    assert VISION_CHAT_TEMPLATE != CHAT_TEMPLATE
    tok, _ = vision_tokenizer()
    path = str(tmp_path_factory.mktemp("vision-tokenizer"))
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def processor():
    return ImageProcessor.from_vision_config(TINY, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def _image(height: int, width: int, seed: int, mode: str = "RGB") -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 4), dtype=np.uint8)
    return Image.fromarray(pixels, "RGBA").convert(mode)


def _save(directory, name: str, height: int, width: int, seed: int) -> str:
    os.makedirs(directory, exist_ok=True)
    _image(height, width, seed).save(os.path.join(directory, name))
    return name


# (height, width): non-square, one below min_pixels (upscaled), one above max_pixels (downscaled)
SIZES = [(30, 50), (71, 23), (9, 13), (150, 110)]


def test_patches_and_grids_equal_transformers_pil_processor(processor, tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    images = [_image(h, w, i) for i, (h, w) in enumerate(SIZES)] + [_image(20, 40, 9, "RGBA"), _image(40, 24, 8, "L")]
    reference = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=MIN_PIXELS,
                                         max_pixels=MAX_PIXELS, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    expected = reference(images=images)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 4, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "size": {"shortest_edge": 1, "longest_edge": 10 ** 9}}))
    from_json = ImageProcessor.from_pretrained(str(tmp_path), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, vision=TINY)
    for proc in (processor, from_json):
        patches, grids = proc.process(images)
        assert patches.dtype == np.float32 and patches.shape == (int(np.prod(grids, axis=1).sum()), TINY.patch_dim)
        np.testing.assert_array_equal(patches, expected["pixel_values"])
        np.testing.assert_array_equal(grids, expected["image_grid_thw"])
    areas = [h * w * 16 for _, h, w in grids.tolist()]
    assert areas[2] >= MIN_PIXELS > 9 * 13 and areas[3] <= MAX_PIXELS < 150 * 110  # the bounds were applied
    assert [processor.grid_thw(h, w) for h, w in SIZES] == [tuple(g) for g in grids[:4].tolist()]


def test_patch_order_is_merge_windows_of_the_resized_normalized_image(processor):
    image = _image(30, 50, 0)
    patches, [(t, h, w)] = processor.process([image])
    p, m = processor.patch_size, processor.merge_size
    x = patches.reshape(h // m, w // m, m, m, 3, 2, p, p)  # windows, in-window row/col, C, T, p, p
    np.testing.assert_array_equal(x[:, :, :, :, :, 0], x[:, :, :, :, :, 1])  # the frame repeated over T
    pixels = x[:, :, :, :, :, 0].transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, h * p, w * p)
    resized = np.asarray(image.resize((w * p, h * p), Image.BICUBIC), np.float32).transpose(2, 0, 1)
    np.testing.assert_allclose(pixels, (resized / 255 - 0.5) / 0.5, atol=1e-6)


def test_qwen35_defaults_overrides_and_checks(tmp_path):
    real = ImageProcessor.from_vision_config(VisionConfig.preset("0.8B"))
    assert (real.min_pixels, real.max_pixels, real.patch_dim) == (QWEN35_MIN_PIXELS, QWEN35_MAX_PIXELS, 1536)
    assert real.grid_thw(100, 100) == (1, 16, 16)  # 10^4 pixels < 65536: scaled up to 256 x 256
    small = ImageProcessor.from_vision_config(VisionConfig.preset("0.8B"), min_pixels=32 * 32, max_pixels=64 * 64)
    assert small.grid_thw(100, 100) == (1, 4, 4) and small.grid_thw(1000, 1000) == (1, 4, 4)
    with pytest.raises(ValueError, match="patch_size 16 does not match the vision tower's patch_size 4"):
        real.check_vision(TINY)
    with pytest.raises(ValueError, match="min_pixels 9000 must be > 0 and <= max_pixels 100"):
        ImageProcessor.from_vision_config(TINY, min_pixels=9000, max_pixels=100)
    with pytest.raises(ValueError, match=f"{tmp_path}/preprocessor_config.json: not found"):
        ImageProcessor.from_pretrained(str(tmp_path))


def test_load_image_errors_name_the_path(tmp_path):
    (tmp_path / "junk.png").write_bytes(b"not an image")
    _save(tmp_path, "ok.png", 5, 6, 0)
    assert load_image("ok.png", str(tmp_path)).mode == "RGB"
    assert load_image(str(tmp_path / "ok.png"), "/elsewhere").size == (6, 5)  # absolute paths ignore base_dir
    for name, reason in (("missing.png", "file not found"), ("junk.png", "cannot read it")):
        with pytest.raises(ImageError) as err:
            load_image(name, str(tmp_path))
        assert str(err.value).startswith(f"image {tmp_path / name}: {reason}") and "\n" not in str(err.value)


def _chat(*parts, answer="The fox eats berries."):
    content = [{"type": "image", "image": p} if p.endswith(".png") else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]


def _check_pads(tokens: np.ndarray, grids: np.ndarray, pad: int) -> None:
    """One pad run per image, of its merged size, in order: what mrope positions require."""
    spans = image_spans(tokens, pad)
    assert [e - s for s, e in spans.tolist()] == [merged_token_count(g, 2) for g in grids]
    mrope_positions(tokens, grids, image_token_id=pad, video_token_id=-1, merge_size=2)  # raises on a mismatch


def test_a_chat_row_with_two_images(tok, tokenizer_dir, processor, tmp_path):
    a, b = _save(tmp_path, "a.png", 30, 50, 1), _save(tmp_path, "b.png", 71, 23, 2)
    messages = _chat("Look: ", a, " and ", b, " What eats?")
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    encoder = RowEncoder(tokenizer_dir, VOCAB, loaded=tok, image_processor=processor)
    tokens, loss_mask, images = encoder.encode_example({"messages": messages}, str(tmp_path))
    patches, grids = processor.process([load_image(a, str(tmp_path)), load_image(b, str(tmp_path))])
    np.testing.assert_array_equal(images.patches, patches)
    np.testing.assert_array_equal(images.grids_thw, grids)
    _check_pads(tokens, grids, pad)
    shipped = pickle.loads(pickle.dumps(encoder))  # as grain's worker processes get it
    np.testing.assert_array_equal(shipped.encode_example({"messages": messages}, str(tmp_path)).images.patches,
                                  patches)
    is_pad = tokens == pad
    assert not loss_mask[is_pad].any() and not loss_mask[:-1][is_pad[1:]].any()  # no pad predicted or predicting
    assert tok.decode(tokens[1:][loss_mask[:-1] == 1]) == "The fox eats berries.<|im_end|>\n"
    # the same row through a template without generation markers (prefix rendering), as Qwen's templates
    plain = copy.deepcopy(tok)
    plain.chat_template = VISION_CHAT_TEMPLATE.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    again = RowEncoder(tokenizer_dir, VOCAB, loaded=plain, image_processor=processor).encode(
        {"messages": messages}, str(tmp_path))
    assert again[0].tolist() == tokens.tolist() and again[1].tolist() == loss_mask.tolist()
    # a prompt row: the generation prompt at the end, the same pads and images
    prompt = PromptEncoder(tok, VOCAB, image_processor=processor)
    ids, prompt_images = prompt.encode_with_images({"messages": messages[:1]}, str(tmp_path))
    assert tok.decode(ids).endswith("<|im_start|>assistant\n") and ids == tokens[:len(ids)].tolist()
    np.testing.assert_array_equal(prompt_images.patches, patches)


def test_image_pads_are_never_predicted_nor_predict_even_where_everything_trains():
    tokens = np.array([5, 6, 1, 7, 8, 1, 9])  # two images (pad id 1), each wrapped by other tokens
    grids = np.array([[1, 2, 4], [1, 4, 2]])  # 2 merged tokens each
    expanded, target = expand_images(tokens, np.ones(7, np.int32), grids, 1, 2)
    assert expanded.tolist() == [5, 6, 1, 1, 7, 8, 1, 1, 9] and target.tolist() == [1, 1, 0, 0, 1, 1, 0, 0, 1]
    loss = image_loss_mask(expanded, prediction_mask(target), 1)
    assert loss.tolist() == [1, 0, 0, 0, 1, 0, 0, 0, 0]  # only 5 -> 6 and 7 -> 8 train
    with pytest.raises(ValueError, match="two <.image_pad.> tokens with nothing between them"):
        expand_images(np.array([5, 1, 1, 9]), np.ones(4, np.int32), grids, 1, 2)


def test_bad_image_rows_say_why_in_one_line_naming_the_path(tok, tokenizer_dir, processor, tmp_path):
    (tmp_path / "junk.png").write_bytes(b"\x89PNG broken")
    _save(tmp_path, "ok.png", 30, 50, 0)
    Image.new("RGB", (900, 2)).save(tmp_path / "thin.png")  # aspect ratio 450 > 200
    with_images = RowEncoder(tokenizer_dir, VOCAB, loaded=tok, image_processor=processor)
    without = RowEncoder(tokenizer_dir, VOCAB, loaded=tok)
    cases = [
        (with_images, _chat("see ", "missing.png"), f"image {tmp_path}/missing.png: file not found"),
        (with_images, _chat("see ", "junk.png"), f"image {tmp_path}/junk.png: cannot read it"),
        (with_images, _chat("see ", "thin.png"), f"image {tmp_path}/thin.png: absolute aspect ratio must be"),
        (without, _chat("see ", "ok.png"), f"image {tmp_path}/ok.png: the model has no vision tower"),
        (with_images, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
            {"type": "image", "image": "ok.png"}]}], "message 1: an assistant message cannot hold images"),
        (with_images, [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}],
         "message 0 part 0 must be an object with 'type' text or image"),
        (with_images, [{"role": "user", "content": [{"type": "image"}]}], "message 0 part 0 (image) needs"),
        (with_images, _chat(f"a {IMAGE_PAD} in the text ", "ok.png"), f"the chat template wrote 2 {IMAGE_PAD} tokens for 1"),
    ]
    for encoder, messages, reason in cases:
        with pytest.raises(BadRow) as err:
            encoder.encode({"messages": messages}, str(tmp_path))
        assert str(err.value).startswith(reason) and "\n" not in str(err.value), (reason, str(err.value))
    with pytest.raises(BadRow, match=f"image {tmp_path}/ok.png: the model has no vision tower"):
        PromptEncoder(tok, VOCAB).encode({"messages": _chat("see ", "ok.png")[:1]}, str(tmp_path))
    text_only = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                              {"role": "assistant", "content": [{"type": "text", "text": "Mice."}]}]}
    assert without.encode(text_only)[0].tolist() == without.encode(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Mice."}]})[0].tolist()


def test_long_rows_never_cut_an_image():
    tokens = np.arange(100, 130)
    spans = np.array([[7, 12], [14, 16], [20, 27]])  # 5, 2 and 7 pads: three images
    for s, e in spans:
        tokens[s:e] = 1
    grids = np.array([[1, 2, 10], [1, 2, 4], [1, 2, 14]])  # 20, 8, 28 patches: 5, 2, 7 merged tokens
    patches = np.arange(56 * 3, dtype=np.float32).reshape(56, 3)
    images = RowImages(patches, grids)
    loss_mask = np.concatenate([np.ones(29, np.int32), [0]])
    pieces = fit_images_to_length(tokens, loss_mask, images, spans, 10, "split")
    trained = [(int(t[i]), int(t[i + 1]), i) for t, m, _ in pieces for i in np.flatnonzero(m)]
    assert len(trained) == 29  # every prediction trained exactly once
    got = [(len(t), None if im is None else im.grids_thw.tolist()) for t, _, im in pieces]
    # pieces of 10 would end inside images 0 and 1 and 2: each ends before the image instead
    assert got == [(7, None), (8, [grids[0].tolist()]), (7, [grids[1].tolist()]), (10, [grids[2].tolist()]),
                   (2, None)]
    starts = np.cumsum([0] + [len(t) - 1 for t, _, _ in pieces[:-1]])
    assert all(tokens[a] != 1 for a in starts)  # the shared token of two pieces is never a pad
    np.testing.assert_array_equal(np.concatenate([im.patches for _, _, im in pieces if im is not None]), patches)
    [(t, m, im)] = fit_images_to_length(tokens, loss_mask, images, spans, 10, "truncate")
    assert len(t) == 7 and im is None and m[-1] == 0  # ends before the first image, which would not fit
    assert fit_images_to_length(tokens, loss_mask, images, spans, 8, "split") == []  # 7 pads > 8 - 2


def test_prepared_data_keeps_images_whole_and_bit_exact(tok, tokenizer_dir, processor, tmp_path):
    folder = tmp_path / "in" / "pics"
    names = [_save(folder, f"{i}.png", h, w, 10 + i) for i, (h, w) in enumerate(SIZES[:3] + [(40, 24)])]
    rows = [{"messages": _chat("Look: ", f"pics/{names[i]}", " and ", f"pics/{names[(i + 1) % 4]}", " ok?",
                               answer="The fox eats berries. " * (i + 1))} for i in range(4)]
    rows += [{"text": "The owl lives in the barn."}] * 3 + [{"messages": _chat("see ", "pics/missing.png")}]
    path = write_jsonl(str(tmp_path / "in" / "chat.jsonl"), rows)
    out = str(tmp_path / "packed")
    manifest = prepare_dataset(path, out, tokenizer=tokenizer_dir, seq_len=64, vocab_size=VOCAB, long_rows="split",
                               image_processor=processor)
    assert manifest["counts"]["bad_rows"] == 1 and "pics/missing.png: file not found" in \
        manifest["counts"]["bad_row_examples"][0] and manifest["counts"]["split_rows"] > 0
    with pytest.raises(ValueError, match="holds 8 images, which this reader does not feed"):
        open_prepared(out, VOCAB)
    arrays, manifest = open_prepared(out, VOCAB, images=True)
    assert manifest["images"]["count"] == manifest["counts"]["images"] == 8
    assert f"images 8, patches {len(arrays['patches'])}" in describe(manifest)
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    assert isinstance(arrays["patches"], np.memmap) and arrays["patches"].dtype == np.float32
    seen = []
    for r in range(manifest["rows"]):
        patches, grids = prepared_row_images(arrays, r)
        packed_mrope_positions(arrays["tokens"][r], arrays["segment_ids"][r], grids, image_token_id=pad,
                               video_token_id=-1, merge_size=2)  # every pad run matches a whole image of the row
        assert int((arrays["tokens"][r] == pad).sum()) == sum(merged_token_count(g, 2) for g in grids)
        assert not arrays["loss_mask"][r][arrays["tokens"][r] == pad].any()
        offsets = np.concatenate([[0], np.cumsum(np.prod(grids, axis=1))])
        seen += [(bytes(patches[a:b]), tuple(g)) for a, b, g in zip(offsets[:-1], offsets[1:], grids.tolist())]
    encoder = RowEncoder(tokenizer_dir, VOCAB, loaded=tok, image_processor=processor)
    expected = []
    for row in rows[:4]:
        images = encoder.encode_example(row, str(tmp_path / "in")).images
        offsets = np.concatenate([[0], np.cumsum(np.prod(images.grids_thw, axis=1))])
        expected += [(bytes(images.patches[a:b]), tuple(g))
                     for a, b, g in zip(offsets[:-1], offsets[1:], images.grids_thw.tolist())]
    assert sorted(seen) == sorted(expected)  # each image once, its patches bit for bit
