"""The trainer's step compiled by XLA:GPU for an H100 that is not here (`bench/gpu_compile.py`).

With jax's CUDA plugin installed (`pip install -e ".[gpu-compile]"`) the step compiles; without it
the tool stops with one line that says what to install. Each environment runs the half it can.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from qwen35_bench.hlo_census import census
from qwen35_jax.config import Qwen35Config

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "gpu_compile.py"
LONG_CONTEXT = SCRIPT.parent / "bench_long_context.py"
HAS_PLUGIN = any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13)) \
    if importlib.util.find_spec("jax_plugins") else False
TINY = ["--preset", "tiny", "--mesh", "fsdp=2,sp=4", "--batch", "2", "--seq", "256"]


@pytest.mark.skipif(HAS_PLUGIN, reason="jax's CUDA plugin is installed: the compile tests run instead")
def test_without_the_plugin_the_tool_says_what_to_install():
    result = subprocess.run([sys.executable, str(SCRIPT), *TINY], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("gpu_compile: compiling for a GPU without one needs jax's CUDA plugin: "
                                    "pip install -e '.[gpu-compile]'"), result.stderr
    result = subprocess.run([sys.executable, str(LONG_CONTEXT), "--preset", "tiny", "--mesh", "fsdp=1,sp=4",
                             "--seq", "1024", "--target", "h100"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("bench_long_context: compiling for a GPU without one needs"), result.stderr


# "full": remat's optimization barriers reach XLA:GPU, which compiles them only without our CPU options
@pytest.mark.skipif(not HAS_PLUGIN, reason="needs jax's CUDA plugin: pip install -e '.[gpu-compile]'")
@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full"])
def test_the_step_compiles_for_an_h100_on_a_2x4_mesh(remat):
    from qwen35_jax.memory.step_memory import compile_train_step

    config = Qwen35Config.preset("tiny", dtype="bfloat16", param_dtype="float32", remat=remat)
    compiled, _ = compile_train_step(config, 256, (2, 4), target="h100", batch=2)
    text = compiled.as_text()
    assert compiled.memory_analysis().temp_size_in_bytes > 0
    assert "__gpu$xla.gpu.triton" in text  # the Pallas GDN and attention kernels, built by Triton
    kernels = census(text)
    categories = {k.category for k in kernels}
    assert {"matmul", "fusion", "custom", "collective"} <= categories, categories
    # The update skips a non-finite batch with a select fused into AdamW: under a cond, XLA:GPU copied
    # every parameter and moment after it. What copies remain are far smaller than the parameters.
    parameter_bytes = 4 * sum(x.size for x in jax_leaves_of(config))
    copied = sum(k.bytes for k in kernels if k.category == "copy")
    assert copied < 0.05 * parameter_bytes, (copied, parameter_bytes)


def jax_leaves_of(config: Qwen35Config) -> list:
    import jax
    from flax import nnx

    from qwen35_jax.model import Qwen35ForCausalLM

    abstract = nnx.eval_shape(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)))
    return jax.tree.leaves(nnx.state(abstract, nnx.Param))


@pytest.mark.skipif(not HAS_PLUGIN, reason="needs jax's CUDA plugin: pip install -e '.[gpu-compile]'")
@pytest.mark.slow
def test_the_script_reports_memory_kernels_and_the_roofline(tmp_path):
    hlo = tmp_path / "step.hlo"
    result = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--target", "h200", "--json", "--hlo", str(hlo)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["target"] == "h200" and report["mesh"] == "fsdp=2,sp=4"
    assert 0 < report["memory_bytes"] < report["device_memory_bytes"]
    assert report["roofline_s"] == pytest.approx(sum(r["roofline_ms"] for r in report["categories"]) / 1e3)
    assert 0 < report["mfu_bound"] < 1
    assert report["launches"] == sum(k.runs for k in census(hlo.read_text()))
    bad = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--remat", "auto"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("gpu_compile: --remat 'auto'")


@pytest.mark.skipif(not HAS_PLUGIN, reason="needs jax's CUDA plugin: pip install -e '.[gpu-compile]'")
@pytest.mark.slow
def test_the_long_context_tool_sizes_the_step_with_xla_gpu():
    result = subprocess.run([sys.executable, str(LONG_CONTEXT), "--preset", "tiny", "--mesh", "fsdp=1,sp=4",
                             "--seq", "1024", "--target", "h100", "--json"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["target"] == "h100" and report["fits"] and report["seq"] == 1024
    assert report["device_memory"] == 81_559 * 2**20  # the target's own memory, no --device-memory given


def test_from_hlo_reads_a_program_without_compiling(tmp_path):
    # what a lease brings back (device_check.sh: train_step_hlo.txt.gz) read here, no plugin needed;
    # a program XLA:CPU compiled stands in for the GPU's
    import gzip

    import jax
    import jax.numpy as jnp

    from qwen35_jax.layers.norms import rms_norm

    loss = lambda x, w: jnp.sum(rms_norm(x, w, 1e-6) ** 2)  # noqa: E731
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(jnp.ones((64, 256)), jnp.ones(256)).compile().as_text()
    path = tmp_path / "step_hlo.txt.gz"
    path.write_bytes(gzip.compress(text.encode()))
    result = subprocess.run([sys.executable, str(SCRIPT), "--from-hlo", str(path), "--preset", "tiny", "--seq", "64",
                             "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["launches"] == sum(k.runs for k in census(text)) > 0
    assert "RMS norms" in {r["name"] for r in report["parts"]} and report["roofline_s"] > 0
    assert "memory_bytes" not in report  # nothing was compiled
    assert report["scan_layers"] is False  # remat none: one block after another, as a GPU runs it
    missing = subprocess.run([sys.executable, str(SCRIPT), "--from-hlo", str(tmp_path / "none.txt")],
                             capture_output=True, text=True, timeout=300)
    # one line from us (jax's CUDA plugin, where installed, logs its own lines before it)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
    assert missing.stderr.strip().splitlines()[-1].startswith("gpu_compile: [Errno 2]"), missing.stderr
    bad = subprocess.run([sys.executable, str(SCRIPT), "--from-hlo", str(path), "--gdn-remat", "some"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("gpu_compile: kernel choice gdn_remat must be")
    bad = subprocess.run([sys.executable, str(SCRIPT), "--from-hlo", str(path), "--logprob-backend", "cuda"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("gpu_compile: --logprob-backend 'cuda' is not one of")
    bad = subprocess.run([sys.executable, str(SCRIPT), "--from-hlo", str(path), "--scan-layers", "yes"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("gpu_compile: --scan-layers 'yes' is not one of")
