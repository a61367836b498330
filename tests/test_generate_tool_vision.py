"""scripts/generate.py with prompts that hold images: a VLM checkpoint answers them as the library does
(images relative to the JSONL's folder, --min-pixels/--max-pixels), and the image rows it cannot answer are
one error line naming the row, exit 2, nothing written."""

import json
import os

import numpy as np
import pytest
import transformers as tf
from flax import nnx
from PIL import Image

from data_testutil import write_jsonl
from qwen35_jax.config import Qwen35Config
from qwen35_jax.data.images import ImageProcessor
from qwen35_jax.data.rows import PromptEncoder, load_tokenizer
from qwen35_jax.generation import generate
from qwen35_jax.generation.tool import main
from qwen35_jax.hf.export import export_hf
from qwen35_jax.hf.load import load_hf
from qwen35_jax.model import Qwen35ForCausalLM
from test_data_images import vision_tokenizer
from test_vlm import TEXT, VISION, _init

VOCAB = 272  # the demo tokenizer's 256 tokens, its 3 vision tokens, room to spare
PIXELS = ["--min-pixels", "512", "--max-pixels", "4096"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(an HF VLM checkpoint with a tokenizer holding the vision tokens, a text-only one with the same tokenizer)."""
    root = tmp_path_factory.mktemp("ckpts")
    tok, (start, pad, end) = vision_tokenizer()
    config = tf.Qwen3_5Config(text_config={**TEXT, "vocab_size": VOCAB}, vision_config=VISION, image_token_id=pad,
                              video_token_id=VOCAB - 1, vision_start_token_id=start, vision_end_token_id=end)
    model = tf.Qwen3_5ForConditionalGeneration._from_config(config, attn_implementation="eager")
    _init(model)
    vlm = str(root / "vlm")
    model.float().save_pretrained(vlm)
    tok.save_pretrained(vlm)
    text = str(root / "text")
    cfg = Qwen35Config.preset("tiny", vocab_size=VOCAB, num_attention_heads=8, linear_num_value_heads=8)
    export_hf(nnx.state(Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param), cfg, text)
    tok.save_pretrained(text)
    return vlm, text


def _image(directory, name: str, height: int, width: int, seed: int) -> str:
    os.makedirs(directory, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels, "RGB").save(os.path.join(directory, name))
    return name


def _chat(*parts) -> list[dict]:
    content = [{"type": "image", "image": p} if p.endswith(".png") else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def _run(tmp_path, model, rows, *args):
    prompts = write_jsonl(str(tmp_path / "prompts" / "in.jsonl"), rows)
    out = tmp_path / "out.jsonl"
    return main(["--model", model, "--prompts", prompts, "--out", str(out), *args]), out


def test_image_prompts_are_answered_as_the_library_does(tmp_path, checkpoints, capsys):
    vlm, _ = checkpoints
    images = tmp_path / "prompts" / "img"
    a, b = _image(images, "a.png", 30, 50, 1), _image(images, "b.png", 71, 23, 2)
    rows = [{"messages": _chat("Look: ", f"img/{a}", " What is it?"), "id": 1}, {"prompt": "Once upon"},
            {"messages": _chat(f"img/{b}", "And this?", f"img/{a}")}]
    code, out = _run(tmp_path, vlm, rows, "--max-new-tokens", "4", "--temperature", "0", "--stop-token-ids", "",
                     *PIXELS)
    assert code == 0
    assert "2 prompts with 3 images, 512..4,096 pixels each (image processor: Qwen3.5 defaults)" in capsys.readouterr().out
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g.get("id") for g in got] == [1, None, None] and got[0]["messages"] == rows[0]["messages"]
    model, config, _ = load_hf(vlm, text_only=False)
    processor = ImageProcessor.from_vision_config(config.vision, min_pixels=512, max_pixels=4096)
    encoder = PromptEncoder(load_tokenizer(vlm), VOCAB, image_processor=processor)
    encoded = [encoder.encode_with_images(row, str(tmp_path / "prompts")) for row in rows]
    assert [len(e[1].grids_thw) if e[1] else 0 for e in encoded] == [1, 0, 2]
    want = generate(model, [ids for ids, _ in encoded], max_new_tokens=4, temperature=0,
                    images=[im for _, im in encoded])
    for g, w in zip(got, want):
        assert g["completion_ids"] == w.completion_ids
        np.testing.assert_allclose(g["log_probs"], w.log_probs, atol=1e-6)
    # the images are read: without them (the text model's view of the same weights) row 1 answers otherwise
    text_model, _, _ = load_hf(vlm)
    blind = generate(text_model, [encoded[0][0]], max_new_tokens=4, temperature=0)
    assert blind[0].completion_ids != got[0]["completion_ids"]


@pytest.mark.parametrize("which,rows,message", [
    ("text", [{"prompt": "hi"}, {"messages": _chat("Look: ", "img/a.png")}],
     "in.jsonl row 2: image img/a.png: the model {model} has no vision tower, so prompts with images cannot be "
     "answered"),
    ("vlm", [{"messages": _chat("Look: ", "img/a.png")}, {"messages": _chat("img/missing.png", "and?")}],
     "in.jsonl row 2: image {prompts}/img/missing.png: file not found"),
])
def test_image_rows_it_cannot_answer_are_one_line_exit_2_nothing_written(tmp_path, checkpoints, capsys, which, rows,
                                                                         message):
    vlm, text = checkpoints
    model = vlm if which == "vlm" else text
    _image(tmp_path / "prompts" / "img", "a.png", 30, 50, 1)
    code, out = _run(tmp_path, model, rows, *PIXELS)
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert err.endswith(message.format(model=model, prompts=tmp_path / "prompts"))


@pytest.mark.parametrize("args,message", [(["--min-pixels", "0"], "--min-pixels must be >= 1, got 0"),
                                          (["--min-pixels", "900", "--max-pixels", "800"],
                                           "--min-pixels 900 exceeds --max-pixels 800")])
def test_bad_pixel_bounds(tmp_path, checkpoints, capsys, args, message):
    code, out = _run(tmp_path, checkpoints[0], [{"prompt": "hi"}], *args)
    assert code == 2 and not out.exists()
    assert capsys.readouterr().err.strip() == f"error: {message}"
