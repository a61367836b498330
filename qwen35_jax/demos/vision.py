"""The vision demo, `python scripts/train.py --demo vision`: a tiny Qwen3.5 vision-language model learns to
name the coloured shape in a picture. The demo draws the pictures with Pillow (one circle, square or
triangle in one of four colours, of random size and place, on a random grey), writes them as Hugging
Face chat rows with image parts, and starts from a random tiny VLM (the `tiny` text model and the `tiny`
vision tower). A short SFT run on worked examples teaches it the answer's form and part of the skill;
online GRPO on the image prompts alone, with `qwen35_jax.rewards:answer_words` as the reward, then
trains it further. The held-out greedy accuracy (the exact answer, e.g. "blue triangle") before and
after GRPO is printed with a few answers.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

COLOURS = {"red": (215, 35, 35), "orange": (245, 140, 20), "yellow": (235, 215, 40), "green": (40, 170, 60),
           "teal": (30, 165, 165), "blue": (45, 70, 225), "purple": (140, 50, 200), "pink": (240, 120, 190)}
SHAPES = ("circle", "square", "triangle")
SIZE = 16  # pixels a side: 4 x 4 patches of the tiny tower's 4 pixels, merged 2 x 2 into 4 image tokens
QUESTION = "What colour is the shape?"
OUT = os.path.join("runs", "demo-vision")
SFT_EXAMPLES, PROMPTS, HELDOUT = 1200, 1200, 64
# Images are used at their size: min = max pixels = SIZE², a multiple of the tower's 8-pixel cells.
IMAGE_OPTIONS: dict[str, Any] = dict(min_pixels=SIZE * SIZE, max_pixels=SIZE * SIZE)
SFT_OPTIONS: dict[str, Any] = dict(  # deliberately short: the answer's form and a start on the skill
    # (120 steps name every held-out colour right; 40 leave the model naming hue families)
    steps=40, lr=3e-3, warmup_steps=5, final_lr_ratio=0.3, batch_size=16, seq_len=64, save_every=40, seed=0,
    **IMAGE_OPTIONS)
# Sampling at T = 0.5 and a 10-step warm-up: at T = 0.7, or at lr 1e-3 from the first step, the held-out
# accuracy climbs far more slowly or collapses (Adam's first steps move every weight by about lr).
GRPO_OPTIONS: dict[str, Any] = dict(
    objective="grpo", reward="qwen35_jax.rewards:answer_words", group_size=8, batch_size=128, max_new_tokens=4,
    temperature=0.5, lr=1e-3, warmup_steps=10, final_lr_ratio=1.0, steps=60, save_every=20, eval_every=20,
    clip_ratio=0.2, seed=0, **IMAGE_OPTIONS)
SHOWN = 4


def draw_shape(rng: np.random.Generator) -> tuple[Any, str]:
    """(a SIZE x SIZE RGB picture of one shape, its answer: the shape's colour)."""
    from PIL import Image, ImageDraw

    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    grey = int(rng.integers(60, 200))
    image = Image.new("RGB", (SIZE, SIZE), (grey, grey, grey))
    side = int(rng.integers(7, 15))
    x0, y0 = (int(v) for v in rng.integers(0, SIZE - side + 1, size=2))
    fill = tuple(int(np.clip(c + rng.integers(-20, 21), 0, 255)) for c in COLOURS[colour])
    box = [x0, y0, x0 + side - 1, y0 + side - 1]
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x0 + side / 2, y0), (x0, y0 + side - 1), (x0 + side - 1, y0 + side - 1)], fill=fill)
    return image, str(colour)


def _rows(directory: str, split: str, n: int, seed: int, with_answer: bool) -> list[dict[str, Any]]:
    """n chat rows of `split`, their pictures written to directory/images/ (paths relative to the JSONL)."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(directory, "images"), exist_ok=True)
    rows = []
    for i in range(n):
        image, answer = draw_shape(rng)
        path = os.path.join("images", f"{split}-{i}.png")
        image.save(os.path.join(directory, path))
        user = {"role": "user", "content": [{"type": "image", "image": path}, {"type": "text", "text": QUESTION}]}
        if with_answer:
            rows.append({"messages": [user, {"role": "assistant", "content": answer}]})
        else:
            rows.append({"messages": [user], "answer": answer})
    return rows


def _write(path: str, rows: list[dict[str, Any]]) -> str:
    from qwen35_jax.files import write_text_atomically

    write_text_atomically(path, "".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_task(directory: str) -> dict[str, str]:
    """The demo's files (the same on every call): SFT chats with answers, RL and held-out prompts with an
    `answer` field, the pictures, and a tokenizer with the vision tokens; {name: path}."""
    from qwen35_jax.data.demo.tokenizer import build_demo_tokenizer

    tokenizer = build_demo_tokenizer(os.path.join(directory, "tokenizer"), [QUESTION, *COLOURS] * 4, vision=True)
    return {"tokenizer": tokenizer,
            "sft": _write(os.path.join(directory, "sft.jsonl"), _rows(directory, "sft", SFT_EXAMPLES, 1, True)),
            "prompts": _write(os.path.join(directory, "prompts.jsonl"), _rows(directory, "rl", PROMPTS, 2, False)),
            "heldout": _write(os.path.join(directory, "heldout.jsonl"), _rows(directory, "heldout", HELDOUT, 3, False))}


def write_initial_model(directory: str, tokenizer_dir: str) -> str:
    """A random tiny VLM (seed 0) saved at `directory`, its placeholder ids the tokenizer's vision tokens."""
    from flax import nnx

    from qwen35_jax.checkpoint import save_checkpoint
    from qwen35_jax.config import Qwen35Config
    from qwen35_jax.data.demo.tokenizer import VISION_TOKENS
    from qwen35_jax.data.rows import load_tokenizer
    from qwen35_jax.model import Qwen35ForCausalLM
    from qwen35_jax.vision.config import VisionConfig

    start, pad, end = load_tokenizer(tokenizer_dir).convert_tokens_to_ids(VISION_TOKENS)
    config = Qwen35Config.preset("tiny", hf_model_type="qwen3_5", vision=VisionConfig.preset("tiny"),
                                 image_token_id=pad, vision_start_token_id=start, vision_end_token_id=end)
    save_checkpoint(directory, Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)), config)
    return directory


