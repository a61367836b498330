#!/usr/bin/env python3
"""Score token sequences: per-token log-probs and entropy under a Qwen3.5 checkpoint.

    python scripts/logprobs.py --model DIR --tokens IN.npy --out OUT.npz \
        [--temperature T] [--dtype float32|bfloat16] [--mesh fsdp=F,sp=S] [--segment-ids SEG.npy]

DIR is a Hugging Face checkpoint (config.json + safetensors), one written by scripts/import_hf.py, or
a training run directory (its newest checkpoint).
IN.npy holds integer token ids [B, S]. OUT.npz holds float32 `log_probs` and `entropy`, both [B, S]:
log_probs[b, t] = log softmax(logits[b, t] / T)[tokens[b, t + 1]], 0 where t + 1 leaves the row, the
document (--segment-ids) or is padding; entropy[b, t] is the entropy of softmax(logits[b, t] / T),
0 at padding.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from qwen35_jax.files import replaced_atomically
from qwen35_jax.train.options import CHOICES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="HF checkpoint, imported checkpoint or run directory")
    parser.add_argument("--tokens", required=True, type=Path, help=".npy of integer token ids [B, S]")
    parser.add_argument("--out", required=True, type=Path, help=".npz to write (log_probs, entropy)")
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (default 1.0)")
    parser.add_argument("--dtype", choices=CHOICES["param_dtype"], default=None,
                        help="parameter and compute dtype (default: float32)")
    parser.add_argument("--mesh", default=None, help="device layout 'fsdp=F,sp=S' (default: all devices on fsdp)")
    parser.add_argument("--segment-ids", type=Path, default=None,
                        help=".npy of int document ids [B, S] for packed rows (>= 1, 0 = padding)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="rows per forward pass (default: all rows at once)")
    parser.add_argument("--backend", choices=CHOICES["logprob_backend"], default="auto",
                        help="fused log-prob/entropy backend (default: auto)")
    parser.add_argument("--lm-head", choices=CHOICES["lm_head"], default="gather",
                        help="how the sharded lm_head is used (default: gather once)")
    parser.add_argument("--attention", choices=CHOICES["attention"], default="auto",
                        help="attention kernel (default: auto; xla is the fallback everywhere; cudnn: GPU, "
                             "bfloat16)")
    parser.add_argument("--gdn-sp-mode", choices=CHOICES["gdn_sp_mode"], default="all_to_all",
                        help="GDN sequence parallelism (default: all_to_all)")
    parser.add_argument("--gdn-precision", choices=CHOICES["gdn_precision"], default="auto",
                        help="matmul precision of the GDN chunked form, as the trainer's (default: auto)")
    return parser.parse_args(argv)


def load_int_array(path: Path, what: str) -> np.ndarray:
    if not path.is_file():
        raise ValueError(f"{what} file not found: {path}")
    try:
        array = np.load(path, allow_pickle=False)
    except Exception as err:  # numpy raises several kinds for a damaged file
        raise ValueError(f"{what} file {path} is not a readable .npy array ({err})") from None
    if array.ndim != 2:
        raise ValueError(f"{what} in {path} must be 2-D [B, S], got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{what} in {path} must be integers, got dtype {array.dtype}")
    return array


def write_npz_atomically(out: Path, **arrays: np.ndarray) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with replaced_atomically(out, "wb") as f:
        np.savez(f, **arrays)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    if not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0, got {args.temperature}")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    tokens = load_int_array(args.tokens, "tokens")
    segment_ids = None
    if args.segment_ids is not None:
        segment_ids = load_int_array(args.segment_ids, "segment ids")
        if segment_ids.shape != tokens.shape:
            raise ValueError(f"segment ids {args.segment_ids} have shape {segment_ids.shape}, "
                             f"tokens {args.tokens} have {tokens.shape}")
    if args.out.exists() and args.out.is_dir():
        raise ValueError(f"--out {args.out} is a directory")

    # jax is imported only after the cheap checks, so bad input fails fast.
    from qwen35_jax.checkpoint import load_model
    from qwen35_jax.kernel_choices import check_kernel_choices, explain_compile_failure, kernels_config
    from qwen35_jax.labels import IGNORE, next_token_labels
    from qwen35_jax.model import with_config
    from qwen35_jax.parallel.mesh import init_distributed, make_mesh
    from qwen35_jax.scoring import check_inputs, score_batches

    init_distributed()
    check_kernel_choices(args.attention, args.dtype or "float32", flag="--dtype")
    mesh = make_mesh(args.mesh)
    model, config = load_model(args.model, dtype=args.dtype, mesh=mesh)
    config = kernels_config(config, attention=args.attention, gdn_sp_mode=args.gdn_sp_mode,
                            gdn_precision=args.gdn_precision)
    model = with_config(model, config)
    check_inputs(tokens, segment_ids, config.vocab_size, source=str(args.tokens))
    start = time.perf_counter()
    try:
        log_probs, entropy = score_batches(
            model, tokens, segment_ids, mesh=mesh, temperature=args.temperature,
            batch_size=args.batch_size, backend=args.backend, lm_head_mode=args.lm_head)
    except Exception as err:
        hint = explain_compile_failure(err, attention=args.attention, logprob_backend=args.backend)
        if hint is None:
            raise
        raise ValueError(hint.replace("--logprob-backend", "--backend")) from err
    seconds = time.perf_counter() - start
    write_npz_atomically(args.out, log_probs=log_probs, entropy=entropy)

    scored = np.asarray(next_token_labels(tokens, segment_ids)) != IGNORE
    mean_lp = float(log_probs[scored].mean()) if scored.any() else float("nan")
    print(f"scored {int(scored.sum())} of {tokens.size} tokens ({tokens.shape[0]} rows x {tokens.shape[1]}) "
          f"in {seconds:.1f}s on mesh {dict(mesh.shape)}: mean log-prob {mean_lp:.4f}, "
          f"perplexity {float(np.exp(-mean_lp)):.2f}, mean entropy {float(entropy.mean()):.4f} -> {args.out}")
    return 0


if __name__ == "__main__":
    from qwen35_jax.host_memory import restart_with_huge_pages

    restart_with_huge_pages()  # as scripts/train.py: huge-page malloc for XLA:CPU's scratch buffers
    sys.exit(main())
