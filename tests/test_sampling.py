"""The sampler: draw frequencies, what top-k and top-p keep, the reported log-probs, the keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_jax.generation.sampling import SamplingOptions, kept_tokens, row_keys, sample_tokens

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)


def _draws(options: SamplingOptions, n: int, logits=LOGITS, seed: int = 0):
    """n draws for one row (sample indices 0..n-1, step 0) and their log-probs."""
    rows = jnp.zeros((n,), jnp.int32)
    keys = row_keys(jnp.int32(seed), rows, jnp.arange(n, dtype=jnp.int32), jnp.int32(0))
    tokens, log_probs = jax.jit(sample_tokens, static_argnums=2)(jnp.tile(logits, (n, 1)), keys, options)
    return np.asarray(tokens), np.asarray(log_probs)


def test_frequencies_match_the_tempered_softmax():
    n, temperature = 20_000, 0.7
    tokens, _ = _draws(SamplingOptions(temperature=temperature), n)
    p = np.exp(LOGITS.astype(np.float64) / temperature)
    p /= p.sum()
    counts = np.bincount(tokens, minlength=LOGITS.size)
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    # 5 degrees of freedom: P(chi2 > 20.5) = 0.001 for a correct sampler; at this fixed seed it is a
    # fixed number, while drawing from the untempered softmax instead gives chi2 in the thousands
    assert chi2 < 20.5, (counts, n * p)


def test_top_k_and_top_p_keep_exactly_the_intended_tokens():
    logits = jnp.asarray(np.log(np.array([[0.05, 0.5, 0.15, 0.3]], np.float32)))  # ranks: 1, 3, 2, 0
    def kept(k, p):
        return np.flatnonzero(np.asarray(kept_tokens(logits, k, p))[0]).tolist()
    assert kept(0, 1.0) == [0, 1, 2, 3]
    assert kept(2, 1.0) == [1, 3]
    assert kept(0, 0.79) == [1, 3]  # 0.5 + 0.3 reaches 0.79: the third token has 0.8 ranked above it
    assert kept(0, 0.81) == [1, 2, 3]
    assert kept(0, 0.2) == [1]  # the top token always stays
    assert kept(3, 0.7) == [1, 3]  # top-p on the top-k renormalised: 0.5/0.95 < 0.7 <= 0.8/0.95
    assert kept(1, 0.01) == [1]
    ties = jnp.zeros((1, 5))
    assert np.flatnonzero(np.asarray(kept_tokens(ties, 2, 1.0))[0]).tolist() == [0, 1]  # ties: lower ids


@pytest.mark.parametrize("top_k,top_p", [(2, 1.0), (0, 0.6), (3, 0.9)])
def test_draws_come_from_the_kept_tokens_and_report_the_full_vocab_log_prob(top_k, top_p):
    options = SamplingOptions(temperature=1.3, top_k=top_k, top_p=top_p)
    tokens, log_probs = _draws(options, 2000)
    allowed = np.flatnonzero(np.asarray(kept_tokens(jnp.asarray(LOGITS[None] / 1.3), top_k, top_p))[0])
    assert set(tokens.tolist()) == set(allowed.tolist())
    full = LOGITS.astype(np.float64) / 1.3
    full = full - np.log(np.exp(full).sum())  # log_softmax(logits / T) over the whole vocabulary
    np.testing.assert_allclose(log_probs, full[tokens], atol=1e-6)


def test_greedy_takes_the_argmax_and_reports_its_log_prob_at_temperature_one():
    tokens, log_probs = _draws(SamplingOptions(temperature=0), 3)
    assert tokens.tolist() == [0, 0, 0]
    want = LOGITS[0] - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    np.testing.assert_allclose(log_probs, want, atol=1e-6)


def test_keys_depend_on_seed_row_sample_and_step_only():
    base = row_keys(jnp.int32(1), jnp.array([0, 5]), jnp.array([0, 2]), jnp.int32(3))
    again = row_keys(jnp.int32(1), jnp.array([5, 7, 0]), jnp.array([2, 0, 0]), jnp.int32(3))
    data = jax.random.key_data
    np.testing.assert_array_equal(data(base)[1], data(again)[0])  # same (row, sample, step): same key
    np.testing.assert_array_equal(data(base)[0], data(again)[2])
    for other in (row_keys(jnp.int32(2), jnp.array([0]), jnp.array([0]), jnp.int32(3)),
                  row_keys(jnp.int32(1), jnp.array([1]), jnp.array([0]), jnp.int32(3)),
                  row_keys(jnp.int32(1), jnp.array([0]), jnp.array([1]), jnp.int32(3)),
                  row_keys(jnp.int32(1), jnp.array([0]), jnp.array([0]), jnp.int32(4))):
        assert not np.array_equal(data(other)[0], data(base)[0])


@pytest.mark.parametrize("kw,message", [({"temperature": -0.5}, "temperature"), ({"top_k": -1}, "top_k"),
                                         ({"top_p": 1.5}, "top_p")])
def test_bad_options_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingOptions(**kw)