def _answer_end(tokenizer_dir: str) -> int:
    """The id of <|im_end|>, which ends an assistant turn (the demo tokenizer's eos is <|endoftext|>)."""
    from qwen35_jax.data.rows import load_tokenizer

    return int(load_tokenizer(tokenizer_dir).convert_tokens_to_ids("<|im_end|>"))


def greedy_accuracy(run_dir: str, files: dict[str, str], mesh: Any) -> tuple[float, list[str]]:
    """(exact-answer rate of greedy answers to the held-out pictures, a few of them as text)."""
    from qwen35_jax.checkpoint import load_model
    from qwen35_jax.data.images import ImageProcessor
    from qwen35_jax.data.rows import PromptEncoder, load_tokenizer
    from qwen35_jax.generation import generate
    from qwen35_jax.rl.prompt_stream import load_prompts_with_images

    model, config = load_model(run_dir, mesh=mesh)
    tokenizer = load_tokenizer(files["tokenizer"])
    encoder = PromptEncoder(tokenizer, config.vocab_size,
                            image_processor=ImageProcessor.from_vision_config(config.vision, **IMAGE_OPTIONS))
    rows, prompts, images = load_prompts_with_images([files["heldout"]], encoder)
    out = generate(model, prompts, images=images, max_new_tokens=GRPO_OPTIONS["max_new_tokens"], temperature=0,
                   stop_token_ids=[_answer_end(files["tokenizer"])], mesh=mesh)
    answers = [tokenizer.decode(c.completion_ids, skip_special_tokens=True).strip() for c in out]
    right = [a == r["answer"] for a, r in zip(answers, rows)]
    shown = [f"{r['messages'][0]['content'][0]['image']} ({r['answer']}): {a!r}" for r, a in zip(rows, answers)]
    return float(np.mean(right)), shown[:SHOWN]


def run_demo(stop: Any, out: str = OUT) -> int:
    """SFT, then GRPO, from a random tiny VLM; prints the held-out greedy accuracy of each. The exit code."""
    from qwen35_jax.demos.sft import corpus_dir, simulate_cpu_devices

    simulate_cpu_devices()
    import jax

    from qwen35_jax.objectives import train
    from qwen35_jax.parallel.mesh import make_mesh
    from qwen35_jax.train.options import TrainOptions

    files = write_task(os.path.join(os.path.dirname(corpus_dir()), "coloured-shapes"))
    mesh_spec = "fsdp=8" if jax.default_backend() == "cpu" else None
    init_dir, sft_dir, rl_dir = (os.path.join(out, name) for name in ("init", "sft", "grpo"))
    if not os.path.isdir(init_dir):
        os.makedirs(out, exist_ok=True)
        write_initial_model(init_dir, files["tokenizer"])
    print(f"1/2 SFT, {SFT_OPTIONS['steps']} steps: a random tiny VLM learns from pictures with their answers "
          f"('{QUESTION}' -> 'red circle')", flush=True)
    code = train(TrainOptions(**SFT_OPTIONS, model=init_dir, tokenizer=files["tokenizer"], data=[files["sft"]],
                              out=sft_dir, mesh=mesh_spec), stop)
    if code or stop.signal_name is not None:
        return code
    mesh = make_mesh(mesh_spec)
    before, shown_before = greedy_accuracy(sft_dir, files, mesh)
    print(f"held-out greedy accuracy after SFT: {before:.0%}", flush=True)
    print("2/2 online GRPO on the pictures alone, reward qwen35_jax.rewards:answer_words", flush=True)
    code = train(TrainOptions(**GRPO_OPTIONS, model=sft_dir, tokenizer=files["tokenizer"], data=[files["prompts"]],
                              eval_data=[files["heldout"]], out=rl_dir, mesh=mesh_spec,
                              stop_token_ids=str(_answer_end(files["tokenizer"]))), stop)
    if code or stop.signal_name is not None:
        return code
    after, shown_after = greedy_accuracy(rl_dir, files, mesh)
    print(f"held-out greedy accuracy (the shape's colour, one of {len(COLOURS)}): after SFT "
          f"{before:.0%}, after GRPO {after:.0%}", flush=True)
    for b, a in zip(shown_before, shown_after):
        print(f"  after SFT: {b:<44} after GRPO: {a.split(': ', 1)[1]}", flush=True)
    return 0
