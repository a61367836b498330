#!/usr/bin/env python3
"""Train-step speed of qwen35-jax against transformers' PyTorch model, side by side in one process.

    python scripts/bench_train.py [--config small|large|long ...] [--steps 5] [--remat REMAT]
                                  [--cores [gdn attention]] [--breakdown] [--json out.json]
    python scripts/bench_train.py --preset 0.8B --dtype bfloat16 --seq 8192 --skip-torch --peak-tflops 989

Both stacks train the same architecture (random weights) on the same batch of random tokens, one
document per row, with AdamW (lr 1e-4, betas 0.9/0.95, gradient clipping at norm 1), float32. Ours is
the jitted `qwen35_jax.train.make_train_step` (SFT loss, fused log-prob kernel); theirs is
transformers' `Qwen3_5ForCausalLM` on its default path (eager, default attention implementation)
with `labels=`, `loss.backward()`, `clip_grad_norm_` and `torch.optim.AdamW`. Each time is the
median of --steps steps after one warm-up step (ours compiles in it). Each stack runs every row in a
child process of its own, ours first, then theirs: in one process each library's spinning CPU
threads slow the other one down. The ratio is theirs / ours in time, i.e. ours / theirs in tokens
per second: above 1 means we are faster.

--cores adds the sequence mixers alone, forward+backward at S = --core-seq: the GDN core
(`chunked_gated_delta_rule` vs transformers' `torch_chunk_gated_delta_rule`, H = 8, d = 128) and the
causal document-masked attention core (`attention_core` vs `scaled_dot_product_attention` with the
same boolean mask, 4 query / 2 kv heads of 64, 2 documents). --peak-tflops adds the model FLOPs
utilisation of our step, with the model FLOPs the trainer logs (`qwen35_jax.train.flops.train_flops`:
every matmul of the forward pass, attention scores over the full S^2, times 3).
Each stack runs with what its users get by default: ours restarts with
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 as scripts/train.py does (huge pages for XLA:CPU's scratch
buffers, `qwen35_jax/host_memory.py`), transformers runs in the environment it was given. Launch with
that variable set to give it to both; the header prints each stack's GLIBC_TUNABLES.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

from qwen35_jax.config import PRESETS, SCAN_LAYERS_FLAGS

# name -> (model settings, batch, sequence); intermediate_size is 3.5 x hidden as in the published 0.8B.
SMALL = dict(hidden=256, intermediate=896, layers=4, heads=4, kv_heads=2, head_dim=64, gdn_key_heads=4,
             gdn_value_heads=8, gdn_head_dim=32, vocab=4096, mrope=(2, 3, 3))
LARGE = dict(hidden=1024, intermediate=3584, layers=4, heads=8, kv_heads=2, head_dim=256, gdn_key_heads=16,
             gdn_value_heads=16, gdn_head_dim=128, vocab=4096, mrope=(11, 11, 10))
CONFIGS = {
    "small": (SMALL, 4, 512),
    "long": (SMALL, 1, 4096),
    "large": (LARGE, 1, 2048),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", nargs="+", choices=sorted(CONFIGS), default=["small"],
                   help="named configs to run, in order (default small); the flags below override the "
                        "first one's settings")
    p.add_argument("--preset", default=None,
                   help="instead of --config: a Qwen35Config preset (e.g. 0.8B), all its layers")
    for name, default in SMALL.items():
        if name != "mrope":
            p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                           help=f"override {name} (small: {default})")
    p.add_argument("--batch", type=int, default=None, help="rows per step (overrides the config's)")
    p.add_argument("--seq", type=int, default=None, help="tokens per row (overrides the config's)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="our compute dtype, parameters float32 (default float32; transformers runs float32 only)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per stack, after one warm-up (default 5)")
    p.add_argument("--remat", default=None,
                   help="Qwen35Config.remat of our model (default: the config's, auto): true/false or a "
                        "policy name")
    p.add_argument("--attention", choices=["auto", "xla", "pallas"], default="auto",
                   help="our attention kernel, as scripts/train.py's --attention (default auto: Pallas on GPU/TPU)")
    p.add_argument("--logprob-backend", choices=["auto", "xla", "pallas"], default="auto",
                   help="our fused log-prob backend, as scripts/train.py's (default auto: Pallas on TPU, XLA elsewhere)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after the timed steps, trace one more step of ours with jax.profiler into DIR")
    p.add_argument("--scan-layers", choices=list(SCAN_LAYERS_FLAGS), default="auto",
                   help="Qwen35Config.scan_layers of our model: the blocks as one lax.scan (true) or one after "
                        "another (false); default auto: false on GPU, true elsewhere")
    p.add_argument("--gdn-remat", default=None,
                   help="what our GDN mixers keep for the backward: auto, none or states (default auto: states "
                        "with the Pallas chunk scan, none otherwise)")
    p.add_argument("--gdn-precision", default=None,
                   help="matmul precision of our GDN core: auto, highest, high or default (default: auto, "
                        "highest on CPU, default elsewhere)")
    p.add_argument("--gdn-chunk-scan", default=None,
                   help="how our GDN core carries its state over chunks: auto, sequential or associative "
                        "(default: auto, sequential on CPU, associative elsewhere)")
    p.add_argument("--cores", nargs="*", choices=["gdn", "attention"], default=None,
                   help="also time the sequence mixers alone (no names: both)")
    p.add_argument("--cores-only", action="store_true", help="time --cores alone, no train step")
    p.add_argument("--core-seq", type=int, default=4096, help="sequence length of --cores (default 4096)")
    p.add_argument("--core-heads", type=int, default=8, help="GDN heads of --cores (default 8)")
    p.add_argument("--core-dim", type=int, default=128, help="GDN head dim of --cores (default 128)")
    p.add_argument("--core-precisions", nargs="+", default=None,
                   help="time the GDN core at each of these precisions, errors against the first")
    p.add_argument("--core-scans", nargs="+", default=None,
                   help="time the GDN core with each of these chunk scans (with every --core-precisions), "
                        "errors against the first variant")
    p.add_argument("--core-kernel-blocks", nargs="+", default=None, metavar="BV:WARPS",
                   help="time the GDN core's Pallas chunk-state kernels with each of these (state columns per "
                        "program, warps), e.g. 32:4 64:4 64:8 (with --core-scans pallas)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time our pieces alone (each layer kind, mixer, MLP, delta rule, loss, model "
                        "body) on the first config's shapes")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak TFLOP/s for our step's model FLOPs utilisation (MFU); default: the "
                        "trainer's table for known GPUs/TPUs (qwen35_jax.train.flops), none on CPU")
    p.add_argument("--skip-torch", action="store_true", help="time ours only (no ratios)")
    p.add_argument("--stack", choices=["both", "ours", "transformers"], default="both",
                   help="both (default): each stack in a child process of its own, ours first (in one "
                        "process the stack timed second runs up to 2x slower: the other's CPU threads "
                        "keep spinning); ours / transformers: time that stack only, in this process")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --stack both: time the two stacks' child processes this many times in turn "
                        "(ours, theirs, ours, theirs, ...) and report each row's median over rounds and every "
                        "round's ratio (default 1)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    args.scan_layers = SCAN_LAYERS_FLAGS[args.scan_layers]
    args.run_ours = args.stack in ("both", "ours")
    args.run_torch = args.stack in ("both", "transformers") and not args.skip_torch
    if args.cores == []:
        args.cores = ["gdn", "attention"]
    if args.cores_only and not args.cores:
        p.error("--cores-only needs --cores")
    for name in ("steps", "rounds", "batch", "seq", "core_seq", "core_heads", "core_dim",
                 *(k for k in SMALL if k != "mrope")):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.rounds > 1 and not (args.stack == "both" and args.run_torch):
        p.error("--rounds > 1 alternates both stacks: it needs --stack both without --skip-torch")
    if args.dtype != "float32" and not args.skip_torch:
        p.error("--dtype bfloat16 needs --skip-torch (the transformers side runs float32)")
    if args.preset is not None and args.preset not in PRESETS:
        p.error(f"unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}")
    from qwen35_jax.layers.chunk_states import GDN_CHUNK_SCANS, GDN_REMATS
    from qwen35_jax.layers.delta_rule import GDN_PRECISIONS

    blocks = []
    for value in args.core_kernel_blocks or []:
        try:
            bv, warps = (int(x) for x in value.split(":"))
        except ValueError:
            p.error(f"--core-kernel-blocks takes BV:WARPS pairs such as 64:4, got {value!r}")
        blocks.append((bv, warps))
    args.core_kernel_blocks = blocks or None
    if args.gdn_remat is not None and args.gdn_remat not in GDN_REMATS:
        p.error(f"GDN remat {args.gdn_remat!r} is not one of {GDN_REMATS}")

    for value in [args.gdn_precision, *(args.core_precisions or [])]:
        if value is not None and value not in GDN_PRECISIONS:
            p.error(f"GDN precision {value!r} is not one of {GDN_PRECISIONS}")
    for value in [args.gdn_chunk_scan, *(args.core_scans or [])]:
        if value is not None and value not in GDN_CHUNK_SCANS:
            p.error(f"GDN chunk scan {value!r} is not one of {GDN_CHUNK_SCANS}")
    return args


def parse_remat(value: str | None) -> bool | str | None:
    if value is None:
        return None
    low = value.lower()
    if low in ("true", "on", "1"):
        return True
    if low in ("false", "off", "0"):
        return False
    return value


def build_config(settings: dict, remat: bool | str | None, dtype: str = "float32"):
    from qwen35_jax.config import Qwen35Config, hybrid_layer_types

    s = settings
    cfg = Qwen35Config(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"], rms_norm_eps=1e-6, rope_theta=10_000_000.0, partial_rotary_factor=0.25,
        mrope_section=tuple(s["mrope"]), mrope_interleaved=True, tie_word_embeddings=False,
        layer_types=hybrid_layer_types(s["layers"], 4), linear_conv_kernel_dim=4,
        linear_key_head_dim=s["gdn_head_dim"], linear_value_head_dim=s["gdn_head_dim"],
        linear_num_key_heads=s["gdn_key_heads"], linear_num_value_heads=s["gdn_value_heads"], num_experts=0,
        num_experts_per_tok=0, moe_intermediate_size=0, shared_expert_intermediate_size=0,
        norm_topk_prob=False, hf_model_type="qwen3_5_text", dtype=dtype)
    return cfg if remat is None else cfg.replace(remat=remat)


def runs(args: argparse.Namespace) -> list[tuple[str, object, int, int]]:
    """(name, Qwen35Config, batch, seq) of every train step to time."""
    from qwen35_jax.config import Qwen35Config

    remat = parse_remat(args.remat)
    if args.preset is not None:
        config = Qwen35Config.preset(args.preset, dtype=args.dtype, scan_layers=args.scan_layers)
        config = config if remat is None else config.replace(remat=remat)
        return [(args.preset, config, args.batch or 1, args.seq or 8192)]
    out = []
    for i, name in enumerate(args.config):
        settings, batch, seq = CONFIGS[name]
        settings = dict(settings)
        if i == 0:
            settings.update({k: getattr(args, k) for k in SMALL if k != "mrope" and getattr(args, k) is not None})
            batch, seq = args.batch or batch, args.seq or seq
        config = build_config(settings, remat, args.dtype).replace(scan_layers=args.scan_layers)
        out.append((name, config, batch, seq))
    return out


def ours_step(config, tokens, attention: str = "auto", logprob_backend: str = "auto") -> Callable[[], None]:
    """One of our train steps on `tokens` [B, S] (int numpy), as a callable that blocks until done."""
    import jax
    import numpy as np
    from flax import nnx

    from qwen35_jax.kernel_choices import kernel_choices
    from qwen35_jax.model import Qwen35ForCausalLM
    from qwen35_jax.parallel.mesh import create_sharded, make_mesh
    from qwen35_jax.train import StepOptions, init_opt_state, make_optimizer, make_schedule, place_batch
    from qwen35_jax.train.remat_choice import make_config_train_step

    mesh = make_mesh((1, 1), jax.devices()[:1])
    model = create_sharded(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)), mesh)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tx = make_optimizer(make_schedule(1e-4, 1000))
    opt_state = init_opt_state(tx, params, mesh)
    step = make_config_train_step(config, tx, StepOptions(backend=logprob_backend),
                                  jax.tree.map(lambda x: x.sharding, (params, opt_state)))
    ones = np.ones(tokens.shape, np.int32)
    batch = place_batch({"tokens": tokens.astype(np.int32), "segment_ids": ones, "loss_mask": ones}, mesh, 1, 1)
    state = [params, opt_state]

    def run() -> None:
        with jax.set_mesh(mesh), kernel_choices(attention=attention):  # the first call traces
            state[0], state[1], metrics = step(state[0], state[1], batch)
            jax.block_until_ready(metrics)

    run.remat = lambda: getattr(step, "policy", None) or config.remat  # what "auto" chose, once run
    return run


def torch_step(config, tokens) -> Callable[[], None]:
    """transformers' train step on the same config and tokens: eager, default attention, AdamW."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.Qwen3_5TextConfig(**config.to_hf_dict())
    model = transformers.Qwen3_5ForCausalLM(hf_config).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    ids = torch.as_tensor(tokens, dtype=torch.long)

    def run() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def time_side_by_side(fns: dict[str, Callable[[], None]], steps: int) -> dict[str, dict[str, float]]:
    """For each stack in turn: one warm-up call, then the median (and min/max) of `steps` timed calls.

    One stack at a time, not alternating step by step: XLA's and torch's CPU thread pools each spin
    for a while after their work, and interleaved they slow each other down several-fold.
    """
    out = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        warm = time.perf_counter() - t0
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                     "warmup_s": warm, "load_average": os.getloadavg()[0]}
    return out


