"""`scripts/generate.py`: completions of JSONL prompts from a checkpoint, written as JSONL.

Each output row is its input row plus `sample`, `completion_ids`, `log_probs`, `finish_reason` and,
with a tokenizer, `completion`; `--num-samples n` writes n rows per prompt, prompt-major. Every input
is checked before the model loads where it can be, and the output file appears only once it is
complete.
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
    return p.parse_args(argv)


def check_options(args: argparse.Namespace) -> dict[str, Any]:
    """One-line ValueErrors for options that are wrong on their own; the parsed chat template kwargs."""
    for name in ("max_new_tokens", "num_samples"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    from qwen35_jax.generation.prompts import parse_chat_template_kwargs, parse_stop_token_ids
    from qwen35_jax.generation.sampling import SamplingOptions

    if args.stop_token_ids is not None:
        parse_stop_token_ids(args.stop_token_ids)
    if os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a directory")
    SamplingOptions(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    return parse_chat_template_kwargs(args.chat_template_kwargs)


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

    import jax

    from qwen35_jax.checkpoint import load_model
    from qwen35_jax.generation import GenerationStats, describe_cache, generate
    from qwen35_jax.parallel.mesh import make_mesh

    mesh = make_mesh(args.mesh)
    model, config = load_model(args.model, dtype=args.dtype, mesh=mesh)
    encoder = PromptEncoder(tokenizer, config.vocab_size, chat_template_kwargs=chat_kwargs,
                            tokenizer_source=tokenizer_dir)
    prompts = []
    for number, row in enumerate(rows, 1):
        try:
            ids = encoder.encode(row)
        except BadRow as err:
            raise ValueError(f"{args.prompts} row {number}: {err}") from None
        if args.max_length is not None and len(ids) + args.max_new_tokens > args.max_length:
            raise ValueError(f"{args.prompts} row {number}: its {len(ids)} prompt tokens + --max-new-tokens "
                             f"{args.max_new_tokens} exceed --max-length {args.max_length}")
        prompts.append(ids)
    stop = resolve_stop_token_ids(args.stop_token_ids, args.model, tokenizer)
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    batch = args.batch_size or len(prompts) * args.num_samples
    print(f"{len(prompts)} prompts x {args.num_samples} samples on mesh {dict(mesh.shape)}, stop ids {stop}; "
          f"{describe_cache(config, min(batch, len(prompts) * args.num_samples), longest)}", flush=True)
    stats = GenerationStats()
    start = time.perf_counter()
    completions = generate(model, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_token_ids=stop, mesh=mesh,
                           num_samples=args.num_samples, batch_size=args.batch_size, progress=True, stats=stats)
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
