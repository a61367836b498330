"""Online GRPO on prompts with images (a tiny VLM): a run on fsdp=2,sp=4 whose sampler and trainer agree
with the images (`logprob_mismatch`) and which resumes exactly; a rollout's sampled log-probs against the
model's own forward with the rows' vision inputs and mrope positions; bad inputs are one line, nothing
written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image, ImageDraw

from data_testutil import write_jsonl
from hf_testutil import load_script
from qwen35_jax.checkpoint import load_checkpoint
from test_train_vision import write_tiny_vlm

MIN_PIXELS, MAX_PIXELS = 256, 1024  # 16 .. 64 patches of 4 x 4
COLOURS = {"red": (230, 20, 20), "green": (20, 200, 40), "blue": (30, 30, 220)}
# a reward that reads the row's image (relative to the JSONL's folder, where this file is written too):
# the share of completion ids below 64, weighted by the image's red
REWARD = """import os
from PIL import Image

def red_low_ids(sample):
    path = sample["messages"][0]["content"][0].get("image")
    red = 0.5 if path is None else Image.open(os.path.join(os.path.dirname(__file__), path)).getpixel((0, 0))[0] / 255
    ids = sample["completion_ids"]
    return red * sum(t < 64 for t in ids) / len(ids)
"""


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    """A tiny VLM checkpoint and its tokenizer, whose vision tokens are the config's placeholder ids."""
    return write_tiny_vlm(tmp_path_factory.mktemp("vlm"))


def _square(path: Path, size: tuple[int, int], colour: str) -> None:
    """A square of `colour` on a grey background, its top-left pixel the colour too."""
    image = Image.new("RGB", size, (128, 128, 128))
    ImageDraw.Draw(image).rectangle([0, 0, size[0] * 2 // 3, size[1] * 2 // 3], fill=COLOURS[colour])
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


def _prompts(folder: Path, n: int = 6) -> tuple[str, str]:
    """(n prompt rows, each with a drawn square of another size and colour but the last (text only); the
    reward spec)."""
    rows = []
    for i in range(n):
        content = [{"type": "text", "text": "What colour is the square?"}]
        colour = list(COLOURS)[i % 3]
        if i < n - 1:
            _square(folder / "pics" / f"{i}.png", (16 + 8 * (i % 3), 24 - 8 * (i % 2)), colour)
            content.insert(0, {"type": "image", "image": f"pics/{i}.png"})
        rows.append({"messages": [{"role": "user", "content": content}], "colour": colour})
    (folder / "reward.py").write_text(REWARD)
    return write_jsonl(str(folder / "prompts.jsonl"), rows), f"{folder / 'reward.py'}:red_low_ids"


def _options(vlm_dir, out, prompts, reward, **changes):
    from qwen35_jax.train.options import TrainOptions

    base = dict(model=str(vlm_dir / "model"), tokenizer=str(vlm_dir / "tokenizer"), objective="grpo",
                data=[prompts], reward=reward, group_size=2, batch_size=8, max_new_tokens=4,
                temperature=1.0, lr=1e-2, final_lr_ratio=1.0, steps=3, save_every=2, out=str(out), mesh="fsdp=2,sp=4",
                progress=False, seed=3, remat="none", kl_coef=0.05, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                max_patches=256,  # one patch bucket: one program for every step
                ppo_epochs=2)  # two updates a step: the old log-probs (with the images) are scored before them
    return TrainOptions(**{**base, **changes})


def _trained(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def test_grpo_with_images_on_fsdp2_sp4_sampler_equals_trainer_and_resumes_exactly(vlm_dir, tmp_path):
    """Three steps of 4 prompts x 2 samples (with a KL reference): the sampler's log-probs
    (prefill with the images, decode at the mrope positions) equal the trainer's old log-probs, scored
    with the batch's VisionInputs and the rows' mrope positions, to float32 rounding; the run
    stopped after step 2 and resumed gives step 3's rewards, loss and held-out reward again."""
    from qwen35_jax.objectives import train

    prompts, reward = _prompts(tmp_path / "data")
    evals = dict(eval_data=[prompts], eval_every=3)  # greedy answers to the prompts with their images
    assert train(_options(vlm_dir, tmp_path / "full", prompts, reward, **evals)) == 0
    rows = _trained(tmp_path / "full")
    assert rows[2]["eval_reward"] is not None
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) and r["reward_std"] > 0 for r in rows)
    assert max(r["logprob_mismatch"] for r in rows) < 1e-4, [r["logprob_mismatch"] for r in rows]
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "3")
    assert train(_options(vlm_dir, tmp_path / "resumed", prompts, reward, **evals)) == 0
    again = _trained(tmp_path / "resumed")
    assert [r["step"] for r in again] == [1, 2, 3]
    keys = ("reward_mean", "loss", "logprob_mismatch", "eval_reward")
    np.testing.assert_allclose([again[2][k] for k in keys], [rows[2][k] for k in keys], rtol=1e-5, atol=1e-7)


