#!/usr/bin/env python3
"""Sequence-parallel memory and traffic of a Qwen3.5-shaped model, read from the compiler.

    python scripts/bench/bench_parallel.py [--preset 0.8B] [--seq 32768] [--layers 4] [--sp 1,2,4,8]
                                     [--dtype bfloat16] [--devices 8]

For every sp, one sequence of --seq tokens is split over sp devices (mesh fsdp=1, sp=sp). The
forward+backward of the model (hidden states -> sum of squares; the lm_head and loss are left out,
the log-prob kernel has its own benchmark) is lowered from abstract inputs (`jax.eval_shape`: nothing
big is allocated) and compiled. Reported per device:
- scratch: `compile().memory_analysis().temp_size_in_bytes` (activations and workspace; parameters,
  inputs and outputs excluded);
- all-to-all bytes per attention / GDN layer and per pass (forward; the backward and the remat
  recompute repeat the same all-to-alls), read from the compiled HLO, next to the Ulysses figure
  4 * N * h / P (N tokens, h = query heads * head dim, the width each of q, k, v, o would have
  without GQA, P = sp). Both in bytes of the compute dtype: elements from the HLO times its size
  (XLA:CPU widens bf16 collectives to f32; GPUs and TPUs send bf16 as is).
- for each --gdn-modes entry, the GDN layers' collective bytes per layer over the whole
  forward+backward (all-to-all mode: compute-dtype bytes; state passing: HLO bytes, float32 states
  and halo) and the scratch.
On a CPU host the devices are simulated (--devices sets their number before JAX starts).
"""

