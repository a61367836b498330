"""The trainer's step compiled by XLA:TPU for a TPU slice that is not here (`memory/tpu_targets.py`).

With libtpu installed (`pip install -e ".[tpu-compile]"`) the step compiles, its Pallas TPU kernels
through Mosaic; without it the tool stops with one line that says what to install. Each environment
runs the half it can; the slice shapes need neither.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from qwen35_jax.config import Qwen35Config
from qwen35_jax.memory.targets import COMPILE_TARGETS, target_backend, target_memory_bytes
from qwen35_jax.memory.tpu_targets import slice_grid

LONG_CONTEXT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "bench_long_context.py"
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
TINY = ["--preset", "tiny", "--mesh", "fsdp=2,sp=4", "--seq", "1024", "--remat", "full"]


def test_slices_are_shaped_as_cloud_tpu_shapes_them():
    assert [slice_grid("v5e", n) for n in (1, 2, 4, 8, 16, 32)] == [(1, 1), (1, 2), (2, 2), (2, 4), (4, 4), (4, 8)]
    assert [slice_grid("v5p", n) for n in (4, 8, 16, 32, 64)] == [(2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4),
                                                                 (4, 4, 4)]
    with pytest.raises(ValueError, match="power-of-two number of chips, not 6"):
        slice_grid("v6e", 6)
    assert [target_backend(t) for t in COMPILE_TARGETS] == ["gpu"] * 2 + ["tpu"] * 4
    assert target_memory_bytes("v5e") == 16 * 2**30
    with pytest.raises(ValueError, match="'v7x' is not one of"):
        target_backend("v7x")


def test_long_context_tool_refuses_an_unknown_layer_layout():
    from qwen35_jax.memory.report import run

    with pytest.raises(ValueError, match=r"--scan-layers 'yes' is not one of \('auto', 'true', 'false'\)"):
        run(preset="tiny", mesh="fsdp=2,sp=4", device_memory=None, seq=1024, target="v5e", scan_layers="yes")


@pytest.mark.skipif(HAS_LIBTPU, reason="libtpu is installed: the compile tests run instead")
def test_without_libtpu_the_tool_says_what_to_install():
    result = subprocess.run([sys.executable, str(LONG_CONTEXT), *TINY, "--target", "v5e"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("bench_long_context: compiling for a TPU without one needs libtpu: "
                                    "pip install -e '.[tpu-compile]'"), result.stderr


# the dense model with its attention (forward, its recomputation under "full", the dK/dV and dQ
# kernels) and the three log-prob kernels: 7 Mosaic kernels; the MoE model with GDN state passing and
# the vocabulary-parallel head
@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu: pip install -e '.[tpu-compile]'")
@pytest.mark.slow
@pytest.mark.parametrize("preset, gdn_mode, lm_head, kernels", [
    ("tiny", "all_to_all", "gather", 7),
    ("tiny-moe", "state_passing", "vocab_parallel", None),
])
def test_the_step_compiles_for_a_v5e_slice_on_a_2x4_mesh(preset, gdn_mode, lm_head, kernels):
    from qwen35_jax.memory.step_memory import compile_train_step

    config = Qwen35Config.preset(preset, dtype="bfloat16", param_dtype="float32", remat="full")
    # under conftest's "highest" matmul precision, as a user may set it: the attention kernel's bf16
    # blocks are contracted at the default precision, which Mosaic requires of them
    assert jax.config.jax_default_matmul_precision == "highest"
    compiled, _ = compile_train_step(config, 512, (2, 4), target="v5e", batch=2, gdn_mode=gdn_mode,
                                     lm_head_mode=lm_head)
    assert compiled.memory_analysis().temp_size_in_bytes > 0
    text = compiled.as_text()  # Mosaic kernels only: no GPU kernel, nothing interpreted
    mosaic = text.count('custom_call_target="tpu_custom_call"')
    assert mosaic == kernels if kernels else mosaic > 0, mosaic
    assert "triton" not in text


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu: pip install -e '.[tpu-compile]'")
@pytest.mark.slow
def test_long_context_tool_sizes_the_step_for_a_v5p_chip():
    result = subprocess.run([sys.executable, str(LONG_CONTEXT), *TINY, "--target", "v5p", "--scan-layers", "false",
                             "--json"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["target"] == "v5p" and report["fits"] and report["device_memory"] == 95 * 2**30
    assert report["scan_layers"] is False  # "auto" scans on a TPU
    assert 0 < report["total_bytes"] < 2**30
