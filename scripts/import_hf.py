#!/usr/bin/env python
"""Import a Hugging Face Qwen3.5 checkpoint into a qwen35_jax (orbax) checkpoint.

    python scripts/import_hf.py HF_DIR OUT_DIR [--dtype float32|bfloat16] [--mesh fsdp=F,sp=S] [--text-only]

HF_DIR holds config.json and model.safetensors, or shards with model.safetensors.index.json, in the
Qwen3_5(Moe)ForCausalLM or Qwen3_5(Moe)ForConditionalGeneration layout. The whole checkpoint is
checked (every tensor's presence, shape and dtype, no extra tensors) before anything is written.
A ForConditionalGeneration checkpoint brings its vision tower (model.visual.*) along; --text-only
skips it (and the config's vision) to keep only the text model's memory. MTP tensors are always
skipped. OUT_DIR must not exist; it appears only when complete.
Parameters are loaded ZeRO-3 sharded over the mesh; under jax.distributed (several processes, see
qwen35_jax.parallel.mesh.init_distributed) the mesh spans all of them and process 0 writes the files.
"""

from __future__ import annotations

import argparse
import sys

from qwen35_jax.config import RUN_DTYPES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("hf_dir", help="Hugging Face checkpoint directory")
    p.add_argument("out_dir", help="new directory for the qwen35_jax checkpoint")
    p.add_argument("--dtype", choices=RUN_DTYPES, default=None,
                   help="parameter dtype (default: the checkpoint's own; float32 when it mixes dtypes)")
    p.add_argument("--mesh", default=None,
                   help="device mesh 'fsdp=F,sp=S' to load onto (default: all devices on fsdp)")
    p.add_argument("--text-only", action="store_true",
                   help="import only the text model of a vision-language checkpoint (skip model.visual.*)")
    args = p.parse_args(argv)

    from qwen35_jax.checkpoint import save_checkpoint
    from qwen35_jax.hf.export import check_new_output
    from qwen35_jax.hf.load import load_hf
    from qwen35_jax.parallel.mesh import init_distributed, make_mesh

    try:
        init_distributed()
        mesh = make_mesh(args.mesh)
        check_new_output(args.out_dir)  # fail before the (long) load, not after
        model, config, ckpt = load_hf(args.hf_dir, dtype=args.dtype, mesh=mesh, progress=True,
                                     text_only=args.text_only)
        save_checkpoint(args.out_dir, model, config, layout=ckpt.layout, hf_config=ckpt.raw_config,
                        extra={"skipped_tensors": len(ckpt.skipped)})
    except ValueError as e:
        print(f"import_hf: error: {e}", file=sys.stderr)
        return 1
    layout = ckpt.layout
    tower = "with" if config.vision is not None else "no"
    print(f"imported {args.hf_dir} ({layout.architecture}, {len(ckpt.table)} parameters, experts: "
          f"{layout.experts}, tied: {layout.tied}, dtype {config.param_dtype}, {tower} vision tower) -> "
          f"{args.out_dir}; skipped {len(ckpt.skipped)} vision/MTP tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
