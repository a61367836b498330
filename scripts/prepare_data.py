"""Tokenise and pack JSONL files once into a prepared dataset for `train.py --data`.

    python scripts/prepare_data.py data/*.jsonl --tokenizer Qwen3.5-0.8B --seq-len 4096 --out data/packed

Rows are {"text"}, {"input_ids"[, "loss_mask"]}, {"messages"} or {"prompt", "response"} objects, one per
line (.jsonl or .jsonl.gz; directories are searched). See docs/data.md.

When --tokenizer is a vision-language checkpoint (its config.json has a vision_config), chat rows may hold
images ({"type": "image", "image": PATH}, PATH relative to the JSONL file's folder): they are processed
with the checkpoint's preprocessor_config.json (else Qwen3.5's settings), sized by --min-pixels and
--max-pixels, and stored beside the rows. Without a vision tower a row with an image is an error.
"""

import json
import os

import argparse
import sys

from qwen35_jax.data.batches import check_image_inputs, image_processor_for
from qwen35_jax.data.packing import LONG_ROW_POLICIES
from qwen35_jax.data.prepare import default_vocab_size, describe, prepare_dataset
from qwen35_jax.data.rows import BAD_ROW_POLICIES


def vision_config(directory: str):
    """The vision tower of the checkpoint whose config.json sits in `directory`, or None (a tokenizer
    directory, or a text model)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(raw, dict) or not raw.get("vision_config"):
        return None
    from qwen35_jax.vision.config import VisionConfig

    return VisionConfig.from_hf(raw["vision_config"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="JSONL files (.jsonl, .jsonl.gz) or directories of them")
    parser.add_argument("--tokenizer", required=True, help="HF checkpoint or tokenizer directory")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per packed row")
    parser.add_argument("--out", required=True, help="output directory (must not exist)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="model vocabulary size ids must fit (default: the tokenizer directory's "
                             "config.json, else the tokenizer's size)")
    parser.add_argument("--long-rows", choices=LONG_ROW_POLICIES, default="split",
                        help="rows longer than --seq-len (default: split)")
    parser.add_argument("--bad-rows", choices=BAD_ROW_POLICIES, default="skip",
                        help="rows that cannot be used: skip and count them, or stop (default: skip)")
    parser.add_argument("--seed", type=int, default=0, help="order in which rows are packed (default 0)")
    parser.add_argument("--min-pixels", type=int, default=None,
                        help="images smaller than this many pixels are scaled up (default: the checkpoint's "
                             "preprocessor_config.json, else 65536)")
    parser.add_argument("--max-pixels", type=int, default=None,
                        help="images larger than this many pixels are scaled down (default: the checkpoint's "
                             "preprocessor_config.json, else 16777216)")
    parser.add_argument("--workers", type=int, default=0,
                        help="tokenising worker processes; the output does not depend on it (default 0)")
    args = parser.parse_args(argv)
    try:
        vocab_size = args.vocab_size or default_vocab_size(args.tokenizer)
        processor = image_processor_for(vision_config(args.tokenizer), args.tokenizer, min_pixels=args.min_pixels,
                                        max_pixels=args.max_pixels)
        check_image_inputs(args.inputs, vision=processor is not None)
        if os.path.exists(args.out):
            raise ValueError(f"{args.out} already exists: choose a new output directory")
        manifest = prepare_dataset(args.inputs, args.out, tokenizer=args.tokenizer, seq_len=args.seq_len,
                                   vocab_size=vocab_size, seed=args.seed, long_rows=args.long_rows,
                                   bad_rows=args.bad_rows, worker_count=args.workers, image_processor=processor)
    except ValueError as err:
        print(f"prepare_data.py: error: {err}", file=sys.stderr)
        return 1
    print(describe(manifest))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
