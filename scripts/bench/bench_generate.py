#!/usr/bin/env python3
"""Generation speed of qwen35-jax against transformers' `generate`, same weights, greedy, on this machine.

    python scripts/bench/bench_generate.py [--steps 3] [--json out.json]

Two cases on the hidden-256, 4-layer config of bench_train.py (`qwen35_bench.train_step.SMALL`),
float32: "decode", 8 rows of 32-token prompts x 128 new tokens; "prefill", one 2,048-token prompt x
16 new tokens. Theirs is `Qwen3_5ForCausalLM.generate` (eager PyTorch, its hybrid cache,
do_sample=False); ours is `qwen35_jax.generation.generate` (temperature 0) on one device. Both run
in this process with the same random weights (ours read from the checkpoint transformers saved),
stop tokens off, so every row makes exactly the new tokens asked for. Each time is the median of
--steps calls after one warm-up call (ours compiles in it), every case of ours first, then every
case of theirs (see `qwen35_bench.timing`). The ratio is theirs / ours in time: above 1 means we are faster.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

CASES = {"decode": (8, 32, 128), "prefill": (1, 2048, 16)}  # rows, prompt tokens, new tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed calls per stack and case (default 3)")
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES), help="cases to run")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def ours_call(model, prompts: np.ndarray, new: int):
    from qwen35_jax.generation import generate

    def run() -> None:
        out = generate(model, prompts.tolist(), max_new_tokens=new, temperature=0)
        assert all(len(c.completion_ids) == new for c in out)

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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import transformers
    from qwen35_bench.timing import time_side_by_side
    from qwen35_bench.train_step import SMALL, build_config

    from qwen35_jax.checkpoint import load_model

    config = build_config(SMALL, None)
    torch.manual_seed(0)
    theirs = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**config.to_hf_dict())).float().eval()
    with tempfile.TemporaryDirectory() as tmp:
        theirs.save_pretrained(tmp)
        ours, _ = load_model(tmp)
    runs = {}
    for name in args.cases:
        batch, prompt_len, new = CASES[name]
        prompts = np.random.default_rng(0).integers(0, config.vocab_size, (batch, prompt_len))
        runs[name] = (ours_call(ours, prompts, new), theirs_call(theirs, prompts, new))
    # every case of ours first, then theirs: torch's threads spin on after its calls and would slow ours
    times = {name: time_side_by_side({"ours": runs[name][0]}, args.steps) for name in args.cases}
    for name in args.cases:
        times[name].update(time_side_by_side({"transformers": runs[name][1]}, args.steps))
    rows = []
    for name in args.cases:
        batch, prompt_len, new = CASES[name]
        t = times[name]
        tokens = batch * new
        row = {"case": name, "rows": batch, "prompt": prompt_len, "new_tokens": new,
               **{f"{k}_s": v["median_s"] for k, v in t.items()},
               "ours_tokens_per_s": tokens / t["ours"]["median_s"],
               "transformers_tokens_per_s": tokens / t["transformers"]["median_s"],
               "ratio": t["transformers"]["median_s"] / t["ours"]["median_s"]}
        rows.append(row)
        print(f"{name}: {batch} rows x {prompt_len}-token prompt + {new} new: ours {row['ours_s']:.3f}s, "
              f"transformers {row['transformers_s']:.3f}s, ratio {row['ratio']:.2f}x "
              f"(load {t['ours']['load_average']:.1f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": os.cpu_count(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