def bench_config(name: str, config, batch: int, seq: int, args: argparse.Namespace) -> dict:
    import jax
    import numpy as np

    from qwen35_jax.train.flops import peak_tflops, train_flops

    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, seq))
    fns = {"ours": ours_step(config, tokens, args.attention, args.logprob_backend)} if args.run_ours else {}
    if args.run_torch:
        fns["transformers"] = torch_step(config, tokens)
    timings = time_side_by_side(fns, args.steps)
    remat = config.remat if "ours" not in fns or fns["ours"].remat() == config.remat else \
        f"{config.remat} -> {fns['ours'].remat()}"
    row = {"config": name, "batch": batch, "seq": seq, "remat": remat, "dtype": config.dtype,
           "model_tflops_per_step": train_flops(config, batch, seq) / 1e12, **timings}
    if "ours" in fns:
        row["ours"].update(attention=args.attention, logprob_backend=args.logprob_backend)
        if args.profile:  # one more step, traced; the trace lands in DIR/<name>/plugins/profile/<run>/
            try:
                with jax.profiler.trace(os.path.join(args.profile, name)):
                    fns["ours"]()
            except Exception as e:  # noqa: BLE001 - a profiler that cannot start must not lose the timings
                print(f"bench_train: no profile ({type(e).__name__}: {e})", file=sys.stderr)
    peak = args.peak_tflops or peak_tflops(jax.devices()[0])
    if peak and "ours" in row:
        row["ours"]["mfu"] = row["model_tflops_per_step"] / row["ours"]["median_s"] / peak
    return row


