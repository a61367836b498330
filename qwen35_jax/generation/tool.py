"""`scripts/generate.py`: completions of JSONL prompts from a checkpoint, written as JSONL.

Each output row is its input row plus `sample`, `completion_ids`, `log_probs`, `finish_reason` and,
with a tokenizer, `completion`; `--num-samples n` writes n rows per prompt, prompt-major. Every input
is checked before the model loads where it can be, and the output file appears only once it is
complete.

A 'messages' row may hold image parts (`{"type": "image", "image": PATH}`, PATH relative to the JSONL's
folder) for a checkpoint with a vision tower: the images are processed by the checkpoint's image
processor (its preprocessor_config.json, else Qwen3.5's settings for the tower), sized by
--min-pixels/--max-pixels, and the model answers with them. Before the model loads, an image row for a
model without a tower, or an image file that is not there, is one error line naming the row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from qwen35_jax.files import write_text_atomically
from qwen35_jax.config import RUN_DTYPES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="generate.py", description="Sample completions of JSONL prompts from a Qwen3.5 checkpoint.",
        epilog="Input rows carry 'prompt_ids' (token ids), 'prompt' (text) or 'messages' (a chat, rendered "
               "with the tokenizer's chat template and its generation prompt); every other field is kept.")
    p.add_argument("--model", required=True, help="HF checkpoint, one of ours, or a run directory (its newest)")
    p.add_argument("--prompts", required=True, help="JSONL of prompts")
    p.add_argument("--out", required=True, help="JSONL to write")
    p.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per row at most (default 256)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: keep the smallest set of mass p (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--num-samples", type=int, default=1, help="completions per prompt (default 1)")
    p.add_argument("--stop-token-ids", default=None,
                   help="comma-separated ids that end a row ('' for none; default: the checkpoint's eos ids)")
    p.add_argument("--mesh", default=None, help="device layout 'fsdp=F,sp=S' (default: all devices on fsdp)")
    p.add_argument("--batch-size", type=int, default=None, help="rows (prompt x sample) per batch (default: all)")
    p.add_argument("--max-length", type=int, default=None,
                   help="refuse prompts whose length + --max-new-tokens exceeds this (default: no limit)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (default: the model's, or the run's --tokenizer / --model)")
    p.add_argument("--chat-template-kwargs", default=None,
                   help="JSON object passed to the chat template, e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--dtype", choices=RUN_DTYPES, default=None,
                   help="parameter and compute dtype (default: as stored)")
    p.add_argument("--min-pixels", type=int, default=None,
                   help="images smaller than this many pixels are upscaled (default: the checkpoint's processor)")
    p.add_argument("--max-pixels", type=int, default=None,
                   help="images larger than this many pixels are downscaled (default: the checkpoint's processor)")
    return p.parse_args(argv)


def check_options(args: argparse.Namespace) -> dict[str, Any]:
    """One-line ValueErrors for options that are wrong on their own; the parsed chat template kwargs."""
    for name in ("max_new_tokens", "num_samples"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    for name in ("min_pixels", "max_pixels"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.min_pixels is not None and args.max_pixels is not None and args.min_pixels > args.max_pixels:
        raise ValueError(f"--min-pixels {args.min_pixels} exceeds --max-pixels {args.max_pixels}")
    from qwen35_jax.generation.prompts import parse_chat_template_kwargs, parse_stop_token_ids
    from qwen35_jax.generation.sampling import SamplingOptions

    if args.stop_token_ids is not None:
        parse_stop_token_ids(args.stop_token_ids)
    if os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a directory")
    SamplingOptions(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    return parse_chat_template_kwargs(args.chat_template_kwargs)


def image_rows(rows: list[dict[str, Any]], prompts: str) -> dict[int, list[str]]:
    """{row number: its image paths} of the 'messages' rows with image parts; a malformed conversation
    is a one-line ValueError naming the row."""
    from qwen35_jax.data.rows import BadRow, check_messages

    found = {}
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict) or "messages" not in row:
            continue
        try:
            paths = check_messages(row["messages"])
        except BadRow as err:
            raise ValueError(f"{prompts} row {number}: {err}") from None
        if paths:
            found[number] = paths
    return found


def model_vision(model_path: str) -> Any:
    """The checkpoint's vision tower config (None: no tower), read without loading its weights."""
    from qwen35_jax.checkpoint import is_checkpoint, is_hf_dir, read_metadata, resolve_checkpoint
    from qwen35_jax.config import Qwen35Config

    path = resolve_checkpoint(model_path)
    if is_checkpoint(path):
        return Qwen35Config(**read_metadata(path)["config"]).vision
    if is_hf_dir(path):
        from qwen35_jax.hf.load import read_hf_config

        return read_hf_config(path)[1].vision
    return None


def check_images(images: dict[int, list[str]], prompts: str, model_path: str) -> Any:
    """For prompt rows with images: the model's vision config; one-line ValueError naming the first row
    when the model has no vision tower or an image file is missing (before the model loads)."""
    from qwen35_jax.data.images import resolve_image_path

    if not images:
        return None
    vision = model_vision(model_path)
    base_dir = os.path.dirname(os.path.abspath(prompts))
    for number, paths in images.items():
        if vision is None:
            raise ValueError(f"{prompts} row {number}: image {paths[0]}: the model {model_path} has no vision "
                             f"tower, so prompts with images cannot be answered")
        for path in paths:
            full = resolve_image_path(path, base_dir)
            if not os.path.isfile(full):
                raise ValueError(f"{prompts} row {number}: image {full}: file not found")
    return vision


