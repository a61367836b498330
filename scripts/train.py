#!/usr/bin/env python3
"""Train a Qwen3.5 model with the SFT or PPO objective on an (fsdp, sp) mesh.

    python scripts/train.py (--model DIR | --preset NAME) (--data DIR | --synthetic) --out DIR \
        [--objective sft|ppo] [--mesh fsdp=F,sp=S] [--batch-size B] [--steps N] [--lr LR] [--temperature T]

DIR for --model is a Hugging Face checkpoint or one of ours; --preset starts from a random init.
--data DIR holds tokens.npy [N, S] and optionally segment_ids.npy, loss_mask.npy and, for PPO,
old_log_probs.npy and advantages.npy, all [N, S] (docs/training.md). --synthetic trains on random
tokens (PPO: random advantages, old log-probs scored with the starting model). The trained parameters
are written to --out as a qwen35_jax checkpoint (scripts/export_hf.py turns it back into HF).
"""

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    start = parser.add_mutually_exclusive_group(required=True)
    start.add_argument("--model", type=Path, help="HF checkpoint dir or qwen35_jax checkpoint dir")
    start.add_argument("--preset", help="random init of a named config (e.g. tiny, 0.8B)")
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", type=Path, help="directory of .npy files (tokens.npy, ...)")
    data.add_argument("--synthetic", action="store_true", help="random tokens instead of --data")
    parser.add_argument("--out", required=True, type=Path, help="new directory for the trained checkpoint")
    parser.add_argument("--objective", choices=["sft", "ppo"], default="sft", help="loss (default: sft)")
    parser.add_argument("--mesh", default=None, help="device layout 'fsdp=F,sp=S' (default: all devices on fsdp)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="global rows per step, a multiple of fsdp (default: fsdp)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--lr", type=float, default=1e-5, help="peak learning rate (default 1e-5)")
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear warmup steps (default 0)")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    parser.add_argument("--clip-norm", type=float, default=1.0, help="global gradient-norm clip (default 1.0)")
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (default 1.0)")
    parser.add_argument("--clip-ratio", type=float, default=0.2, help="PPO ratio clip (default 0.2)")
    parser.add_argument("--entropy-coef", type=float, default=0.0, help="PPO entropy bonus (default 0)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="parameter dtype (default: as stored; presets float32)")
    parser.add_argument("--seq-len", type=int, default=128, help="--synthetic row length (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="seed of --preset init and --synthetic data")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """The checks that need no JAX; one-line ValueErrors."""
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {args.seq_len}")
    for name in ("lr", "temperature", "clip_norm", "clip_ratio"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.warmup_steps < 0 or args.warmup_steps > args.steps:
        raise ValueError(f"--warmup-steps must be in [0, --steps={args.steps}], got {args.warmup_steps}")
    if args.weight_decay < 0 or args.entropy_coef < 0:
        raise ValueError("--weight-decay and --entropy-coef must be >= 0")
    if args.out.exists():
        raise ValueError(f"--out {args.out} already exists")
    if args.model is not None and not args.model.is_dir():
        raise ValueError(f"--model directory not found: {args.model}")
    if args.data is not None and not args.data.is_dir():
        raise ValueError(f"--data directory not found: {args.data}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    check_args(args)
    # jax is imported only after the cheap checks, so bad input fails fast.
    import jax
    from flax import nnx

    from qwen35_jax.checkpoint import is_checkpoint, load_checkpoint, save_checkpoint
    from qwen35_jax.config import Qwen35Config
    from qwen35_jax.hf.load import load_hf
    from qwen35_jax.hf.names import Layout
    from qwen35_jax.model import Qwen35ForCausalLM
    from qwen35_jax.parallel.mesh import FSDP, create_sharded, init_distributed, make_mesh, mesh_axis_size
    from qwen35_jax.scoring import score_batches
    from qwen35_jax.train import (BatchSource, check_batch_size, create_optimizer, load_npy_dir, make_optimizer,
                                  make_schedule, make_train_step, synthetic_data)

    init_distributed()
    mesh = make_mesh(args.mesh)
    fsdp = mesh_axis_size(mesh, FSDP)
    batch_size = fsdp if args.batch_size is None else args.batch_size
    check_batch_size(batch_size, fsdp)
    data = load_npy_dir(str(args.data)) if args.data is not None else None

    layout, hf_config = None, None
    if args.preset is not None:
        config = Qwen35Config.preset(args.preset, **({"param_dtype": args.dtype} if args.dtype else {}))
        model = create_sharded(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(args.seed)), mesh)
    elif is_checkpoint(str(args.model)):
        model, config, meta = load_checkpoint(str(args.model), dtype=args.dtype, mesh=mesh)
        layout = Layout.from_dict(meta["layout"]) if meta.get("layout") else None
        hf_config = meta.get("hf_config")
    else:
        model, config, ckpt = load_hf(str(args.model), dtype=args.dtype, mesh=mesh)
        layout, hf_config = ckpt.layout, ckpt.raw_config

    source = str(args.data) if args.data is not None else "synthetic data"
    if data is None:
        data = synthetic_data(batch_size, args.seq_len, config.vocab_size, objective=args.objective,
                              seed=args.seed)
        if args.objective == "ppo":  # on-policy: the behaviour policy is the starting model
            data["old_log_probs"], _ = score_batches(model, data["tokens"], None, mesh=mesh,
                                                     temperature=args.temperature)
    batches = BatchSource(data, batch_size, mesh, vocab_size=config.vocab_size, objective=args.objective,
                          source=source)

    schedule = make_schedule(args.lr, args.steps, args.warmup_steps)
    tx = make_optimizer(schedule, weight_decay=args.weight_decay, clip_norm=args.clip_norm)
    optimizer = create_optimizer(model, tx, mesh)
    train_step = make_train_step(schedule, objective=args.objective, temperature=args.temperature,
                                 clip_low=args.clip_ratio, entropy_coef=args.entropy_coef)

    lead = jax.process_index() == 0
    with jax.set_mesh(mesh):
        for step in range(args.steps):
            start = time.perf_counter()
            metrics = jax.device_get(train_step(model, optimizer, batches.batch(step)))
            if lead:
                extra = "".join(f" {k} {float(metrics[k]):.4f}" for k in ("ratio_mean", "clip_fraction", "approx_kl")
                                if k in metrics)
                print(f"step {step + 1}/{args.steps} loss {float(metrics['loss']):.4f} "
                      f"grad_norm {float(metrics['grad_norm']):.4f} lr {float(metrics['lr']):.3g} "
                      f"tokens {int(metrics['tokens'])}{extra} ({time.perf_counter() - start:.2f}s)", flush=True)
            if not (np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])):
                raise ValueError(f"step {step + 1}: loss or gradient norm is not finite; nothing written")
    save_checkpoint(os.fspath(args.out), model, config, layout=layout, hf_config=hf_config)
    if lead:
        print(f"saved {args.out} (mesh {dict(mesh.shape)}, batch {batch_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