def jit_cpu_tuned(fn: Callable) -> Callable:
    """`jax.jit` with the compiler options our train step uses (`qwen35_jax.xla_options`)."""
    import jax

    from qwen35_jax.xla_options import compiler_options

    return jax.jit(fn, compiler_options=compiler_options())


def _with_kernel_blocks(blocks: tuple[int, int], fn: Callable, *args: object) -> object:
    from qwen35_jax.layers.chunk_states_pallas import gdn_kernel_blocks

    with gdn_kernel_blocks(*blocks):
        return fn(*args)


def bench_cores(args: argparse.Namespace) -> list[dict]:
    """The sequence mixers alone, forward+backward of sum(out * cotangent), at S = --core-seq."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from qwen35_jax.layers.attention import attention_core
    from qwen35_jax.layers.delta_rule import chunked_gated_delta_rule

    rng = np.random.default_rng(0)
    rows = []
    B, S = 1, args.core_seq
    if "gdn" in args.cores:
        # key heads = value heads; q, k L2-normalised (torch's scales q inside, ours takes it scaled)
        H, D = args.core_heads, args.core_dim
        q, k = (rng.standard_normal((B, S, H, D)).astype(np.float32) for _ in range(2))
        q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
        v = rng.standard_normal((B, S, H, D)).astype(np.float32)
        g = -np.abs(rng.standard_normal((B, S, H))).astype(np.float32) * 0.1
        beta = (1 / (1 + np.exp(-rng.standard_normal((B, S, H))))).astype(np.float32)
        cot = rng.standard_normal((B, S, H, D)).astype(np.float32)
        jargs = [jnp.asarray(x) for x in (q, k, v, g, beta)]
        grads = {}
        variants = [(scan, precision, blocks) for scan in args.core_scans or [None]
                    for precision in args.core_precisions or [None] for blocks in args.core_kernel_blocks or [None]]
        for scan, precision, blocks in variants:
            def gdn_loss(q, k, v, g, beta, precision=precision, scan=scan):
                out, _ = chunked_gated_delta_rule(q * D**-0.5, k, v, g, beta, precision=precision,
                                                  chunk_scan=scan)
                return jnp.sum(out * cot)

            grad = jit_cpu_tuned(jax.grad(gdn_loss, argnums=(0, 1, 2, 3, 4)))
            if blocks is not None:  # traced (at the first call) inside the kernel-blocks setting
                grad = (lambda *a, grad=grad, blocks=blocks: _with_kernel_blocks(blocks, grad, *a))
            label = None if blocks is None else "blocks {}x{}".format(*blocks)
            grads[" ".join(["ours", *(x for x in (precision, scan, label) if x is not None)])] = grad
        fns = {name: (lambda f=f: jax.block_until_ready(f(*jargs))) for name, f in grads.items()} \
            if args.run_ours else {}
        if args.run_torch:
            import torch
            from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

            targs = [torch.tensor(x, requires_grad=True) for x in (q, k, v, g, beta)]
            tcot = torch.tensor(cot)

            def torch_gdn() -> None:
                out, _ = torch_chunk_gated_delta_rule(*targs)
                torch.autograd.grad((out * tcot).sum(), targs)

            fns["transformers"] = torch_gdn
        row = {"config": "gdn_core", "settings": dict(B=B, S=S, H=H, d=D), "batch": B, "seq": S,
               **time_side_by_side(fns, args.steps)}
        if args.run_ours and len(grads) > 1:  # every precision's gradients against the first one's
            ref = [np.asarray(x, np.float64) for x in next(iter(grads.values()))(*jargs)]
            for name, f in list(grads.items())[1:]:
                got = f(*jargs)
                row[name]["max_rel_grad_err_vs_first"] = max(
                    float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max()) for a, b in zip(got, ref))
        rows.append(row)

    if "attention" in args.cores:
        # 4 query / 2 kv heads of 64, two documents (cut at S / 3)
        H, K, Dh = 4, 2, 64
        qa = rng.standard_normal((B, S, H, Dh)).astype(np.float32)
        ka, va = (rng.standard_normal((B, S, K, Dh)).astype(np.float32) for _ in range(2))
        seg = (1 + (np.arange(S) >= S // 3)).astype(np.int32)[None].repeat(B, 0)
        cot = rng.standard_normal((B, S, H, Dh)).astype(np.float32)

        def attn_loss(q, k, v):
            return jnp.sum(attention_core(q, k, v, jnp.asarray(seg)) * cot)

        attn_grad = jit_cpu_tuned(jax.grad(attn_loss, argnums=(0, 1, 2)))
        jargs_a = [jnp.asarray(x) for x in (qa, ka, va)]
        fns = {"ours": lambda: jax.block_until_ready(attn_grad(*jargs_a))} if args.run_ours else {}
        if args.run_torch:
            import torch
            import torch.nn.functional as F

            tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (qa, ka, va))
            tseg = torch.tensor(seg)
            mask = (torch.tril(torch.ones(S, S, dtype=torch.bool)) & (tseg[:, :, None] == tseg[:, None, :]))[:, None]
            tcot_a = torch.tensor(cot)

            def torch_attn() -> None:
                out = F.scaled_dot_product_attention(tq.transpose(1, 2), tk.transpose(1, 2), tv.transpose(1, 2),
                                                     attn_mask=mask, enable_gqa=True).transpose(1, 2)
                torch.autograd.grad((out * tcot_a).sum(), (tq, tk, tv))

            fns["transformers"] = torch_attn
        rows.append({"config": "attention_core", "settings": dict(B=B, S=S, H=H, K=K, Dh=Dh), "batch": B,
                     "seq": S, **time_side_by_side(fns, args.steps)})
    return rows


def bench_breakdown(config, batch: int, seq: int, steps: int) -> list[dict]:
    """Where our step's time goes: forward and forward+backward of each piece alone, jitted, on the
    config's shapes (remat as configured only applies to the whole model)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from qwen35_kernels import linear_logprob_entropy

    from qwen35_jax.model import DecoderLayer, Qwen35ForCausalLM
    from qwen35_jax.layers.delta_rule import chunked_gated_delta_rule
    from qwen35_jax.layers.rope import rope_cos_sin

    rng = np.random.default_rng(0)
    B, S, D = batch, seq, config.hidden_size
    x = jnp.asarray(rng.standard_normal((B, S, D)).astype(np.float32))
    seg = jnp.ones((B, S), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(S), (3, B, S))
    cos, sin = rope_cos_sin(pos, config)
    pieces: dict[str, tuple[nnx.Module, tuple]] = {}

    for kind in ("linear_attention", "full_attention"):
        layer = DecoderLayer(config, kind, rngs=nnx.Rngs(0))
        pieces[f"layer {kind}"] = (layer, (x, cos, sin, seg))
        if kind == "linear_attention":
            pieces["  mixer GatedDeltaNet"] = (layer.linear_attn, (x, seg))
        else:
            pieces["  mixer Attention"] = (layer.self_attn, (x, cos, sin, seg))
        pieces["  mlp"] = (layer.mlp, (x,))

    results = []

    def time_piece(name: str, fwd: Callable, grad: Callable, args: tuple) -> None:
        r = {"piece": name}
        for label, f in (("fwd_s", fwd), ("fwd_bwd_s", grad)):
            jax.block_until_ready(f(*args))
            ts = []
            for _ in range(steps):
                t0 = time.perf_counter()
                jax.block_until_ready(f(*args))
                ts.append(time.perf_counter() - t0)
            r[label] = statistics.median(ts)
        results.append(r)
        print(f"{name:40s} fwd {r['fwd_s']:.3f} s  fwd+bwd {r['fwd_bwd_s']:.3f} s", flush=True)

    for name, (module, inputs) in pieces.items():
        graphdef, state = nnx.split(module)

        def loss(state, *inputs, graphdef=graphdef):
            out = nnx.merge(graphdef, state)(*inputs)
            return jnp.sum(out * out) * 1e-3

        time_piece(name, jit_cpu_tuned(loss), jit_cpu_tuned(jax.grad(loss, argnums=(0, 1))), (state, *inputs))

    # the delta rule alone, on the GDN layer's head shapes
    Hk, Hv = config.linear_num_key_heads, config.linear_num_value_heads
    Dk, Dv = config.linear_key_head_dim, config.linear_value_head_dim
    q, k = (jnp.asarray(rng.standard_normal((B, S, Hk, Dk)).astype(np.float32) * Dk**-0.5) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, S, Hv, Dv)).astype(np.float32))
    g = jnp.full((B, S, Hv), -0.05, jnp.float32)
    beta = jnp.full((B, S, Hv), 0.5, jnp.float32)

    chunk = config.gdn_chunk(jax.default_backend())

    def rule(q, k, v, g, beta):
        return jnp.sum(chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk)[0])

    time_piece("    delta rule", jit_cpu_tuned(rule), jit_cpu_tuned(jax.grad(rule, argnums=(0, 1, 2, 3, 4))), (q, k, v, g, beta))

    # the loss: lm_head + fused log-probs on the final hidden states
    w = jnp.asarray(rng.standard_normal((D, config.vocab_size)).astype(np.float32) * D**-0.5)
    labels = jnp.asarray(rng.integers(0, config.vocab_size, (B * S,)), jnp.int32)

    def head(h, w):
        lp, _ = linear_logprob_entropy(h.reshape(B * S, D), w, labels)
        return -jnp.mean(lp)

    time_piece("loss (lm_head + log-probs)", jit_cpu_tuned(head), jit_cpu_tuned(jax.grad(head, argnums=(0, 1))), (x, w))

    # the whole model body (no loss, no optimizer)
    model = Qwen35ForCausalLM(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (B, S)), jnp.int32)

    def body(state, tokens):
        h = nnx.merge(graphdef, state)(tokens)
        return jnp.sum(h * h) * 1e-3

    remat = "full" if config.remat == "auto" else config.remat  # the model alone runs auto as full
    time_piece(f"model body (remat={remat})", jit_cpu_tuned(body), jit_cpu_tuned(jax.grad(body)), (state, tokens))
    return results