def test_rollout_rows_carry_their_images_and_the_sampled_log_probs_equal_the_full_forward(vlm_dir, tmp_path):
    """One device: each completion's sampled log-probs equal log_softmax of the model's logits on the
    whole row (prompt + completion) with `vision_batch`'s positions and VisionInputs, and the online run's
    old log-probs program (fused kernel, two micro-batches with their own images) gives them too."""
    from qwen35_jax.data.images import ImageProcessor
    from qwen35_jax.data.rows import load_tokenizer
    from qwen35_jax.generation.prompts import PromptEncoder
    from qwen35_jax.rl.prompt_stream import load_prompts_with_images
    from qwen35_jax.rl.reward_fn import load_reward
    from qwen35_jax.rl.rollout import RolloutOptions, row_length, sample_rollouts
    from qwen35_jax.train.vision import vision_batch

    prompts, reward = _prompts(tmp_path / "data", n=4)
    model, config, _ = load_checkpoint(str(vlm_dir / "model"))  # float32
    encoder = PromptEncoder(load_tokenizer(str(vlm_dir / "tokenizer")), config.vocab_size,
                            image_processor=ImageProcessor.from_vision_config(config.vision, min_pixels=MIN_PIXELS,
                                                                              max_pixels=MAX_PIXELS))
    rows, ids, images = load_prompts_with_images([prompts], encoder)
    assert [x is None for x in images] == [False, False, False, True]

    options = RolloutOptions(group_size=2, max_new_tokens=5, temperature=1.0, advantage="grpo", stop_token_ids=())
    seq_len = row_length(ids, 5)
    rollout = sample_rollouts(model, rows, ids, [0, 1, 3, 2], options=options, seed=7, mesh=None,
                              reward=load_reward(reward), encoder=encoder, seq_len=seq_len, images=images)
    batch = rollout.batch
    assert batch["image_counts"].tolist() == [1, 1, 1, 1, 0, 0, 1, 1]  # each sample carries its prompt's image
    want = np.concatenate([images[i].patches for i in (0, 0, 1, 1, 2, 2)])
    np.testing.assert_array_equal(batch["patches"], want)
    host = vision_batch(batch, config, grad_accum=1)
    hidden = model(jnp.asarray(host["tokens"]), positions=jnp.asarray(host["positions"]),
                   segment_ids=jnp.asarray(host["segment_ids"]),
                   vision=jax.tree.map(lambda x: jnp.asarray(x[0]), host["vision"]))
    log_probs = np.asarray(jax.nn.log_softmax(model.logits(hidden).astype(jnp.float32), axis=-1))
    tokens, mask = host["tokens"], host["loss_mask"].astype(bool)
    forward = np.take_along_axis(log_probs[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]  # [N, S-1]
    assert mask[:, -1].sum() == 0 and mask.sum() == rollout.completion_lengths.sum() > 0
    np.testing.assert_allclose(rollout.sampler_log_probs[:, :-1][mask[:, :-1]], forward[mask[:, :-1]], atol=2e-5)
    # the trainer's old log-probs program (fused kernel) on the batch as two micro-batches, each with its
    # own images: the same numbers
    from qwen35_jax.parallel.mesh import make_mesh
    from qwen35_jax.rl.online import _vision_score_program
    from qwen35_jax.scoring import ScoreOptions
    from qwen35_jax.train.data import place_batch

    mesh = make_mesh("fsdp=1,sp=1", jax.devices()[:1])
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: type(model)(config, rngs=nnx.Rngs(0))))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with jax.set_mesh(mesh):
        placed = place_batch(vision_batch(batch, config, grad_accum=2), mesh, 2, 1)
        assert placed["vision"].patches.shape[0] == 2
        scored = _vision_score_program(graphdef, config.kernels, ScoreOptions())(
            params, {k: placed[k] for k in ("tokens", "segment_ids", "positions", "vision")})
    scored = np.asarray(scored).reshape(len(tokens), -1)[:, :tokens.shape[1]]
    np.testing.assert_allclose(scored[mask], rollout.sampler_log_probs[mask], atol=2e-5)