def image_processor(model_path: str, tokenizer_dir: str | None, vision: Any, min_pixels: int | None,
                    max_pixels: int | None) -> tuple[Any, str]:
    """(the `ImageProcessor` for `vision`, where its settings came from): the preprocessor_config.json of
    the checkpoint, its tokenizer directory, its run (RUN/preprocessor_config.json) or its run's --model,
    else Qwen3.5's settings for the tower."""
    from qwen35_jax.data.batches import image_processor_for
    from qwen35_jax.data.images import PREPROCESSOR_CONFIG, preprocessor_dir
    from qwen35_jax.generation.prompts import run_dir_of, run_options

    candidates = [model_path, tokenizer_dir]
    run = run_dir_of(model_path)
    if run is not None:
        candidates += [run, run_options(run).get("model")]
    directory = preprocessor_dir(candidates)
    processor = image_processor_for(vision, directory, min_pixels=min_pixels, max_pixels=max_pixels)
    return processor, "Qwen3.5 defaults" if directory is None else os.path.join(directory, PREPROCESSOR_CONFIG)


def load_generation_model(model_path: str, dtype: str | None, mesh: Any, vision: bool) -> tuple[Any, Any]:
    """`load_model`, with an HF checkpoint's vision tower when `vision` (prompts with images)."""
    from qwen35_jax.checkpoint import is_checkpoint, is_hf_dir, load_model, resolve_checkpoint

    path = resolve_checkpoint(model_path)
    if vision and not is_checkpoint(path) and is_hf_dir(path):
        from qwen35_jax.hf.load import load_hf

        model, config, _ = load_hf(path, dtype=dtype, mesh=mesh, text_only=False)
        return model, config
    return load_model(model_path, dtype=dtype, mesh=mesh)


def run(args: argparse.Namespace) -> int:
    chat_kwargs = check_options(args)
    from qwen35_jax.generation.prompts import PROMPT_FIELDS, BadRow, PromptEncoder, model_tokenizer, read_prompt_rows
    from qwen35_jax.generation.prompts import stop_token_ids as resolve_stop_token_ids

    rows = read_prompt_rows(args.prompts)
    if not os.path.exists(args.model):
        raise ValueError(f"--model {args.model} does not exist")
    tokenizer, tokenizer_dir = model_tokenizer(args.model, args.tokenizer)
    if tokenizer is None:
        for number, row in enumerate(rows, 1):
            if "prompt_ids" not in row and any(f in row for f in PROMPT_FIELDS):
                field = "prompt" if "prompt" in row else "messages"
                raise ValueError(f"{args.prompts} row {number}: a '{field}' row needs a tokenizer (--tokenizer); "
                                 f"none was found with {args.model}")
    with_images = image_rows(rows, args.prompts)
    vision = check_images(with_images, args.prompts, args.model)
    processor, processor_source = None, ""
    if vision is not None:
        processor, processor_source = image_processor(args.model, tokenizer_dir, vision, args.min_pixels,
                                                      args.max_pixels)

    import jax

    from qwen35_jax.generation import GenerationStats, describe_cache, generate
    from qwen35_jax.parallel.mesh import make_mesh

    mesh = make_mesh(args.mesh)
    model, config = load_generation_model(args.model, args.dtype, mesh, vision is not None)
    encoder = PromptEncoder(tokenizer, config.vocab_size, chat_template_kwargs=chat_kwargs,
                            tokenizer_source=tokenizer_dir, image_processor=processor)
    base_dir = os.path.dirname(os.path.abspath(args.prompts))
    prompts, images = [], []
    for number, row in enumerate(rows, 1):
        try:
            ids, row_images = encoder.encode_with_images(row, base_dir)
        except BadRow as err:
            raise ValueError(f"{args.prompts} row {number}: {err}") from None
        images.append(row_images)
        if args.max_length is not None and len(ids) + args.max_new_tokens > args.max_length:
            raise ValueError(f"{args.prompts} row {number}: its {len(ids)} prompt tokens + --max-new-tokens "
                             f"{args.max_new_tokens} exceed --max-length {args.max_length}")
        prompts.append(ids)
    stop = resolve_stop_token_ids(args.stop_token_ids, args.model, tokenizer)
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    batch = args.batch_size or len(prompts) * args.num_samples
    print(f"{len(prompts)} prompts x {args.num_samples} samples on mesh {dict(mesh.shape)}, stop ids {stop}; "
          f"{describe_cache(config, min(batch, len(prompts) * args.num_samples), longest)}", flush=True)
    if processor is not None:
        print(f"{len(with_images)} prompts with {sum(len(p) for p in with_images.values())} images, "
              f"{min(processor.min_pixels, processor.max_pixels):,}..{processor.max_pixels:,} pixels each "
              f"(image processor: {processor_source})", flush=True)
    stats = GenerationStats()
    start = time.perf_counter()
    completions = generate(model, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_token_ids=stop, mesh=mesh,
                           num_samples=args.num_samples, batch_size=args.batch_size, progress=True, stats=stats,
                           images=images if with_images else None)
    lines = []
    for c in completions:
        out = {**rows[c.prompt_index], "sample": c.sample, "completion_ids": c.completion_ids,
               "log_probs": c.log_probs, "finish_reason": c.finish_reason}
        text = encoder.decode(c.completion_ids)
        if text is not None:
            out["completion"] = text
        lines.append(json.dumps(out, ensure_ascii=False) + "\n")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_text_atomically(args.out, "".join(lines))
    stopped = sum(c.finish_reason == "stop" for c in completions)
    print(f"wrote {len(lines)} rows to {args.out} in {time.perf_counter() - start:.1f}s ({stopped} stopped, "
          f"{len(lines) - stopped} at the length limit) on {jax.devices()[0].platform}: {stats.summary()}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
