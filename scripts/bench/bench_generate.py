#!/usr/bin/env python3
"""Generation speed of qwen35-jax against transformers' `generate`, same weights, greedy, on this machine.

    python scripts/bench/bench_generate.py [--steps 3] [--json out.json]
    python scripts/bench/bench_generate.py --preset 0.8B --dtype bfloat16 --skip-torch \
        --case decode:64:128:128 --case prefill:1:8192:1          # a GPU: tokens/s and the cache

Default cases, on the hidden-256, 4-layer config of bench_train.py (`qwen35_bench.train_step.SMALL`),
float32: "decode", 8 rows of 32-token prompts x 128 new tokens; "prefill", one 2,048-token prompt x
16 new tokens (--case NAME:ROWS:PROMPT:NEW replaces them). Theirs is `Qwen3_5ForCausalLM.generate`
(eager PyTorch, its hybrid cache, do_sample=False); ours is `qwen35_jax.generation.generate`
(temperature 0) on one device. Both run in this process with the same random weights (ours read from
the checkpoint transformers saved), stop tokens off, so every row makes exactly the new tokens asked
for. Each time is the median of --steps calls after one warm-up call (ours compiles in it), every
case of ours first, then every case of theirs (see `qwen35_bench.timing`). The ratio is theirs / ours
in time: above 1 means we are faster. Ours also reports its prefill and decode tokens/s separately
(the last call's) and the cache size. --preset (ours only, random init) times a published shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

DEFAULT_CASES = ["decode:8:32:128", "prefill:1:2048:16"]  # name:rows:prompt tokens:new tokens


def parse_case(text: str) -> tuple[str, int, int, int]:
    parts = text.split(":")
    try:
        name, rows, prompt, new = parts[0], *(int(p) for p in parts[1:])
    except ValueError:
        raise argparse.ArgumentTypeError(f"--case {text!r}: expected NAME:ROWS:PROMPT:NEW") from None
    if min(rows, prompt, new) < 1:
        raise argparse.ArgumentTypeError(f"--case {text!r}: rows, prompt and new tokens must be >= 1")
    return name, rows, prompt, new


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed calls per stack and case (default 3)")
    p.add_argument("--case", action="append", type=parse_case, default=None,
                   help=f"NAME:ROWS:PROMPT:NEW, repeatable (default: {' '.join(DEFAULT_CASES)})")
    p.add_argument("--preset", default=None, help="a Qwen35Config preset instead of the small config (ours only)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="our compute dtype")
    p.add_argument("--skip-torch", action="store_true", help="time ours only")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    args.case = args.case or [parse_case(c) for c in DEFAULT_CASES]
    if args.preset and not args.skip_torch:
        p.error("--preset times ours only: add --skip-torch")
    return args


def ours_call(model, prompts: np.ndarray, new: int, stats: dict):
    from qwen35_jax.generation import GenerationStats, generate

    def run() -> None:
        s = GenerationStats()
        out = generate(model, prompts.tolist(), max_new_tokens=new, temperature=0, stats=s)
        assert all(len(c.completion_ids) == new for c in out)
        stats["last"] = s

    return run


def theirs_call(model, prompts: np.ndarray, new: int):
    import torch

    ids = torch.as_tensor(prompts, dtype=torch.long)

    def run() -> None:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.shape == (ids.shape[0], ids.shape[1] + new)

    return run


def build_models(args: argparse.Namespace):
    """(ours, theirs or None, config)."""
    from qwen35_bench.train_step import SMALL, build_config

    from qwen35_jax.config import Qwen35Config

    if args.preset:
        from flax import nnx

        from qwen35_jax.model import Qwen35ForCausalLM

        config = Qwen35Config.preset(args.preset, dtype=args.dtype).text_only()  # text prompts
        return Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)), None, config
    config = build_config(SMALL, None, args.dtype)
    import torch
    import transformers

    from qwen35_jax.checkpoint import load_model
    from qwen35_jax.model import with_config

    torch.manual_seed(0)
    theirs = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**config.to_hf_dict())).float().eval()
    with tempfile.TemporaryDirectory() as tmp:
        theirs.save_pretrained(tmp)
        ours, loaded = load_model(tmp)
    ours = with_config(ours, loaded.replace(dtype=args.dtype))
    return ours, (None if args.skip_torch else theirs), config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax
    from qwen35_bench.timing import time_side_by_side

    from qwen35_jax.generation import cache_bytes
    from qwen35_jax.generation.api import PROMPT_MULTIPLE
    from qwen35_jax.parallel.padding import padded_size

    ours, theirs, config = build_models(args)
    runs, stats = {}, {}
    for name, batch, prompt_len, new in args.case:
        prompts = np.random.default_rng(0).integers(0, config.vocab_size, (batch, prompt_len))
        stats[name] = {}
        runs[name] = (ours_call(ours, prompts, new, stats[name]),
                      None if theirs is None else theirs_call(theirs, prompts, new))
    # every case of ours first, then theirs: torch's threads spin on after its calls and would slow ours
    times = {name: time_side_by_side({"ours": runs[name][0]}, args.steps) for name in runs}
    for name in runs:
        if runs[name][1] is not None:
            times[name].update(time_side_by_side({"transformers": runs[name][1]}, args.steps))
    rows = []
    for name, batch, prompt_len, new in args.case:
        t, last = times[name], stats[name]["last"]
        row = {"case": name, "rows": batch, "prompt": prompt_len, "new_tokens": new,
               **{f"{k}_s": v["median_s"] for k, v in t.items()},
               "ours_tokens_per_s": batch * new / t["ours"]["median_s"],
               "ours_prefill_tokens_per_s": last.prompt_tokens / last.prefill_seconds,
               "ours_decode_tokens_per_s": last.generated_tokens / last.decode_seconds,
               "cache_bytes": cache_bytes(config, batch, padded_size(prompt_len, PROMPT_MULTIPLE) + new - 1)["total"]}
        line = (f"{name}: {batch} rows x {prompt_len}-token prompt + {new} new: ours {row['ours_s']:.3f}s "
                f"(prefill {row['ours_prefill_tokens_per_s']:,.0f} tokens/s, decode "
                f"{row['ours_decode_tokens_per_s']:,.0f} tokens/s, cache {row['cache_bytes'] / 2**20:,.1f} MiB)")
        if "transformers" in t:
            row["transformers_s"] = t["transformers"]["median_s"]
            row["ratio"] = row["transformers_s"] / row["ours_s"]
            line += f", transformers {row['transformers_s']:.3f}s, ratio {row['ratio']:.2f}x"
        rows.append(row)
        print(f"{line} (load {t['ours']['load_average']:.1f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "cpus": os.cpu_count(), "preset": args.preset,
                       "dtype": args.dtype, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
