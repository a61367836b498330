#!/usr/bin/env python3
"""The Hugging Face walk-through: a tiny Qwen3.5 exported, imported, scored and exported back, on 8 simulated CPU devices.

    python scripts/hf_roundtrip.py [--workdir runs/hf-roundtrip] [--preset tiny]

1. builds a random model from a preset and exports it as a Hugging Face checkpoint (safetensors);
2. imports that checkpoint with scripts/import_hf.py into our orbax format;
3. scores packed random token rows with scripts/logprobs.py on an fsdp=2 x sp=4 mesh;
4. checks the scores against the same model's full logits, then exports back to HF and compares bytes.
No network and no downloads: everything is made locally.
"""

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent


def tool(name: str, *args: str) -> None:
    cmd = [sys.executable, str(SCRIPTS / name), *args]
    print("$", " ".join(["python", f"scripts/{name}", *args]), flush=True)
    subprocess.run(cmd, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("runs/hf-roundtrip"), help="where files go (replaced)")
    parser.add_argument("--preset", default="tiny", help="model preset (default: tiny)")
    args = parser.parse_args()

    import jax
    from flax import nnx

    from qwen35_jax.config import Qwen35Config
    from qwen35_jax.hf.export import export_hf
    from qwen35_jax.model import Qwen35ForCausalLM

    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    config = Qwen35Config.preset(args.preset)
    model = Qwen35ForCausalLM(config, rngs=nnx.Rngs(0))
    export_hf(nnx.state(model, nnx.Param), config, str(work / "hf"))
    print(f"wrote a random {args.preset} checkpoint ({config.num_hidden_layers} layers: "
          f"{', '.join(config.layer_types)}) to {work / 'hf'}")

    tool("import_hf.py", str(work / "hf"), str(work / "ckpt"))

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, size=(4, 100))
    segments = np.ones_like(tokens)
    segments[1, 40:] = 2  # two packed documents in row 1
    segments[3, 70:] = 0  # a padded tail in row 3
    np.save(work / "tokens.npy", tokens)
    np.save(work / "segments.npy", segments)
    mesh = "fsdp=2,sp=4" if jax.device_count() == 8 else f"fsdp={jax.device_count()},sp=1"
    tool("logprobs.py", "--model", str(work / "ckpt"), "--tokens", str(work / "tokens.npy"),
         "--segment-ids", str(work / "segments.npy"), "--out", str(work / "scores.npz"),
         "--temperature", "0.8", "--mesh", mesh)

    scores = np.load(work / "scores.npz")
    hidden = model(tokens, segment_ids=segments)
    logp = np.asarray(jax.nn.log_softmax(model.logits(hidden) / 0.8, axis=-1))
    want = np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    same_doc = (segments[:, :-1] == segments[:, 1:]) & (segments[:, :-1] > 0)
    err = np.abs(np.where(same_doc, want, 0.0) - scores["log_probs"][:, :-1]).max()
    print(f"fused sharded log-probs vs full single-device logits: max |diff| = {err:.2e}")

    tool("export_hf.py", str(work / "ckpt"), str(work / "hf_roundtrip"))
    from safetensors.numpy import load_file
    a, b = load_file(str(work / "hf" / "model.safetensors")), load_file(str(work / "hf_roundtrip" / "model.safetensors"))
    identical = a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    print(f"HF -> ours -> HF round trip: {len(a)} tensors, bit-identical: {identical}")
    return 0 if err < 1e-4 and identical else 1


if __name__ == "__main__":
    sys.exit(main())
