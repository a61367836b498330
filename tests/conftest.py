"""Test set-up: eight simulated CPU devices, float32 matmuls at full precision.

XLA reads the device count once, when jax first initialises, so it is set here, before any test
module imports jax.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_enable_x64", False)
