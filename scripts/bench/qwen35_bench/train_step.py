"""Our jitted train step against transformers' eager one: same architecture, random weights, the same
batch of random tokens (one document per row), AdamW (lr 1e-4, betas 0.9/0.95, gradient clipping at
norm 1).

Ours is `qwen35_jax.train.make_train_step` through the config's remat choice (SFT loss, fused
log-prob kernel); theirs is transformers' `Qwen3_5ForCausalLM` on its default path (eager, default
attention implementation) with `labels=`, `loss.backward()`, `clip_grad_norm_` and
`torch.optim.AdamW`, float32.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import numpy as np

from qwen35_bench.timing import time_side_by_side
from qwen35_jax.config import Qwen35Config, hybrid_layer_types

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
SETTINGS = tuple(k for k in SMALL if k != "mrope")  # the integer settings a command line may override


def build_config(settings: dict, remat: bool | str | None, dtype: str = "float32") -> Qwen35Config:
    """A dense Qwen3.5 text config from CONFIGS-style settings (every fourth layer full attention)."""
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


def planned_runs(
    names: list[str],
    *,
    preset: str | None = None,
    overrides: dict[str, int] | None = None,
    batch: int | None = None,
    seq: int | None = None,
    remat: bool | str | None = None,
    dtype: str = "float32",
    scan_layers: bool | str = "auto",
) -> list[tuple[str, Qwen35Config, int, int]]:
    """(name, config, batch, seq) of every train step to time: the preset alone (all its layers; one
    row of 8,192 tokens unless `batch` / `seq` say otherwise), else each named CONFIGS entry, the
    first with `overrides`, `batch` and `seq` applied."""
    if preset is not None:
        config = Qwen35Config.preset(preset, dtype=dtype, scan_layers=scan_layers).text_only()  # a text step
        config = config if remat is None else config.replace(remat=remat)
        return [(preset, config, batch or 1, seq or 8192)]
    out = []
    for i, name in enumerate(names):
        settings, rows, length = CONFIGS[name]
        settings = dict(settings)
        if i == 0:
            settings.update(overrides or {})
            rows, length = batch or rows, seq or length
        config = build_config(settings, remat, dtype).replace(scan_layers=scan_layers)
        out.append((name, config, rows, length))
    return out


def ours_step(config: Qwen35Config, tokens: np.ndarray, attention: str = "auto",
              logprob_backend: str = "auto") -> Callable[[], None]:
    """One of our train steps on `tokens` [B, S] (int), on one device, as a callable that blocks until
    done; once it has run, `.remat()` says what remat "auto" chose and `.gdn_precision` the GDN
    matmul precision it was traced with."""
    import jax
    from flax import nnx

    from qwen35_jax.model import Qwen35ForCausalLM
    from qwen35_jax.parallel.mesh import create_sharded, make_mesh
    from qwen35_jax.train import StepOptions, make_optimizer, make_schedule, place_batch, trainer_step

    # the config's kernel choices (the benchmark's flags), with this row's attention
    config = config.replace(kernels=config.kernels.replace(attention=attention))
    mesh = make_mesh((1, 1), jax.devices()[:1])
    model = create_sharded(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)), mesh)
    step, params, opt_state = trainer_step(model, make_optimizer(make_schedule(1e-4, 1000)), mesh,
                                           StepOptions(backend=logprob_backend))
    ones = np.ones(tokens.shape, np.int32)
    batch = place_batch({"tokens": tokens.astype(np.int32), "segment_ids": ones, "loss_mask": ones}, mesh, 1, 1)
    state = [params, opt_state]

    def run() -> None:
        with jax.set_mesh(mesh):  # the first call traces, under config.kernels
            run.gdn_precision = config.kernels.gdn_precision
            state[0], state[1], metrics = step(state[0], state[1], batch)
            jax.block_until_ready(metrics)

    run.remat = lambda: getattr(step, "policy", None) or config.remat
    return run


def torch_step(config: Qwen35Config, tokens: np.ndarray) -> Callable[[], None]:
    """transformers' train step on the same config and tokens [B, S]: eager, default attention, AdamW."""
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


def time_train_step(
    name: str,
    config: Qwen35Config,
    batch: int,
    seq: int,
    *,
    steps: int,
    ours: bool = True,
    theirs: bool = True,
    attention: str = "auto",
    logprob_backend: str = "auto",
    profile_dir: str | None = None,
    peak_tflops: float | None = None,
) -> dict:
    """One row (`report.py`): each stack's step timed after a warm-up, the model TFLOP per step and,
    with a peak (given, or the trainer's table for known accelerators), our MFU. `profile_dir`: one
    more step of ours traced with jax.profiler into `profile_dir/name`."""
    import jax

    from qwen35_jax.train.flops import peak_tflops as known_peak
    from qwen35_jax.train.flops import train_flops

    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, seq))
    fns = {"ours": ours_step(config, tokens, attention, logprob_backend)} if ours else {}
    if theirs:
        fns["transformers"] = torch_step(config, tokens)
    timings = time_side_by_side(fns, steps)
    remat = config.remat if "ours" not in fns or fns["ours"].remat() == config.remat else \
        f"{config.remat} -> {fns['ours'].remat()}"
    row = {"config": name, "batch": batch, "seq": seq, "remat": remat, "dtype": config.dtype,
           "model_tflops_per_step": train_flops(config, batch, seq) / 1e12, **timings}
    if "ours" in fns:
        row["ours"].update(attention=attention, logprob_backend=logprob_backend,
                           gdn_precision=fns["ours"].gdn_precision)  # as the step was traced
        if profile_dir:  # the trace lands in profile_dir/<name>/plugins/profile/<run>/
            try:
                with jax.profiler.trace(os.path.join(profile_dir, name)):
                    fns["ours"]()
            except Exception as e:  # noqa: BLE001 - a profiler that cannot start must not lose the timings
                print(f"bench_train: no profile ({type(e).__name__}: {e})", file=sys.stderr)
    peak = peak_tflops or known_peak(jax.devices()[0])
    if peak and "ours" in row:
        row["ours"]["mfu"] = row["model_tflops_per_step"] / row["ours"]["median_s"] / peak
    return row
