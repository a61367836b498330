#!/usr/bin/env python
"""Export a qwen35_jax checkpoint or a training run as a Hugging Face checkpoint (safetensors + config.json).

    python scripts/export_hf.py CKPT_DIR OUT_DIR [--max-shard-size 5GB] [--extra-from HF_DIR] [--dtype bfloat16]

Tensor names, expert storage (fused or per expert), tying and every tensor's dtype follow the HF
checkpoint the model was imported from, so import then export gives back each text-model tensor bit
for bit; a model made from scratch gets the layout transformers writes for its config. Output larger
than --max-shard-size is split into shards with model.safetensors.index.json. A model with a vision
tower writes it back under its model.visual.* names. --extra-from copies the tensors we do not model
(MTP head; the vision tower of a --text-only import) and side files (tokenizer ...) from the original.
--dtype writes every text tensor in one dtype instead (and sets it in config.json).
CKPT_DIR is a checkpoint (import_hf.py's output, or one step of a run) or a run directory of
scripts/train.py, whose newest complete checkpoint is exported. OUT_DIR must not exist; it appears
only when complete.
"""

from __future__ import annotations

import argparse
import re
import sys

from qwen35_jax.config import DTYPES

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 5GB, 500MB, 4096")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("ckpt_dir", help="qwen35_jax checkpoint or training run directory")
    p.add_argument("out_dir", help="new directory for the Hugging Face checkpoint")
    p.add_argument("--max-shard-size", type=parse_size, default="5GB", help="largest shard file (default 5GB)")
    p.add_argument("--extra-from", default=None, metavar="HF_DIR",
                   help="copy MTP (and, for a text-only import, vision) tensors and tokenizer files "
                        "from this HF checkpoint")
    p.add_argument("--mesh", default=None,
                   help="device mesh 'fsdp=F,sp=S' to restore onto (default: all devices on fsdp)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="dtype of the written tensors (default: each tensor's dtype in the source)")
    args = p.parse_args(argv)

    from flax import nnx

    from qwen35_jax.checkpoint import load_checkpoint
    from qwen35_jax.hf.export import check_new_output, export_hf
    from qwen35_jax.hf.names import Layout
    from qwen35_jax.parallel.mesh import init_distributed, make_mesh

    try:
        init_distributed()
        mesh = make_mesh(args.mesh)
        check_new_output(args.out_dir)  # fail before the (long) load, not after
        model, config, meta = load_checkpoint(args.ckpt_dir, mesh=mesh)
        layout = Layout.from_dict(meta["layout"]) if meta.get("layout") else None
        files = export_hf(nnx.state(model, nnx.Param), config, args.out_dir, layout=layout,
                          hf_config=meta.get("hf_config"), dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                          extra_from=args.extra_from, progress=True)
    except ValueError as e:
        print(f"export_hf: error: {e}", file=sys.stderr)
        return 1
    print(f"exported {args.ckpt_dir} -> {args.out_dir}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
