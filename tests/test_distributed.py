"""Two processes x 4 CPU devices under jax.distributed equal one process x 8 devices.

The test starts two copies of this file as workers (`python tests/test_distributed.py WORKDIR`), each
with 4 simulated CPU devices, joined through a localhost coordinator on a free port. They build the
same tiny model, shard it over one fsdp=2 x sp=4 mesh spanning both processes, and process 0 writes
the gathered log-probs; the test compares them with the same model on this process's 8 devices.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
from distributed_testutil import run_processes

LAYOUT = "fsdp=2,sp=4"
B, S = 2, 29  # S padded to 32 inside the model


def tiny_model_and_batch():
    """The same model and batch in every process (fixed seeds)."""
    import jax.numpy as jnp
    from flax import nnx

    from qwen35_jax.config import Qwen35Config
    from qwen35_jax.model import Qwen35ForCausalLM

    config = Qwen35Config.preset(
        "tiny", vocab_size=128, hidden_size=32, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
        partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=8, linear_key_head_dim=8,
        linear_value_head_dim=8, intermediate_size=64, gdn_chunk_size=8,
    )
    model = Qwen35ForCausalLM(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128, size=(B, S)).astype(np.int32)
    seg = np.ones((B, S), np.int32)
    seg[0, 11:] = 2
    return model, jnp.asarray(tokens), jnp.asarray(seg)


def log_probs_fn():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from qwen35_jax.labels import next_token_labels

    @nnx.jit
    def log_probs(model, tokens, seg):  # [B, S] float32, 0 where there is no label
        logp = jax.nn.log_softmax(model.logits(model(tokens, segment_ids=seg)), axis=-1)
        labels = next_token_labels(tokens, seg)
        picked = jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
        return jnp.where(labels >= 0, picked, 0.0)

    return log_probs


def worker(workdir: Path) -> None:
    """One of the two processes: join, build the global mesh, score, and (process 0) save."""
    from qwen35_jax.parallel.mesh import init_distributed

    assert init_distributed()  # reads JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
    import jax
    from flax import nnx
    from jax.experimental import multihost_utils

    from jax.sharding import PartitionSpec as P

    from qwen35_jax.parallel.mesh import FSDP, make_mesh, state_shardings

    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    model, tokens, seg = tiny_model_and_batch()
    mesh = make_mesh(LAYOUT)
    with jax.set_mesh(mesh):
        state = nnx.state(model)
        shardings = state_shardings(state, mesh)

        def to_global(x, sharding):  # every process holds the same host value
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

        nnx.update(model, jax.tree.map(to_global, state, shardings))
        # S = 29 does not split over sp: inputs go in split over fsdp only, the model pads inside
        tok_sharding = jax.sharding.NamedSharding(mesh, P(FSDP, None))
        logp = log_probs_fn()(model, to_global(tokens, tok_sharding), to_global(seg, tok_sharding))
        full = multihost_utils.process_allgather(logp, tiled=True)
    if jax.process_index() == 0:
        np.save(workdir / "logp.npy", np.asarray(full))
    jax.distributed.shutdown()


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    import jax

    from qwen35_jax.parallel.mesh import make_mesh, shard_model

    run_processes([sys.executable, __file__, str(tmp_path)])
    got = np.load(tmp_path / "logp.npy")

    model, tokens, seg = tiny_model_and_batch()
    mesh = make_mesh(LAYOUT)
    with jax.set_mesh(mesh):
        want = log_probs_fn()(shard_model(model, mesh), tokens, seg)
    assert got.shape == (B, S)
    assert np.abs(np.asarray(want)).sum() > 0
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    worker(Path(sys.argv[1]))
