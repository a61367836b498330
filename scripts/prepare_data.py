"""Tokenise and pack JSONL files once into a prepared dataset for `train.py --data`.

    python scripts/prepare_data.py data/*.jsonl --tokenizer Qwen3.5-0.8B --seq-len 4096 --out data/packed

Rows are {"text"}, {"input_ids"[, "loss_mask"]}, {"messages"} or {"prompt", "response"} objects, one per
line (.jsonl or .jsonl.gz; directories are searched). See docs/data.md.
"""

import argparse
import sys

from qwen35_jax.data.packing import LONG_ROW_POLICIES
from qwen35_jax.data.prepare import default_vocab_size, describe, prepare_dataset
from qwen35_jax.data.rows import BAD_ROW_POLICIES


def main() -> int:
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
    parser.add_argument("--workers", type=int, default=0,
                        help="tokenising worker processes; the output does not depend on it (default 0)")
    args = parser.parse_args()
    try:
        vocab_size = args.vocab_size or default_vocab_size(args.tokenizer)
        manifest = prepare_dataset(args.inputs, args.out, tokenizer=args.tokenizer, seq_len=args.seq_len,
                                   vocab_size=vocab_size, seed=args.seed,
                                   long_rows=args.long_rows, bad_rows=args.bad_rows, worker_count=args.workers)
    except ValueError as err:
        print(f"prepare_data.py: error: {err}", file=sys.stderr)
        return 1
    print(describe(manifest))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