import argparse
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="0.8B", help="Qwen35Config preset whose shapes to use (default 0.8B)")
    parser.add_argument("--seq", type=int, default=32768, help="tokens in the one sequence (default 32768)")
    parser.add_argument("--layers", type=int, default=4,
                        help="decoder layers kept from the preset, a multiple of its block period (default 4)")
    parser.add_argument("--sp", default="1,2,4,8", help="comma-separated sp sizes (default 1,2,4,8)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16",
                        help="compute dtype; parameters stay float32 (default bfloat16)")
    parser.add_argument("--gdn-modes", default="all_to_all,state_passing",
                        help="GDN sequence-parallel modes to compare (default all_to_all,state_passing)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices when on CPU (default 8)")
    return parser.parse_args(argv)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def measure(config, seq: int, sp: int, itemsize: int, gdn_mode: str) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from qwen35_jax.model import Qwen35ForCausalLM
    from qwen35_jax.layers.gdn_state_passing import GDN_STATE_SCOPE
    from qwen35_bench.hlo import collectives
    from qwen35_jax.parallel.mesh import TOKENS_BS, make_mesh, state_shardings
    from qwen35_jax.parallel.ulysses import ATTENTION_SCOPE, GDN_SCOPE

    mesh = make_mesh((1, sp), devices=jax.devices()[:sp])
    config = config.replace(gdn_sp_mode=gdn_mode)
    abstract = nnx.eval_shape(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shardings = state_shardings(state, mesh)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=jax.sharding.NamedSharding(mesh, TOKENS_BS))

    def loss(state, tokens):
        hidden = nnx.merge(graphdef, state)(tokens)  # [1, S, D]
        return jnp.sum(jnp.square(hidden.astype(jnp.float32)))

    start = time.time()
    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss)).lower(state, tokens).compile()
    seconds = time.time() - start
    memory = compiled.memory_analysis()
    ops = collectives(compiled.as_text())
    a2a = [c for c in ops if c.op == "all-to-all"]
    passes = 3 if config.remat != "none" else 2  # forward, backward (+ remat recompute of the forward)
    # the blocks run in a scan: the HLO holds one block's layers, executed once per block
    block = config.layer_types[: config.block_period]
    n_attn, n_gdn = block.count("full_attention"), block.count("linear_attention")
    attn_bytes = itemsize * sum(c.elements for c in a2a if ATTENTION_SCOPE in c.op_name)
    gdn_bytes = itemsize * sum(c.elements for c in a2a if GDN_SCOPE in c.op_name)
    # state passing: float32 states (all-gather; reduce-scatter in the backward) + the conv halo
    # (ppermute); the weight-gradient all-reduces XLA merges across layers are left in "other"
    state_ops = [c for c in ops if f"{GDN_STATE_SCOPE}/shard_map/" in c.op_name and c.op != "all-reduce"]
    state_bytes = sum(c.bytes for c in state_ops)
    other = [c for c in ops if c.op != "all-to-all" and c not in state_ops]
    return dict(
        sp=sp, compile_s=seconds, scratch=memory.temp_size_in_bytes, args=memory.argument_size_in_bytes,
        attn_layer_pass=attn_bytes / (passes * max(n_attn, 1)) if sp > 1 else 0,
        gdn_layer_pass=gdn_bytes / (passes * max(n_gdn, 1)) if sp > 1 else 0,
        gdn_layer_total=(gdn_bytes + state_bytes) / max(n_gdn, 1),
        other_bytes=sum(c.bytes for c in other), n_a2a=len(a2a),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and "device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.devices}").strip()
    import jax
    import jax.numpy as jnp

    from qwen35_jax.config import Qwen35Config

    sps = [int(s) for s in args.sp.split(",")]
    base = Qwen35Config.preset(args.preset).text_only()  # text batches
    if args.layers % base.block_period:
        raise ValueError(f"--layers {args.layers} is not a multiple of the block period {base.block_period}")
    if max(sps) > jax.device_count():
        raise ValueError(f"--sp {max(sps)} needs {max(sps)} devices, there are {jax.device_count()}")
    config = base.replace(num_hidden_layers=args.layers, layer_types=base.layer_types[: args.layers],
                          dtype=args.dtype)
    width = config.num_attention_heads * config.head_dim
    elem = jnp.dtype(args.dtype).itemsize
    print(f"# {args.preset}-shaped, {args.layers} layers ({config.layer_types.count('full_attention')} attention), "
          f"S = {args.seq}, compute {args.dtype}, {jax.device_count()} x {jax.devices()[0].device_kind}")
    print("| sp | scratch / device | vs sp=1 | a2a / attention layer / pass | 4*N*h/P | ratio "
          "| a2a / GDN layer / pass | other collectives, one block (HLO bytes) | compile s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    modes = args.gdn_modes.split(",")
    first, results = None, {}
    for sp in sps:
        r = results[sp, modes[0]] = measure(config, args.seq, sp, elem, modes[0])
        first = first or r["scratch"]
        ulysses = 4 * args.seq * width * elem / sp
        ratio = f"{r['attn_layer_pass'] / ulysses:.2f}x" if sp > 1 else "-"
        print(f"| {sp} | {human(r['scratch'])} | {first / r['scratch']:.1f}x | {human(r['attn_layer_pass'])} "
              f"| {human(ulysses) if sp > 1 else '-'} | {ratio} | {human(r['gdn_layer_pass'])} "
              f"| {human(r['other_bytes'])} | {r['compile_s']:.0f} |", flush=True)
    if len(modes) > 1:
        for sp in sps[1:] if sps[0] == 1 else sps:
            for mode in modes[1:]:
                results[sp, mode] = measure(config, args.seq, sp, elem, mode)
        print("\nGDN collective bytes per layer, forward+backward, and scratch per device, by mode:\n")
        print("| sp | " + " | ".join(f"{m}: bytes / layer | {m}: scratch" for m in modes) + " |")
        print("| --- |" + " --- | --- |" * len(modes))
        for sp in sps:
            if sp == 1:
                continue
            cells = [f"{human(results[sp, m]['gdn_layer_total'])} | {human(results[sp, m]['scratch'])}"
                     for m in modes]
            print(f"| {sp} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as err:
        print(f"bench_parallel: {err}", file=sys.stderr)
        sys.exit(2)
