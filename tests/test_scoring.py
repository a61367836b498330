"""Log-probs and entropy of whole sequences: the fused path, every mesh layout, packing, padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qwen35_jax.config import Qwen35Config
from qwen35_jax.labels import IGNORE, next_token_labels
from qwen35_jax.model import Qwen35ForCausalLM
from qwen35_jax.parallel.mesh import make_mesh, shard_model
from qwen35_jax.scoring import check_inputs, score_batches

# 8 query heads and 8 value heads so that sp = 8 is a valid layout
CONFIG = Qwen35Config.preset("tiny", num_attention_heads=8, linear_num_value_heads=8)


@pytest.fixture(scope="module")
def model() -> Qwen35ForCausalLM:
    return Qwen35ForCausalLM(CONFIG, rngs=nnx.Rngs(3))


def on_mesh(model, mesh):
    """A copy of `model` with its parameters ZeRO-3 sharded on `mesh`."""
    return shard_model(nnx.clone(model), mesh)


def full_logits_scores(model, tokens, segment_ids, temperature):
    """The naive truth: full [B, S, V] logits, log_softmax, gather."""
    hidden = model(jnp.asarray(tokens), segment_ids=jnp.asarray(segment_ids))
    logp = jax.nn.log_softmax(model.logits(hidden) / temperature, axis=-1)  # [B, S, V]
    labels = np.asarray(next_token_labels(tokens, segment_ids))
    picked = jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return (np.where(labels != IGNORE, picked, 0.0),
            np.where(segment_ids > 0, entropy, 0.0))


def packed_batch(rng, batch=3, seq=13):
    tokens = rng.integers(0, CONFIG.vocab_size, size=(batch, seq))
    segments = np.ones((batch, seq), np.int32)
    segments[0, 5:] = 2  # two documents
    segments[1, 9:] = 0  # padding tail
    segments[2, 3:8], segments[2, 8:] = 2, 3
    return tokens, segments


@pytest.mark.parametrize("layout", ["fsdp=1,sp=1", "fsdp=1,sp=8", "fsdp=2,sp=4", "fsdp=4,sp=2", "fsdp=8,sp=1"])
def test_fused_scores_equal_full_logits_on_every_mesh(model, layout):
    tokens, segments = packed_batch(np.random.default_rng(0))
    devices = jax.devices()[:1] if layout == "fsdp=1,sp=1" else None
    mesh = make_mesh(layout, devices)
    lp, ent = score_batches(on_mesh(model, mesh), tokens, segments, mesh=mesh, temperature=0.7)
    want_lp, want_ent = full_logits_scores(model, tokens, segments, 0.7)
    np.testing.assert_allclose(lp, want_lp, atol=1e-5)
    np.testing.assert_allclose(ent, want_ent, atol=1e-5)
    assert lp.shape == tokens.shape and lp.dtype == np.float32
    # document ends and padding score nothing
    assert lp[0, 4] == 0 and lp[1, 8:].tolist() == [0.0] * 5 and ent[1, 9:].tolist() == [0.0] * 4


def test_bfloat16_compute_scores_with_the_lm_head_in_bfloat16():
    """With dtype bfloat16 the fused loss multiplies the bf16 hidden states by the lm_head weight cast to
    bf16, as `logits()` does (float32 accumulation in both): the scores equal the full-logits truth of
    the same model to float32 summation order. A float32 weight would differ by bf16 rounding (~4e-3)."""
    config = CONFIG.replace(dtype="bfloat16")
    bf16_model = Qwen35ForCausalLM(config, rngs=nnx.Rngs(3))
    tokens, segments = packed_batch(np.random.default_rng(1))
    mesh = make_mesh("fsdp=1,sp=1", jax.devices()[:1])
    lp, ent = score_batches(on_mesh(bf16_model, mesh), tokens, segments, mesh=mesh)
    want_lp, want_ent = full_logits_scores(bf16_model, tokens, segments, 1.0)
    np.testing.assert_allclose(lp, want_lp, atol=1e-4)
    np.testing.assert_allclose(ent, want_ent, atol=1e-4)


def test_vocab_parallel_lm_head_equals_gather(model):
    tokens, segments = packed_batch(np.random.default_rng(1), batch=4, seq=16)
    mesh = make_mesh("fsdp=2,sp=4")
    model = on_mesh(model, mesh)
    gather = score_batches(model, tokens, segments, mesh=mesh, lm_head_mode="gather")
    vocab = score_batches(model, tokens, segments, mesh=mesh, lm_head_mode="vocab_parallel")
    np.testing.assert_allclose(vocab[0], gather[0], atol=1e-5)
    np.testing.assert_allclose(vocab[1], gather[1], atol=1e-5)


def test_row_batches_equal_one_batch(model):
    tokens, segments = packed_batch(np.random.default_rng(2), batch=5, seq=9)
    mesh = make_mesh("fsdp=2,sp=4")
    model = on_mesh(model, mesh)
    whole = score_batches(model, tokens, segments, mesh=mesh)
    split = score_batches(model, tokens, segments, mesh=mesh, batch_size=2)
    np.testing.assert_allclose(split[0], whole[0], atol=1e-6)


def test_bad_token_ids_are_named():
    tokens = np.array([[1, 2, CONFIG.vocab_size]])
    with pytest.raises(ValueError, match=r"token id 256 at \(0, 2\) is outside \[0, 256\)"):
        check_inputs(tokens, None, CONFIG.vocab_size, source="in.npy")
    with pytest.raises(ValueError, match="segment ids must be >= 0"):
        check_inputs(tokens[:, :2], np.array([[1, -1]]), CONFIG.vocab_size)