def table(rows: list[dict]) -> str:
    lines = ["| run | B x S | transformers s | ours s | ours tok/s | ours / theirs |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        theirs = r.get("transformers", {}).get("median_s")
        theirs_s = f"{theirs:.3f}" if theirs else "-"
        names = [k for k in r if k.startswith("ours")]
        if not names:  # --stack transformers
            lines.append(f"| {r['config']} | {r['batch']} x {r['seq']} | {theirs_s} | - | - | - |")
        for name in names:
            ours = r[name]["median_s"]
            tok = r["batch"] * r["seq"] / ours
            ratio = f"{r[name].get('ratio') or theirs / ours:.2f}x" if theirs else "-"
            if len(r[name].get("round_ratios", [])) > 1:
                ratio += " (rounds: " + ", ".join(f"{x:.2f}" for x in r[name]["round_ratios"]) + ")"
            extra = f" (MFU {r[name]['mfu']:.1%})" if "mfu" in r[name] else ""
            label = r["config"] + name[4:] + (f", remat {r['remat']}" if "remat" in r else "")
            lines.append(f"| {label} | {r['batch']} x {r['seq']} | {theirs_s} | {ours:.3f} | {tok:,.0f}{extra} | "
                         f"{ratio} |")
    return "\n".join(lines)


def run_isolated(argv: list[str], rounds: int) -> tuple[list[dict], list[dict] | None, dict[str, str | None]]:
    """Every row timed in child processes, `--stack ours` then `--stack transformers`, `rounds` times
    over, merged; and each child's GLIBC_TUNABLES. With several rounds a row keeps each round's
    ratio and reports the median over rounds: the machine's speed drifts within minutes, and
    alternating the stacks puts both through the same drift."""
    import subprocess
    import tempfile

    per_round = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            results = {}
            for stack in ("ours", "transformers"):
                out = os.path.join(tmp, f"{stack}{r}.json")
                cmd = [sys.executable, os.path.abspath(__file__), *argv, "--stack", stack, "--rounds", "1",
                       "--json", out]
                if subprocess.run(cmd).returncode != 0:  # the child printed its error
                    raise SystemExit(f"bench_train: the {stack} child process failed")
                with open(out) as f:
                    results[stack] = json.load(f)
            per_round.append(results)
    by_round = [[{**theirs, **ours} for ours, theirs in zip(res["ours"]["runs"], res["transformers"]["runs"])]
                for res in per_round]
    rows = [merge_rounds(list(row_rounds)) for row_rounds in zip(*by_round)]
    tunables = {stack: per_round[0][stack]["glibc_tunables"][stack] for stack in per_round[0]}
    return rows, per_round[0]["ours"]["breakdown"], tunables


def merge_rounds(rounds: list[dict]) -> dict:
    """One row from its rounds: each stack's median_s is the median of the rounds' medians, min_s and
    max_s the extremes over all of them; each variant of ours gains `round_ratios`, theirs / ours per
    round, and `ratio`, their median (paired by round, so drift between rounds cancels)."""
    if len(rounds) == 1:
        return rounds[0]
    row = json.loads(json.dumps(rounds[0]))
    stacks = [k for k in row if k == "transformers" or k.startswith("ours")]
    for stack in stacks:
        row[stack]["median_s"] = statistics.median(r[stack]["median_s"] for r in rounds)
        row[stack]["min_s"] = min(r[stack]["min_s"] for r in rounds)
        row[stack]["max_s"] = max(r[stack]["max_s"] for r in rounds)
    if "transformers" in row:
        for stack in stacks:
            if stack.startswith("ours"):
                row[stack]["round_ratios"] = [r["transformers"]["median_s"] / r[stack]["median_s"] for r in rounds]
                row[stack]["ratio"] = statistics.median(row[stack]["round_ratios"])
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    from qwen35_jax.layers.chunk_states import gdn_chunk_scan, gdn_remat
    from qwen35_jax.layers.delta_rule import gdn_precision

    rows, breakdown = [], None
    tunables = {"ours" if not args.run_torch else args.stack: os.environ.get("GLIBC_TUNABLES")}
    if args.stack == "both" and args.run_torch:
        rows, breakdown, tunables = run_isolated(sys.argv[1:] if argv is None else argv, args.rounds)
    else:
        with gdn_precision(args.gdn_precision), gdn_chunk_scan(args.gdn_chunk_scan), gdn_remat(args.gdn_remat):
            planned = [] if args.cores_only else runs(args)
            for name, config, batch, seq in planned:
                rows.append(bench_config(name, config, batch, seq, args))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
            if args.cores:
                rows.extend(bench_cores(args))
            if args.breakdown and args.run_ours and planned:
                _, config, batch, seq = planned[0]
                breakdown = bench_breakdown(config, batch, seq, args.steps)
    threads = ""
    if args.run_torch:
        import torch

        threads = f", torch {torch.__version__} with {torch.get_num_threads()} threads"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    malloc = ", ".join(f"{stack} {value or 'unset'}" for stack, value in tunables.items())
    print(f"\njax {jax.__version__} ({jax.default_backend()}){threads}, {os.cpu_count()} CPUs, GLIBC_TUNABLES: "
          f"{malloc}; load average "
          f"{load:.1f}; median of {args.steps} steps after a warm-up"
          + (f", median over {args.rounds} rounds of both stacks" if args.rounds > 1 else ""))
    print(table(rows))
    if breakdown:
        print("\n| piece | fwd s | fwd+bwd s | bwd / fwd |\n| --- | --- | --- | --- |")
        for r in breakdown:
            print(f"| {r['piece'].strip()} | {r['fwd_s']:.3f} | {r['fwd_bwd_s']:.3f} | "
                  f"{(r['fwd_bwd_s'] - r['fwd_s']) / r['fwd_s']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": rows, "breakdown": breakdown, "load_average_1min": load,
                       "glibc_tunables": tunables}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    args = parse_args()
    if args.run_ours and not args.run_torch:  # our stack alone: in the trainer's start-up environment
        from qwen35_jax.host_memory import restart_with_huge_pages

        restart_with_huge_pages()
    sys.exit(main())