def test_bad_image_prompts_are_one_line_and_write_nothing(vlm_dir, tmp_path, capsys):
    prompts, reward = _prompts(tmp_path / "data", n=4)
    common = ["--tokenizer", str(vlm_dir / "tokenizer"), "--objective", "grpo", "--data", prompts, "--reward",
              reward, "--group-size", "2", "--batch-size", "8", "--steps", "1", "--no-progress", "--max-new-tokens",
              "2"]
    # a model without a vision tower (the tiny preset): the first image row and its path
    out = tmp_path / "text"
    code = load_script("train").main([*common, "--preset", "tiny", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and not out.exists(), err
    assert f"{prompts}:1: the row has an image (pics/0.png) but the model has no vision tower" in err
    # a missing image: its row and path, before anything is written
    (tmp_path / "data" / "pics" / "1.png").unlink()
    out = tmp_path / "missing"
    code = load_script("train").main([*common, "--model", str(vlm_dir / "model"), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and not out.exists(), err
    assert f"{prompts} row 2: image {tmp_path / 'data' / 'pics' / '1.png'}: file not found" in err


def test_a_sampled_image_pad_ends_the_training_row_and_the_reward_sees_the_whole_completion(vlm_dir, tmp_path,
                                                                                            monkeypatch):
    """A completion holding an image pad (which the trainer would read as a placeholder without an image):
    its row keeps the tokens before it, and the batch still passes `vision_batch`'s checks."""
    import types

    from qwen35_jax.data.images import ImageProcessor
    from qwen35_jax.data.rows import load_tokenizer
    from qwen35_jax.generation.api import Completion
    from qwen35_jax.generation.prompts import PromptEncoder
    from qwen35_jax.rl import rollout as rollout_module
    from qwen35_jax.rl.prompt_stream import load_prompts_with_images
    from qwen35_jax.rl.rollout import RolloutOptions, row_length, sample_rollouts
    from qwen35_jax.train.vision import vision_batch

    prompts, _ = _prompts(tmp_path / "data", n=2)
    config = load_checkpoint(str(vlm_dir / "model"))[1]
    encoder = PromptEncoder(load_tokenizer(str(vlm_dir / "tokenizer")), config.vocab_size,
                            image_processor=ImageProcessor.from_vision_config(config.vision, min_pixels=MIN_PIXELS,
                                                                              max_pixels=MAX_PIXELS))
    rows, ids, images = load_prompts_with_images([prompts], encoder)
    pad = config.image_token_id
    sampled = [[5, 6, 7], [8, pad, 9]]

    def fake_generate(model, chosen, **kwargs):
        assert [x is None for x in kwargs["images"]] == [False]
        return [Completion(0, s, sampled[s], [-0.5] * 3, "length") for s in range(2)]

    seen = []
    monkeypatch.setattr(rollout_module, "generate", fake_generate)
    options = RolloutOptions(group_size=2, max_new_tokens=3, temperature=1.0, advantage="grpo", stop_token_ids=())
    rollout = sample_rollouts(types.SimpleNamespace(config=config), rows, ids, [0], options=options, seed=0,
                              mesh=None, reward=(lambda s: seen.append(s["completion_ids"]) or 1.0, "r"),
                              encoder=encoder, seq_len=row_length(ids, 3), images=images)
    n = len(ids[0])
    tokens, mask = rollout.batch["tokens"], rollout.batch["loss_mask"]
    assert tokens[0, n:n + 3].tolist() == [5, 6, 7] and mask[0].sum() == 3
    assert tokens[1, n:n + 3].tolist() == [8, 0, 0] and mask[1].sum() == 1 and rollout.batch["segment_ids"][1].sum() == n + 1
    assert rollout.sampler_log_probs[1].tolist().count(-0.5) == 1
    assert seen == sampled  # the reward sees what was sampled
    vision_batch(rollout.batch, config)  # placeholders and images agree
