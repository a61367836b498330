"""Test set-up: eight simulated CPU devices, XLA flags that compile fast (compile_flags.py),
float32 matmuls at full precision.

XLA reads the device count once, when jax first initialises, so it is set here, before any test
module imports jax.
"""

import os
import sys
from pathlib import Path

from compile_flags import with_devices

# The benchmarks' helpers (scripts/bench/qwen35_bench, which imports torch) are no part of the
# installed library; tests import them from the checkout, as the benchmark scripts do.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {with_devices(8)}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests build many jitted steps of the same tiny shapes (each run of the trainer, each subprocess): a
# persistent compilation cache for this session compiles each distinct program once. Subprocesses
# inherit it through the environment.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="qwen35-jax-test-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_enable_x64", False)

import pytest  # noqa: E402


def _mesh(fsdp: int, sp: int):
    from qwen35_jax.parallel.mesh import make_mesh

    return make_mesh((fsdp, sp))


@pytest.fixture
def mesh_1x8():
    """fsdp=1, sp=8 over the eight simulated CPU devices."""
    return _mesh(1, 8)


@pytest.fixture
def mesh_2x4():
    """fsdp=2, sp=4."""
    return _mesh(2, 4)


@pytest.fixture
def mesh_4x2():
    """fsdp=4, sp=2."""
    return _mesh(4, 2)


# pytest-xdist's loadscope hands whole modules to the workers in collection order (with
# --no-loadscope-reorder, pyproject.toml). The longest go first, so that the many short modules fill
# the end: a two-minute module handed out last leaves the other worker idle for most of that time. Ordered by their measured seconds on a 2-vCPU
# machine (`pytest --durations`); modules not named keep their order after these.
LONGEST_FIRST = (
    "test_demo_vision", "test_long_context", "test_train_run", "test_parallel_model", "test_demo", "test_train",
    "test_ulysses", "test_train_vision", "test_train_distributed", "test_rl_online", "test_device_check",
    "test_delta_rule", "test_generation", "test_model_vs_hf", "test_rl_vision", "test_model_layers", "test_hf_io",
    "test_gpu_lowering", "test_vlm", "test_gated_delta_rule_api",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each module's own order stays
